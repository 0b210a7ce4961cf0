"""A GRPO step, llmtrain against TRL's GRPOTrainer, on CPU: the same model, prompts, num_generations and
max_completion_tokens; seconds per step split into generation and policy update, and peak RSS.

    OMP_NUM_THREADS=1 python benchmarks/grpo_vs_trl.py               # about 3 minutes on 2 cores
    python benchmarks/grpo_vs_trl.py --steps 8 --prompts 8 --generations 8 --completion 128

The model is vs_hf.py's cpu-small (Mistral-7B-Instruct-v0.3's config shrunk to hidden 256 and 4 layers, the real
32768-token vocabulary), random-init once and saved, so both sides load the same weights; the real tokenizer and
chat template render GSM8K questions as conversational prompts ([{role: user, content: question}]). A random
model never says its end of turn, so every completion runs to max_completion_tokens on both sides: the rollouts
are equal in size (prompts x generations x max_completion_tokens sampled tokens a step). Both train full in fp32
with TRL's defaults (loss_type dapo, beta 0, temperature 1, one update per generation round), the same reward
function (TRL's signature), lr and seed, each in its own process:

- TRL 1.16 `GRPOTrainer` (transformers' generate, padded; the update over left-padded prompts and right-padded
  completions), timed by wrapping its `_generate` (sampling) and a callback at each step's end;
- llmtrain (`python -m llmtrain finetune`), read from metrics.jsonl: `elapsed_s` per step and `generation_s`.

The first 2 steps are left out (warm-up). Prints one JSON line per side and a line of ratios.
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

from preference_step import GSM8K, MISTRAL, SMALL  # the same model and data as the DPO step's benchmark

SKIP = 2  # warm-up steps left out of the means


def varied(completions, **kwargs) -> list[float]:
    """The reward both sides use: varies between completions, so groups have advantages to train on."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 5) for t in texts]


def write_inputs(work: Path, prompts: int, steps: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(MISTRAL)
    for k, v in SMALL.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(work / "model")
    rows = [{"prompt": [{"role": "user", "content": json.loads(line)["question"]}]}
            for line in GSM8K.read_text().splitlines()[: prompts * steps]]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_trl(work: Path, a) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(MISTRAL)
    data = datasets.Dataset.from_list([json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines()])
    args = GRPOConfig(output_dir=str(work / "trl"), use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                      per_device_train_batch_size=a.prompts * a.generations, num_generations=a.generations,
                      max_completion_length=a.completion, max_steps=a.steps, learning_rate=1e-5, seed=a.seed,
                      save_strategy="no", loss_type="dapo", beta=0.0, temperature=1.0, shuffle_dataset=False)
    ends, gens = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=[varied], args=args, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    generate = trainer._generate

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        gens.append(time.perf_counter() - t)
        return out

    trainer._generate = timed
    start = time.perf_counter()
    trainer.train()
    steps = [b - a_ for a_, b in zip([start, *ends], ends)]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"steps": steps, "generation": gens, "lengths": lengths}


def run_llmtrain(work: Path, a) -> dict:
    import yaml

    recipe = {
        "model": {"name_or_path": str(work / "model"), "tokenizer": str(MISTRAL), "dtype": "float32"},
        "data": {"path": str(work / "prompts.jsonl"), "format": "prompt", "max_seq_len": 512 + a.completion,
                 "cache_dir": str(work / "cache")},
        "rl": {"num_generations": a.generations, "max_completion_tokens": a.completion, "temperature": 1.0,
               "rewards": [{"type": "function", "function": "grpo_vs_trl:varied"}]},
        "train": {"max_steps": a.steps, "micro_batch_size": a.prompts, "lr": 1e-5, "schedule": "constant",
                  "seed": a.seed},
        "checkpoint": {"save_final": False}, "logging": {"progress": False},
        "output_dir": str(work / "llmtrain"),
    }
    (work / "grpo.yaml").write_text(yaml.safe_dump(recipe))
    from llmtrain.config import load_recipe
    from llmtrain.loop.train import train

    train(load_recipe(work / "grpo.yaml"))
    lines = [json.loads(x) for x in (work / "llmtrain" / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in lines if r["type"] == "train"]
    elapsed = [r["elapsed_s"] for r in lines]
    return {"steps": [b - a_ for a_, b in zip([0.0, *elapsed], elapsed)],
            "generation": [r["generation_s"] for r in lines],
            "lengths": [r["completions/mean_length"] for r in lines]}


def side(name: str, work: Path, a) -> None:
    """One side in this process: its times and peak RSS as one JSON line."""
    sys.path.insert(0, str(Path(__file__).parent))  # llmtrain imports the reward function from here
    times = (run_trl if name == "trl" else run_llmtrain)(work, a)
    steps, gens = times["steps"][SKIP:], times["generation"][SKIP:]
    step, gen = sum(steps) / len(steps), sum(gens) / len(gens)
    print(json.dumps({"side": name, "step_s": round(step, 3), "generation_s": round(gen, 3),
                      "update_s": round(step - gen, 3), "steps_timed": len(steps),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "completions_per_step": a.prompts * a.generations, "max_completion_tokens": a.completion,
                      "mean_completion_tokens": round(sum(times["lengths"]) / len(times["lengths"]), 2)}))


def both_sides(script: str, work: Path, a, options: tuple[str, ...]) -> tuple[dict, dict]:
    """TRL's side, then llmtrain's, each `script --side NAME` in its own process (its own peak RSS) with the given
    options of `a`; each side's JSON line printed as it comes, and returned: (trl, llmtrain)."""
    results = {}
    for name in ("trl", "llmtrain"):
        flags = sum(([f"--{k.replace('_', '-')}", str(getattr(a, k))] for k in options), [])
        out = subprocess.run([sys.executable, script, "--side", name, "--work", str(work), *flags],
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
        line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("{"))
        print(line, flush=True)
        results[name] = json.loads(line)
    return results["trl"], results["llmtrain"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
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
        write_inputs(work, a.prompts, a.steps)
        t, m = both_sides(__file__, work, a, ("steps", "prompts", "generations", "completion", "seed"))
        print(json.dumps({"step_speedup": round(t["step_s"] / m["step_s"], 2),
                          "generation_speedup": round(t["generation_s"] / m["generation_s"], 2),
                          "update_speedup": round(t["update_s"] / m["update_s"], 2),
                          "rss_ratio": round(m["peak_rss_mib"] / t["peak_rss_mib"], 2)}))


if __name__ == "__main__":
    main()
