"""Throughput baseline: run llmtrain's own `train()` on a random-init model of a real shape.

    python benchmarks/throughput.py --shape llama2-7b-lora      # on the H100
    python benchmarks/throughput.py --shape llama-1b-full
    python benchmarks/throughput.py --shape tiny --steps 4      # CPU smoke run of the script itself

Under FSDP2 (one process on one GPU: the sharding code path, with nothing to shard across), the two 7B
shapes of the scale-out GPU check; the full fine-tune needs its parameters, gradients and AdamW state
(about 108 GiB) offloaded to the host to fit 80 GB:

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 \
        benchmarks/throughput.py --shape llama2-7b-lora
    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 --fsdp_offload_params true \
        benchmarks/throughput.py --shape llama2-7b-full --steps 6

Prints one JSON object per run: tokens/s (median over the steps after warm-up), MFU and peak memory.
Weights are random (model.random_init): throughput and memory do not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

SHAPES = {
    # name: (LlamaConfig kwargs, LoRA?, dtype, mixed precision)
    "llama2-7b-lora": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32, vocab_size=32000), True, "bfloat16", "bf16"),
    "llama2-7b-full": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32, vocab_size=32000), False, "float32", "bf16"),
    "llama-1b-full": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000), False, "float32", "bf16"),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000), False, "float32", "no"),
}
PEAK_FLOPS = {"cuda": 989e12, "cpu": float("nan")}  # H100 SXM dense bf16


def flops_per_token(cfg: dict, *, n_params: int, seq_len: int, lora: bool) -> float:
    """Model FLOPs per trained token (PaLM appendix B), recomputation excluded.

    Dense: 2N forward + 4N backward. Under LoRA the frozen base needs activation gradients (2N) but no
    weight gradients, so 4N. Attention adds 12 * layers * hidden * seq per token (forward + backward).
    """
    dense = (4 if lora else 6) * n_params
    return dense + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq_len


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b-lora")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="Steps left out of the median.")
    ap.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--packing", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig

    from llmtrain.config import Recipe
    from llmtrain.loop.train import train
    from llmtrain.tiny import prepare_tiny

    shape, lora, dtype, mp = SHAPES[args.shape]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="llmtrain-bench-"))
    model_dir = work / "model"
    prepare_tiny(work / "tiny")  # only its tokenizer is used: every character is one token
    LlamaConfig(**shape, max_position_embeddings=max(4096, args.seq_len)).save_pretrained(model_dir)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(work / "tiny" / "model").save_pretrained(model_dir)
    rng = random.Random(0)
    n_examples = args.micro_batch * (args.steps + 1)
    with (work / "data.jsonl").open("w") as f:  # each example is exactly seq_len tokens (BOS + text + EOS)
        for _ in range(n_examples):
            f.write(json.dumps({"text": "".join(rng.choice("abcdefghij") for _ in range(args.seq_len - 2))}) + "\n")
    recipe = Recipe.model_validate({
        "model": {"name_or_path": str(model_dir), "random_init": True, "dtype": dtype,
                  "gradient_checkpointing": args.grad_checkpointing},
        "data": {"path": str(work / "data.jsonl"), "format": "text", "max_seq_len": args.seq_len,
                 "packing": args.packing, "cache_dir": str(work / "cache")},
        "lora": {"r": 16} if lora else None,
        "train": {"max_steps": args.steps, "micro_batch_size": args.micro_batch, "lr": 1e-5, "mixed_precision": mp},
        "checkpoint": {"save_final": False},
        "logging": {"progress": False},
        "output_dir": str(work / "run"),
    })
    summary = train(recipe, overwrite=True)
    steps = [json.loads(ln) for ln in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["type"] == "train"][args.warmup:]
    tps = statistics.median(s["tokens_per_s"] for s in steps)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fpt = flops_per_token(shape, n_params=summary["params_total"], seq_len=args.seq_len, lora=lora)
    result = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "seq_len": args.seq_len, "micro_batch": args.micro_batch, "grad_checkpointing": args.grad_checkpointing,
        "params_total": summary["params_total"], "params_trainable": summary["params_trainable"],
        "tokens_per_s": tps, "mfu": fpt * tps / PEAK_FLOPS[device],
        "max_memory_allocated_gib": summary.get("max_memory_allocated", 0) / 2**30,
        "max_memory_reserved_gib": summary.get("max_memory_reserved", 0) / 2**30,
        "predicted_allocated_gib": summary.get("predicted_peak_allocated_bytes", 0) / 2**30,
        "predicted_reserved_gib": summary.get("predicted_peak_reserved_bytes", 0) / 2**30,
        "predicted_peak_gib": summary.get("predicted_peak_bytes", 0) / 2**30,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
