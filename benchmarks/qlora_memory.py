"""Peak host memory of a QLoRA step against the same step with LoRA on a bf16 base (CPU).

    OMP_NUM_THREADS=1 python benchmarks/qlora_memory.py

A Llama shaped so that its decoder linears dominate (hidden 1024, MLP 4096, 8 layers, a 512-token vocabulary:
134M weights, 126M of them in the linears), random weights saved once in bf16, the tiny task's character tokenizer
(`llmtrain prepare-tiny`). Both runs are the real CLI, LoRA r 16 on every linear, bf16 autocast, 3 steps of 8
examples: `model.quantize=nf4` against none. Prints, per run, the process's RSS after each step (its maximum), its
peak RSS over the whole run (loading included: transformers reads the bf16 weights before quantising them), and
the size of the model's weights as loaded (Params4bit counts its packed storage), and a line of ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)
CODE = """
import resource, sys, runpy, torch
import llmtrain.loop.phases as P
real = P.build_model
def spy(*a, **k):
    t = real(*a, **k)
    print("WEIGHT_BYTES", sum(p.numel() * p.element_size() for p in t.model.parameters()), file=sys.stderr)
    return t
P.build_model = spy
import llmtrain.loop.train as T
T.build_model = spy
import psutil
step_rss, real_step = [], T.train_step
def step(*a, **k):
    out = real_step(*a, **k)
    step_rss.append(psutil.Process().memory_info().rss)
    return out
T.train_step = step
sys.argv = ["llmtrain", *sys.argv[1:]]
try:
    runpy.run_module("llmtrain", run_name="__main__")
finally:
    print("PEAK_RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)
    print("STEP_RSS", max(step_rss), file=sys.stderr)
"""


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.tiny import prepare_tiny

    work = Path(tempfile.mkdtemp(prefix="llmtrain-qlora-mem-"))
    prepare_tiny(work / "tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(work / "model")
    recipe = {
        "model": {"name_or_path": str(work / "model"), "tokenizer": str(work / "tiny" / "model"), "dtype": "bfloat16",
                  "attn_implementation": "auto"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"path": str(work / "tiny" / "data" / "train.jsonl"), "format": "prompt_completion",
                 "max_seq_len": 64, "cache_dir": str(work / "cache")},
        "train": {"max_steps": 3, "micro_batch_size": 8, "lr": 1e-4, "mixed_precision": "bf16", "seed": 0},
        "logging": {"progress": False}, "checkpoint": {"save_final": False}, "output_dir": str(work / "run"),
    }
    (work / "recipe.yaml").write_text(json.dumps(recipe))
    rows = {}
    for name, extra in (("lora-bf16", []), ("qlora-nf4", ["model.quantize=nf4"])):
        proc = subprocess.run([sys.executable, "-c", CODE, "finetune", str(work / "recipe.yaml"),
                               f"output_dir={work / name}", *extra], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        got = dict(line.split()[:2] for line in proc.stderr.splitlines()
                   if line.startswith(("PEAK_RSS", "STEP_RSS", "WEIGHT_")))
        rows[name] = {"run": name, "rss_during_steps_bytes": int(got["STEP_RSS"]),
                      "peak_rss_bytes": int(got["PEAK_RSS"]), "weight_bytes": int(got["WEIGHT_BYTES"])}
        print(json.dumps(rows[name]), flush=True)
    q, b = rows["qlora-nf4"], rows["lora-bf16"]
    print(json.dumps({"qlora/lora rss_during_steps": q["rss_during_steps_bytes"] / b["rss_during_steps_bytes"],
                      "qlora/lora peak_rss": q["peak_rss_bytes"] / b["peak_rss_bytes"],
                      "qlora/lora weight_bytes": q["weight_bytes"] / b["weight_bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
