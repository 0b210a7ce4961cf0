"""A KTO step, llmtrain against TRL's KTOTrainer, on CPU: the same model, rows, batch size and steps; completions a
second (each with its KL sequence) and peak RSS.

    OMP_NUM_THREADS=1 python benchmarks/kto_vs_trl.py                # about 2 minutes on 2 cores
    python benchmarks/kto_vs_trl.py --steps 10 --batch 8

The model is vs_hf.py's cpu-small (Mistral-7B-Instruct-v0.3's config shrunk to hidden 256 and 4 layers, the real
32768-token vocabulary), random-init once and saved, so both sides load the same weights, with the real tokenizer.
The rows are TRL's unpaired format from GSM8K: each question with its real answer (label true) and with the answer's
final number changed (label false), plain strings, as the oracle test (tests/test_kto.py) shows both sides tokenise
alike (prompt + completion + EOS). Both train full in fp32 (the reference: TRL's ref_model loaded from the same
folder, llmtrain's frozen copy), loss_type kto, beta 0.1, the same lr, each side in its own process:

- TRL 1.16 `KTOTrainer` (padded batches, its sequential sampler as the KL estimate requires), timed by a callback at
  each step's end;
- llmtrain (`python -m llmtrain finetune`, padding-free rows, varlen attention), read from metrics.jsonl's
  `elapsed_s`.

Both go through the same rows (steps x batch of them, one epoch): TRL in file order, llmtrain in its seeded shuffle,
so a step's rows differ but the timed steps' rows are most of the same set. The first 2 steps are left out (warm-up).
Prints one JSON line per side and a line of ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from grpo_vs_trl import both_sides
from preference_step import GSM8K, MISTRAL, SMALL  # the same model and data as the DPO step's benchmark

SKIP = 2  # warm-up steps left out of the means


def write_inputs(work: Path, rows: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(MISTRAL)
    for k, v in SMALL.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(work / "model")
    out = []
    for line in GSM8K.read_text().splitlines():
        r = json.loads(line)
        body, final = r["answer"].rsplit("####", 1)
        if final.strip().isdigit():
            out += [{"prompt": r["question"], "completion": r["answer"], "label": True},
                    {"prompt": r["question"], "completion": f"{body}#### {int(final) * 10 + 1}", "label": False}]
        if len(out) >= rows:
            break
    (work / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out[:rows]))


def run_trl(work: Path, a) -> list[float]:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(MISTRAL)
    data = datasets.Dataset.from_list([json.loads(x) for x in (work / "kto.jsonl").read_text().splitlines()])
    args = KTOConfig(output_dir=str(work / "trl"), use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                     per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=1e-5, seed=a.seed,
                     save_strategy="no", beta=0.1, loss_type="kto", max_length=a.max_length)
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())

    trainer = KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    return [b - a_ for a_, b in zip([start, *ends], ends)]


def run_llmtrain(work: Path, a) -> list[float]:
    recipe = {
        "model": {"name_or_path": str(work / "model"), "tokenizer": str(MISTRAL), "dtype": "float32"},
        "data": {"path": str(work / "kto.jsonl"), "format": "unpaired", "max_seq_len": a.max_length,
                 "cache_dir": str(work / "cache")},
        "kto": {"beta": 0.1, "loss_type": "kto"},
        "train": {"max_steps": a.steps, "micro_batch_size": a.batch, "lr": 1e-5, "schedule": "constant",
                  "warmup_steps": 0, "seed": a.seed},
        "checkpoint": {"save_final": False}, "logging": {"progress": False, "every_steps": 1},
        "output_dir": str(work / "llmtrain"),
    }
    (work / "kto.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    from llmtrain.config import load_recipe
    from llmtrain.loop.train import train

    train(load_recipe(work / "kto.yaml"))
    lines = [json.loads(x) for x in (work / "llmtrain" / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in lines if r["type"] == "train"]
    return [b - a_ for a_, b in zip([0.0, *elapsed], elapsed)]


def side(name: str, work: Path, a) -> None:
    """One side in this process: its step time, completions a second and peak RSS as one JSON line."""
    steps = (run_trl if name == "trl" else run_llmtrain)(work, a)[SKIP:]
    step = sum(steps) / len(steps)
    print(json.dumps({"side": name, "step_s": round(step, 3), "completions_per_s": round(a.batch / step, 2),
                      "steps_timed": len(steps), "batch": a.batch,
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", dest="max_length", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", choices=["trl", "llmtrain"])
    p.add_argument("--work")
    a = p.parse_args()
    if a.side:
        return side(a.side, Path(a.work), a)
    if not MISTRAL.exists() or not GSM8K.exists():
        sys.exit(f"needs {MISTRAL} and {GSM8K}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_inputs(work, a.steps * a.batch)
        t, m = both_sides(__file__, work, a, ("steps", "batch", "max_length", "seed"))
        print(json.dumps({"speedup": round(t["step_s"] / m["step_s"], 2),
                          "rss_ratio": round(m["peak_rss_mib"] / t["peak_rss_mib"], 2)}))


if __name__ == "__main__":
    main()
