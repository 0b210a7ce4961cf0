"""Host RAM per process while an FSDP run loads its model: does only the main process read the weights?

With fsdp_cpu_ram_efficient_loading (accelerate_configs/fsdp.yaml), the main process reads the checkpoint
and the others build an empty model and receive their shards in `prepare`, so the job's host RAM holds
one copy of the weights, not one per process. This builds the model exactly as `train()` does, prepares
it with an optimizer, and prints each process's peak resident memory (ru_maxrss).

    # a random-init Llama of 0.55B parameters (1.1 GB in bf16, 2.2 GB once loaded in fp32), written once
    python benchmarks/fsdp_host_memory.py --write-model /tmp/llama-0.55b
    # 2 CPU processes, FSDP2 (runs on a GPU node with accelerate_configs/fsdp.yaml just the same)
    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml benchmarks/fsdp_host_memory.py /tmp/llama-0.55b
    # the same with every process reading the weights, for comparison
    ... benchmarks/fsdp_host_memory.py /tmp/llama-0.55b --every-rank-reads
"""

from __future__ import annotations

import argparse
import resource

import torch


def write_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512)
    # Stored in bf16, as Llama-2 (fp16) and Mistral-7B (bf16) are on the hub, and loaded in fp32 as the full
    # fine-tune recipes do: every process that reads the weights holds its own fp32 copy in host RAM.
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()):,} parameters")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--write-model")
    ap.add_argument("--every-rank-reads", action="store_true", help="switch rank-0-only loading off")
    args = ap.parse_args()
    if args.write_model:
        return write_model(args.write_model)

    from llmtrain.config import Recipe
    from llmtrain.model.modeling import build_optimizer, load_model
    from llmtrain.parallel.accelerator import build_accelerator
    from llmtrain.parallel.fsdp import receives_weights

    recipe = Recipe.model_validate({"model": {"name_or_path": args.model, "dtype": "float32"},
                                    "data": {"path": "unused.jsonl", "format": "text"}, "output_dir": "unused"})
    accelerator = build_accelerator(recipe)
    before = peak_rss_gib()
    empty = receives_weights(accelerator) and not args.every_rank_reads
    model = load_model(recipe.model, None, device=accelerator.device, empty=empty)
    loaded = peak_rss_gib()
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, fused=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**30
    accelerator.wait_for_everyone()
    print(f"rank {accelerator.process_index}: read weights={not empty}  peak RSS before load {before:.2f} GiB, "
          f"after load {loaded:.2f} GiB, after prepare {peak_rss_gib():.2f} GiB; own shard {shard:.2f} GiB",
          flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
