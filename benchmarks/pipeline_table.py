"""The pipeline table of docs/scaling.md: Llama-2-7B full fine-tuning (recipes/llama7b.yaml: fp32 master weights,
bf16 autocast, micro-batches of 4 x 512 tokens, gradient checkpointing) on 2 and 4 nodes of 8 H100s (80 GB), over
InfiniBand (400 Gb/s a GPU) and over one 100 Gb/s Ethernet card a node (12.5 Gb/s a GPU): HSDP and FSDP over every
GPU against a pipeline of one stage a node with FSDP over its 8 GPUs (1F1B; DDP, which does not fit, left out), all
at the same global batch (the
recipe's 2 micro-batches on each of the data-parallel GPUs: the pipeline's 8 data ranks a stage run 2 P each).
Memory per GPU (the worst stage's for the pipeline) and the step time by the model (comms.Traffic.step_s).

    python benchmarks/pipeline_table.py

tests/test_memory_pipeline.py checks that docs/scaling.md shows what this prints.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINKS = {"InfiniBand (400 Gb/s a GPU)": 400.0, "100 Gb/s Ethernet a node (12.5 a GPU)": 12.5}


def rows() -> list[str]:
    from llmtrain.config import load_recipe
    from llmtrain.memory.comms import Network
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.pipeline import compared
    from llmtrain.memory.spec import GIB, spec_from_recipe

    shape = load_model_shape("llama-2-7b")
    recipe = load_recipe(REPO / "recipes" / "llama7b.yaml", [])
    out = [("| nodes x GPUs | network between nodes | layout | micro-batches a step per data rank | GiB per GPU | "
            "compute s | network s | step s | its step time over the pipeline's |"),
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for nodes in (2, 4):
        spec = spec_from_recipe(recipe, strategy="fsdp", num_gpus=8, num_nodes=nodes, pipeline_parallel=nodes)
        # the same global batch on 1/P of the data ranks
        spec = spec.but(grad_accum_steps=spec.grad_accum_steps * nodes)
        for link, gbps in LINKS.items():
            found = compared(shape, spec, Network(inter_gbps=gbps))
            pipe = found[0][2].step_s
            for label, est, t in found:
                if not est.fits:  # DDP: a whole full fine-tune of a 7B on each GPU, 154 GiB
                    continue
                speedup = "" if t is found[0][2] else f"{t.step_s / pipe:.2f}x"
                out.append(f"| {nodes} x 8 | {link} | {label} | {est.spec.grad_accum_steps} | "
                           f"{est.per_gpu_peak_bytes / GIB:.1f} | {t.compute_s:.3f} | {t.network_s:.3f} | "
                           f"{t.step_s:.3f} | {speedup} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
