"""Peak memory of one packed training step on the CPU: the old path against the fast path.

    OMP_NUM_THREADS=2 python benchmarks/step_memory.py [--examples 48]

A small Mistral shape (hidden 256, 4 layers, the real 32,768-token vocabulary), random init, fp32, full
fine-tune; GSM8K rows rendered as user/assistant messages through the real Mistral-7B-Instruct-v0.3 chat
template (../shared), `--examples` of them packed into one padding-free row. One forward + backward,
measured with torch's MemTracker (every live tensor: parameters, gradients, activations, temporaries):
- before: transformers' SDPA on the packed row (block-diagonal mask built by transformers, L x L) and the
  loss over full fp32 logits (one chunk as large as the row);
- after: llmtrain's varlen attention (SDPA per example on CPU) and the chunked loss over trained positions,
  at the default chunk of 4096 tokens and at 1024 (at this small hidden size one chunk's fp32 logits and
  their gradient, 4096 x 32768 x 4 bytes each, are most of what is left).
Prints one JSON line per path: peak bytes, and the growth per packed token over the parameters and their
gradients.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
MISTRAL, GSM8K = SHARED / "models" / "mistral-7b-instruct-v0.3", SHARED / "data" / "gsm8k" / "train.jsonl"


def packed_batch(n: int, tokenizer) -> dict:
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.data.formats import encode_messages

    examples = []
    for line in GSM8K.read_text().splitlines()[:n]:
        row = json.loads(line)
        ids, labels = encode_messages([{"role": "user", "content": row["question"]},
                                       {"role": "assistant", "content": row["answer"]}], tokenizer,
                                      train_on_prompt=False)
        examples.append({"input_ids": ids, "labels": labels})
    return with_loss_positions(collate(examples, pad_id=0, packing=True))


def peak(attn: str, chunk: int, batch: dict) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, MistralConfig

    from llmtrain.model.attention import register
    from llmtrain.model.loss import attach_loss, compute_loss

    cfg = MistralConfig.from_pretrained(MISTRAL)
    cfg.update(dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=32))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                             attn_implementation=register() if attn == "varlen" else attn)
    model.config.use_cache = False
    attach_loss(model, chunk=chunk)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        compute_loss(model, batch).backward()
    total = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    tokens = batch["input_ids"].numel()
    return {"path": f"{attn}, loss chunk {chunk}", "tokens": tokens, "trained": len(batch["loss_index"]),
            "peak_bytes": total, "peak_gib": round(total / 2**30, 3),
            "per_token_kb": round((total - 2 * params) / tokens / 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=48)
    args = parser.parse_args()
    if not MISTRAL.is_dir() or not GSM8K.is_file():
        sys.exit(f"needs {MISTRAL} and {GSM8K}")
    from transformers import AutoTokenizer

    batch = packed_batch(args.examples, AutoTokenizer.from_pretrained(MISTRAL))
    before = peak("sdpa", batch["input_ids"].numel(), batch)
    after = peak("varlen", 4096, batch)
    small_chunks = peak("varlen", 1024, batch)
    for row in (before, after, small_chunks):
        print(json.dumps(row))
    print(json.dumps({"peak_ratio": round(before["peak_bytes"] / after["peak_bytes"], 2)}))


if __name__ == "__main__":
    main()
