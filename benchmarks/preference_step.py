"""A preference (DPO) step padding-free against padded, on the same pairs: tokens/s and peak memory, CPU or GPU.

    OMP_NUM_THREADS=1 python benchmarks/preference_step.py              # CPU: cpu-small, fp32 (about 2 minutes)
    python benchmarks/preference_step.py --repeat 3 --steps 12          # more rounds

The model is vs_hf.py's cpu-small (Mistral-7B-Instruct-v0.3's config shrunk to hidden 256 and 4 layers, the real
32768-token vocabulary, random init, full fine-tune in fp32); its real tokenizer and chat template render the pairs.
Pairs come from GSM8K (../shared/data/gsm8k): the question is the prompt, chosen its real answer, rejected the same
answer with the final number changed (times 10, plus 1). Both runs are the real CLI (`python -m llmtrain finetune`)
with DPO against a precomputed reference, the same `micro_batch_size` pairs per step and the same steps:

- packed: `model.attn_implementation=auto`: each micro-batch is one padding-free row, chosen and rejected of
  every pair one after the other, varlen attention per sequence (what llmtrain does by default);
- padded: `model.attn_implementation=sdpa data.packing=false`: one row per sequence, right-padded to the longest
  of the micro-batch, with an attention mask (what TRL's DPOTrainer does).

Measured alike: real (non-pad) tokens per second over the steps after the first two (from metrics.jsonl's
`tokens` and `elapsed_s`), and the process's peak RSS (CPU) or torch.cuda.max_memory_allocated (GPU, from
summary.json). Prints one JSON line per run and a line of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MISTRAL = SHARED / "models" / "mistral-7b-instruct-v0.3"
GSM8K = SHARED / "data" / "gsm8k" / "train.jsonl"
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=896, head_dim=32)
VARIANTS = {"packed": ["model.attn_implementation=auto"],
            "padded": ["model.attn_implementation=sdpa", "data.packing=false"]}


def write_inputs(work: Path, pairs: int) -> Path:
    cfg = json.loads((MISTRAL / "config.json").read_text())
    cfg.update(SMALL, torch_dtype="float32", use_cache=False)
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    rows = []
    for line in GSM8K.read_text().splitlines():
        r = json.loads(line)
        body, final = r["answer"].rsplit("####", 1)
        if final.strip().isdigit():
            wrong = str(int(final) * 10 + 1)
            rows.append({"prompt": r["question"], "chosen": r["answer"], "rejected": f"{body}#### {wrong}"})
        if len(rows) == pairs:
            break
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"name_or_path": str(work / "model"), "tokenizer": str(MISTRAL), "random_init": True,
                  "dtype": "float32"},
        "data": {"path": str(data), "format": "preference", "chat_template": True, "max_seq_len": 512,
                 "cache_dir": str(work / "cache")},
        "preference": {"loss": "dpo", "beta": 0.1, "reference": "precomputed"},
        "train": {"micro_batch_size": 4, "lr": 1e-5, "warmup_steps": 0, "seed": 0, "mixed_precision": "no"},
        "logging": {"every_steps": 1, "progress": False},
        "checkpoint": {"save_final": False},
        "output_dir": str(work / "run"),
    }
    path = work / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def run(recipe: Path, work: Path, variant: str, steps: int) -> dict:
    out = work / f"run-{variant}"
    code = ("import resource, sys, runpy; sys.argv = ['llmtrain', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('llmtrain', run_name='__main__')\n"
            "finally:\n    print('PEAK_RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, "finetune", str(recipe), f"output_dir={out}",
                           f"train.max_steps={steps}", "--overwrite", *VARIANTS[variant]],
                          cwd=REPO, capture_output=True, text=True, env=os.environ)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in ln]
    timed = lines[2:]
    dt = timed[-1]["elapsed_s"] - lines[1]["elapsed_s"]
    summary = json.loads((out / "summary.json").read_text())
    rss = int(next(ln.split()[1] for ln in proc.stderr.splitlines() if ln.startswith("PEAK_RSS"))) * 1024
    return {"variant": variant, "tokens_per_s": sum(r["tokens"] for r in timed) / dt,
            "peak_memory_bytes": summary.get("max_memory_allocated") or rss,
            "memory": "cuda max_memory_allocated" if summary.get("max_memory_allocated") else "peak RSS",
            "real_tokens_per_step": sum(r["tokens"] for r in lines) / len(lines),
            "losses": [round(r["loss"], 6) for r in lines]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    missing = [str(p) for p in (MISTRAL / "config.json", GSM8K) if not p.exists()]
    if missing:
        print(json.dumps({"skipped": f"not available: {', '.join(missing)}"}))
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="llmtrain-pref-"))
    recipe = write_inputs(work, pairs=4 * args.steps)
    best = {}
    for _ in range(args.repeat):
        for variant in VARIANTS:
            row = run(recipe, work, variant, args.steps)
            print(json.dumps(row), flush=True)
            if variant not in best or row["tokens_per_s"] > best[variant]["tokens_per_s"]:
                best[variant] = row
    p, q = best["packed"], best["padded"]
    assert p["losses"] == q["losses"] or max(abs(a - b) for a, b in zip(p["losses"], q["losses"])) < 1e-4
    print(json.dumps({"packed/padded tokens_per_s": p["tokens_per_s"] / q["tokens_per_s"],
                      "packed/padded peak_memory": p["peak_memory_bytes"] / q["peak_memory_bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
