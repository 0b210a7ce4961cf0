"""The step time of the no-grad forwards the estimate adds (comms.no_grad_flops) against measured steps, CPU or GPU.

    OMP_NUM_THREADS=2 python benchmarks/no_grad_forwards.py             # CPU (about 4 minutes)
    python benchmarks/no_grad_forwards.py --steps 12                     # more steps a run
    python benchmarks/no_grad_forwards.py --only dpo-adapter kto         # these runs and their baselines
    python benchmarks/no_grad_forwards.py --real --model-dir D --gsm8k F  # Mistral-7B's shape, bf16 (GPU)

A preference run with its reference precomputed runs one forward and backward a micro-batch; with
`preference.reference=adapter` it first runs the reference (the adapter disabled) over the same pairs under no_grad.
KTO's apo_zero_unpaired runs one reference forward; its kto loss three (the reference, and its KL sequences by the
policy and by the reference); the gradient-checkpointed pair checks that a forward is priced at the rate the
step's recompute implies (MFU leaves the recompute out). `llmtrain estimate-memory --json` prices each, so the
estimate's step time of each run over its baseline's (the same sequences with no extra forward: the precomputed DPO
run, and supervised fine-tuning on KTO's completions) is a prediction of the measured step time's ratio; this script
prints both. The absolute seconds depend on the assumed MFU and device, the ratios on the FLOPs alone.

The model is preference_step.py's Mistral-7B-Instruct-v0.3 config shrunk (hidden 512, 4 layers, the real
32768-token vocabulary, random init, fp32) with LoRA r 16 on every linear layer; the data, its GSM8K pairs
(../shared/data/gsm8k; the benchmark skips where it is absent), KTO's and SFT's rows the same answers unpaired. Each
run is the real CLI; its step time is the mean over the steps after the first two (metrics.jsonl's elapsed_s), the
same sequences in each run of a data file. Prints one JSON line per run and one of the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preference_step  # noqa: E402
from preference_step import write_inputs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=1792, head_dim=64)
LORA = ["lora.r=16", "lora.alpha=32", "lora.dropout=0.0", "train.lr=1e-4"]
# (run, its recipe's data and mode, the run whose steps hold the same sequences with no extra forward)
RUNS = {
    "dpo-precomputed": (["preference.reference=precomputed"], None),
    "dpo-adapter": (["preference.reference=adapter"], "dpo-precomputed"),
    # gradient checkpointing: the step recomputes the layers, which MFU does not count; a forward costs less of it
    "dpo-precomputed-gc": (["preference.reference=precomputed", "model.gradient_checkpointing=true"], None),
    "dpo-adapter-gc": (["preference.reference=adapter", "model.gradient_checkpointing=true"], "dpo-precomputed-gc"),
    "sft": (["data.format=prompt_completion", "preference=null", "train.micro_batch_size=8"], None),
    "kto-apo": (["data.format=unpaired", "preference=null", "kto.loss_type=apo_zero_unpaired",
                 "train.micro_batch_size=8"], "sft"),
    "kto": (["data.format=unpaired", "preference=null", "kto.loss_type=kto", "train.micro_batch_size=8"], "sft"),
}


def inputs(work: Path, pairs: int, *, real: bool = False) -> Path:
    """preference_step's recipe and pairs at SIZE (real: Mistral-7B's own shape, bf16); beside them the answers
    unpaired (KTO: chosen desirable, rejected not) and as prompt/completion rows (SFT), one file each, named by
    data.format."""
    recipe = write_inputs(work, pairs)
    cfg = json.loads((work / "model" / "config.json").read_text())
    own = json.loads((preference_step.MISTRAL / "config.json").read_text())
    shape = {**own, "torch_dtype": "bfloat16", "use_cache": False} if real else SIZE
    (work / "model" / "config.json").write_text(json.dumps({**cfg, **shape}))
    rows = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
    unpaired = [r for p in rows for r in ({"prompt": p["prompt"], "completion": p["chosen"], "label": True},
                                          {"prompt": p["prompt"], "completion": p["rejected"], "label": False})]
    (work / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    (work / "prompt_completion.jsonl").write_text("".join(
        json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in unpaired))
    return recipe


def overrides(work: Path, name: str) -> list[str]:
    keys = RUNS[name][0]
    fmt = next((k.split("=", 1)[1] for k in keys if k.startswith("data.format=")), None)
    data = [f"data.path={work / (fmt + '.jsonl')}"] if fmt else []
    real = ["model.dtype=bfloat16", "train.mixed_precision=bf16"] if REAL else []
    return [*keys, *data, *LORA, *real]


REAL = False  # --real: Mistral-7B's shape in bf16 (a GPU)


def run(recipe: Path, work: Path, name: str, steps: int) -> dict:
    out = work / f"run-{name}"
    given = overrides(work, name)
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "finetune", str(recipe), f"output_dir={out}",
                           f"train.max_steps={steps}", "--overwrite", *given],
                          cwd=REPO, capture_output=True, text=True, env=os.environ)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in ln]
    timed = lines[2:]  # the same steps' sequences in every run of one data file: their total time
    est = subprocess.run([sys.executable, "-m", "llmtrain", "estimate-memory", str(recipe), "--json", *given],
                         cwd=REPO, capture_output=True, text=True, env=os.environ)
    traffic = json.loads(est.stdout)["communication"]
    return {"run": name, "step_s": (timed[-1]["elapsed_s"] - lines[1]["elapsed_s"]) / len(timed),
            "tokens_per_step": statistics.mean(
        r["tokens"] for r in lines), "estimate_compute_s": traffic["compute_s"],
        "estimate_no_grad_forwards_s": traffic["no_grad_forwards_s"], "losses": [round(r["loss"], 5) for r in lines]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--only", nargs="+", choices=list(RUNS), help="these runs and their baselines")
    ap.add_argument("--real", action="store_true", help="Mistral-7B's own shape in bf16 (a GPU), not SIZE in fp32")
    ap.add_argument("--model-dir", type=Path, help="Mistral-7B-Instruct-v0.3's config and tokenizer (default: "
                    "../shared's)")
    ap.add_argument("--gsm8k", type=Path, help="GSM8K's train.jsonl (default: ../shared's)")
    args = ap.parse_args()
    global REAL
    REAL = args.real
    preference_step.MISTRAL = args.model_dir or preference_step.MISTRAL
    preference_step.GSM8K = args.gsm8k or preference_step.GSM8K
    missing = [str(p) for p in (preference_step.MISTRAL / "config.json", preference_step.GSM8K) if not p.exists()]
    if missing:
        print(json.dumps({"skipped": f"not available: {', '.join(missing)}"}))
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="llmtrain-forwards-"))
    recipe = inputs(work, pairs=4 * args.steps, real=args.real)
    wanted = set(args.only or RUNS) | {RUNS[n][1] for n in args.only or () if RUNS[n][1]}
    rows = {}
    for name in (n for n in RUNS if n in wanted):
        rows[name] = run(recipe, work, name, args.steps)
        print(json.dumps(rows[name]), flush=True)
    ratios = {}
    for name, (_, base) in RUNS.items():
        if base is not None and name in rows:
            r, b = rows[name], rows[base]
            ratios[f"{name}/{base}"] = {"measured": round(r["step_s"] / b["step_s"], 3),
                                        "estimate": round(r["estimate_compute_s"] / b["estimate_compute_s"], 3),
                                        "estimate without the no-grad forwards": round(
                                            (r["estimate_compute_s"] - r["estimate_no_grad_forwards_s"])
                                            / b["estimate_compute_s"], 3)}
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
