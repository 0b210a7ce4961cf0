"""Peak host memory of one packed LoRA training step on the CPU at long contexts, with and without model.tiled_mlp and
model.activation_offload.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py --tokens 8192 --layers 1 --configs plain tiled
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --tokens 8192 --layers 1 --doc 256 --configs plain tiled
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --tokens 16384 --layers 1 --doc 256 --configs tiled
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --tokens 8192 --layers 2 --doc 256 --configs plain offload
    python benchmarks/long_context.py --tokens 2048 --layers 2 --doc 256 --dtype float32   # each switch's time

Decoder layers shaped like Mistral-7B's (hidden 4096, intermediate 14336, 32 heads, 8 KV heads), random init in bf16,
a 1,024-token vocabulary, LoRA r=16 on every linear layer, gradient checkpointing on, llmtrain's varlen attention and
chunked loss; one row packing documents of --doc tokens. On the CPU that attention is SDPA's math kernel per document,
which keeps fp32 probabilities (heads x doc x 4 bytes a token: 262 KB at 2,048, 33 KB at 256); a GPU's flash kernel
keeps none, so short documents bring the CPU's per-token cost nearer a GPU's. Each configuration runs in a fresh
subprocess, which reports its resident set before the step and its peak (getrusage maxrss) after one forward and
backward: torch's CPU allocations never pass through tracemalloc, and a process's peak is never lowered, hence one
process each. One layer of this shape costs about 0.8 MB a token on the CPU untiled (docs of 2,048): 32K tokens
would need 25 GiB, more than this machine's share.

On a CPU the offload has nothing to gain: the host is the device, and the layer input is copied to another host
tensor (with one layer, the last layer's input is kept and nothing is copied at all). Its GPU saving, (layers - 2)
layer inputs, is not measurable here (measured: 4.80 GiB plain, 4.84 GiB offloaded, 2 layers at 8K).

The GPU mode (Llama-3.1-8B QLoRA: the longest context that trains, tokens/s of each configuration, peaks against
estimate-memory) is benchmarks/long_context_gpu.py, run by `benchmarks/gpu_session.sh long`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"plain": {}, "offload": {"activation_offload": True}, "tiled": {"tiled_mlp": True},
           "both": {"activation_offload": True, "tiled_mlp": True}}
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=1024, max_position_embeddings=131072)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def packed_batch(tokens: int, doc: int, vocab: int) -> dict:
    import torch

    from llmtrain.data.batching import collate, with_loss_positions

    g = torch.Generator().manual_seed(0)
    examples = []
    for start in range(0, tokens, doc):
        ids = torch.randint(0, vocab, (min(doc, tokens - start),), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    return with_loss_positions(collate(examples, pad_id=0, packing=True))


def one(name: str, tokens: int, layers: int, doc: int, dtype: str = "bfloat16") -> dict:
    """One configuration, in this process: build, one step, peak."""
    import torch
    from transformers import MistralConfig

    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.loss import attach_loss, compute_loss
    from llmtrain.model.modeling import load_model

    with tempfile.TemporaryDirectory() as tmp:
        MistralConfig(num_hidden_layers=layers, **SHAPE).save_pretrained(tmp)
        torch.manual_seed(0)
        cfg = ModelConfig(name_or_path=tmp, dtype=dtype, random_init=True, gradient_checkpointing=True,
                          **CONFIGS[name])
        model = load_model(cfg, LoraConfig(r=16, dropout=0.0)).train()
    attach_loss(model, chunk=4096)
    batch = packed_batch(tokens, doc, SHAPE["vocab_size"])
    before, peak_before = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    compute_loss(model, batch).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step = peak - before
    return {"config": name, "tokens": tokens, "doc": doc, "layers": layers, "dtype": dtype, "rss_before_gib": round(before / 2**30, 2),
            "peak_gib": round(peak / 2**30, 2), "step_gib": round(step / 2**30, 2),
            "step_kb_per_token": round(step / tokens / 1e3, 1), "build_peak_gib": round(peak_before / 2**30, 2),
            "step_s": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--doc", type=int, default=2048, help="tokens of each document packed into the row")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="float32 for the step's time on a CPU whose bf16 matmuls are slow (this project's)")
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens[0], args.layers, args.doc, args.dtype)), flush=True)
        return
    for tokens in args.tokens:
        for name in args.configs:
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--tokens", str(tokens), "--layers",
                                   str(args.layers), "--doc", str(args.doc), "--dtype", args.dtype],
                                  capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if proc.returncode == 0 and lines else
                  json.dumps({"config": name, "tokens": tokens, "error": proc.stderr[-800:]}), flush=True)


if __name__ == "__main__":
    main()
