"""The scaling table of docs/scaling.md: Llama-2-7B full fine-tuning and LoRA (recipes/llama7b.yaml and
recipes/llama7b-lora.yaml, each with its own micro-batch and accumulation per GPU) on 1, 8, 16 and 64 H100s, for
DDP, FSDP, HSDP, and FSDP and HSDP x TP with 2 tensor-parallel GPUs a group (half as many data-parallel ranks:
those rows double the accumulation to keep the recipe's global batch): memory per GPU (estimate-memory), bytes
each GPU sends per optimizer step within its node and across nodes, and the step's network and compute time (llmtrain/memory/comms.py, default bandwidths and MFU).

    python benchmarks/scaling_table.py                  # the table at the defaults (NVLink, 400 Gb/s per GPU)
    python benchmarks/scaling_table.py --inter-gbps 25  # nodes joined by one 200 Gb/s card each (25 per GPU)

tests/test_comms.py checks that docs/scaling.md shows what this prints.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1, "single", 1), (8, 1, "ddp", 1), (8, 1, "fsdp", 1), (8, 1, "fsdp", 2), (8, 2, "ddp", 1),
           (8, 2, "fsdp", 1), (8, 2, "hsdp", 1), (8, 2, "fsdp", 2), (8, 2, "hsdp", 2), (8, 8, "ddp", 1),
           (8, 8, "fsdp", 1), (8, 8, "hsdp", 1), (8, 8, "fsdp", 2), (8, 8, "hsdp", 2)]
RECIPES = {"full": "recipes/llama7b.yaml", "LoRA r=16": "recipes/llama7b-lora.yaml"}


def rows(inter_gbps: float | None = None, *, multi_node_only: bool = False) -> list[str]:
    from llmtrain.config import load_recipe
    from llmtrain.memory.comms import Network, step_traffic
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import GIB, spec_from_recipe

    shape = load_model_shape("llama-2-7b")
    network = Network() if inter_gbps is None else Network(inter_gbps=inter_gbps)
    out = ["| run | GPUs | strategy | GiB per GPU | GB sent within the node | GB sent across nodes | network s | "
           "compute s | bound by |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for name, path in RECIPES.items():
        recipe = load_recipe(REPO / path, [])
        for gpus, nodes, strategy, tp in LAYOUTS:
            if multi_node_only and nodes == 1:
                continue
            spec = spec_from_recipe(recipe, strategy=strategy, num_gpus=gpus, num_nodes=nodes, tp=tp)
            # the same examples per step on tp x fewer data ranks
            spec = spec.but(grad_accum_steps=spec.grad_accum_steps * tp)
            est, traffic = estimate(shape, spec), step_traffic(shape, spec, network)
            memory = f"{est.per_gpu_peak_bytes / GIB:.1f}" + ("" if est.fits else " (does not fit 80)")
            bound = "-" if not traffic.parts else ("network" if traffic.network_bound else "compute")
            label = f"{strategy} x tp{tp}" if tp > 1 else strategy
            out.append(f"| {name} | {gpus * nodes} ({nodes} x {gpus}) | {label} | {memory} | "
                       f"{traffic.intra_bytes / 1e9:.2f} | {traffic.inter_bytes / 1e9:.2f} | {traffic.network_s:.3f} | "
                       f"{traffic.compute_s:.3f} | {bound} |")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter-gbps", type=float, help="per-GPU bandwidth between nodes, Gb/s (multi-node rows only)")
    args = parser.parse_args()
    print("\n".join(rows(args.inter_gbps, multi_node_only=args.inter_gbps is not None)))
