"""llmtrain against HF Trainer (+peft), side by side: the same model, data and real tokens per optimizer step.

    OMP_NUM_THREADS=1 python benchmarks/vs_hf.py --shape cpu-small --repeat 3   # CPU, fp32, about 1 minute a round
    python benchmarks/vs_hf.py --shape mistral-7b-lora      # one H100: Mistral-7B, LoRA r16 all-linear, bf16 base
    python benchmarks/vs_hf.py --shape llama-1b-full        # one H100: a 1.1B Llama, full, fp32 master + bf16 autocast
    python benchmarks/vs_hf.py --smoke                      # CI: cpu-small, 2 steps, checks instead of timings

Four systems run one after the other, each in its own process, on a random init of one config:
- `llmtrain`: the real CLI (`python -m llmtrain finetune RECIPE key=value ...`) with its fast path: token-budget
  micro-batches (`train.micro_batch_tokens`, whole examples packed into one padding-free row) and varlen attention
  (`model.attn_implementation=auto`).
- `llmtrain-baseline`: the same CLI with `micro_batch_size` examples per padded micro-batch and SDPA.
- `hf-padded`: HF Trainer with `DataCollatorForSeq2Seq` (right padding to the longest example of the micro-batch).
- `hf-flatten`: HF Trainer with `DataCollatorWithFlattening` (padding-free: one row, position ids that restart;
  flash-attention 2 where it is installed on CUDA, else SDPA, to which transformers gives a block-diagonal mask).
- `hf-liger` (only with `--systems`, CUDA): `hf-flatten` with `use_liger_kernel=True` (liger-kernel installed).

Same data: the first N rows of GSM8K (`../shared/data/gsm8k`) as user/assistant messages, tokenised ONCE with
llmtrain's own `prepare_datasets` (Mistral-7B-Instruct-v0.3's chat template, loss on the assistant reply and its
`</s>` only); the HF runs read the very same cached token ids and labels. Same tokens per step: every system trains
exactly one epoch of those N examples in the same number of optimizer steps S. HF and the baseline take
`hf_micro_batch x hf_grad_accum` examples per step (N = S x that); llmtrain's token budget is the smallest that
packs the N examples into exactly S x grad_accum bins. So all four train the same total of real tokens, and the
same mean per step.

Measured alike for all: real (non-pad) input tokens per second over the steps after `--warmup` (tokens of those
steps / wall time from the end of the last warm-up step to the end of the last step, each step ending after a host
sync); peak memory: `torch.cuda.max_memory_allocated` on CUDA, and on CPU the process's peak RSS minus the peak RSS
of a process that only imports the same libraries; the last step's loss. See docs/performance.md.

Prints one JSON line per system, then one line of ratios (and, with --smoke, of checks). Progress goes to stderr.
On a CPU shared with other work, time with one thread per run (OMP_NUM_THREADS=1) and --repeat: with two threads
on two busy cores, identical runs were measured 3 to 5 times apart; with one, within a few percent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MISTRAL = SHARED / "models" / "mistral-7b-instruct-v0.3"
GSM8K = SHARED / "data" / "gsm8k" / "train.jsonl"
SYSTEMS = ("llmtrain", "llmtrain-baseline", "hf-padded", "hf-flatten")
# Only where asked (--systems): hf-flatten plus `use_liger_kernel=True` (Liger's fused linear cross-entropy, RMSNorm,
# SwiGLU, RoPE), the strongest HF set-up a user would pick; Liger's kernels are Triton, so CUDA only.
OPTIONAL_SYSTEMS = ("hf-liger",)
TOKENS_PER_STEP_TOLERANCE = 0.05  # |mean real tokens per step / llmtrain's - 1| allowed in --smoke (see docs)


@dataclass
class Shape:
    config: dict  # overrides of the Mistral-7B-Instruct-v0.3 config.json (model_type switches to llama)
    lora: bool
    dtype: str  # storage dtype of the weights
    mixed_precision: str  # autocast: "bf16" or "no"
    lr: float
    steps: int  # S optimizer steps = one epoch of the N examples
    warmup: int  # steps left out of the timing
    hf_micro_batch: int  # examples per micro-batch, HF and llmtrain-baseline
    hf_grad_accum: int
    grad_accum: int  # llmtrain's accumulation over token-budget bins
    grad_checkpointing: bool = False


SHAPES = {
    # The real Mistral-7B; micro-batches of about 1.5k (HF) and 3.9k (llmtrain) tokens fit 80 GB without
    # recomputation, ~15.4k real tokens (80 examples) per step.
    "mistral-7b-lora": Shape(config={}, lora=True, dtype="bfloat16", mixed_precision="bf16", lr=2e-4, steps=20,
                             warmup=4, hf_micro_batch=8, hf_grad_accum=10, grad_accum=4),
    # A 1.1B Llama with the Mistral tokenizer (GSM8K through it uses ids < 30916, so 32000 rows suffice).
    "llama-1b-full": Shape(config=dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                       intermediate_size=8192, vocab_size=32000, head_dim=64, rope_theta=500000.0),
                           lora=False, dtype="float32", mixed_precision="bf16", lr=2e-5, steps=20, warmup=4,
                           hf_micro_batch=16, hf_grad_accum=5, grad_accum=2),
    # Mistral shrunk to hidden 256 and 4 layers, keeping the real 32768-token vocabulary, fp32, full fine-tune.
    "cpu-small": Shape(config=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=896, head_dim=32),
                       lora=False, dtype="float32", mixed_precision="no", lr=1e-4, steps=8, warmup=2,
                       hf_micro_batch=4, hf_grad_accum=1, grad_accum=1),
}
SMOKE = dict(steps=2, warmup=1, hf_micro_batch=2, hf_grad_accum=2)  # cpu-small, 8 examples


def log(msg: str) -> None:
    print(f"[vs_hf] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- set-up: model, data, plan


def write_model_config(shape: Shape, source: Path, out: Path) -> dict:
    """The shape's config.json (the Mistral config with the shape's overrides): the only file of the model."""
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(shape.config, torch_dtype=shape.dtype, use_cache=False)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def write_messages(n: int, source: Path, out: Path) -> None:
    """The first n GSM8K training rows as one user question and one assistant answer each."""
    with source.open() as f, out.open("w") as w:
        for i, line in enumerate(f):
            if i == n:
                return
            row = json.loads(line)
            w.write(json.dumps({"messages": [{"role": "user", "content": row["question"]},
                                             {"role": "assistant", "content": row["answer"]}]}) + "\n")
    raise SystemExit(f"{source} has fewer than {n} rows; lower --steps or the micro-batch sizes")


def budget_for(lengths: list[int], bins: int, *, seed: int) -> int:
    """The smallest token budget whose best-fit-decreasing bins (llmtrain's own, epoch 0) number at most `bins`."""
    from llmtrain.data.batching import token_bins

    lo, hi = max(max(lengths), math.ceil(sum(lengths) / bins)), sum(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(token_bins(lengths, mid, seed=seed, epoch=0)) <= bins else (mid + 1, hi)
    return lo


def planned_steps(lengths: list[int], *, seed: int, budget: int | None, micro: int, accum: int) -> list[list[int]]:
    """Example lengths of every optimizer step of llmtrain's epoch 0 (its pure data plan, one process)."""
    from llmtrain.data.batching import global_micro_batches

    batches = global_micro_batches(len(lengths), seed=seed, epoch=0, world_size=1, micro_batch_size=micro,
                                   micro_batch_tokens=budget, lengths=lengths)
    return [[lengths[i] for g in batches[s : s + accum] for i in g[0]] for s in range(0, len(batches), accum)]


def flops_per_token_and_square(cfg: dict, *, lora: bool, r: int = 16) -> tuple[float, float]:
    """Model FLOPs of one real input token and of one unit of sum(l_i^2), for every system alike.

    N = the decoder's matmul weights plus the LM head (not the embedding lookup, not the norms). Full fine-tune:
    6N per token (2 forward, 2 input gradient, 2 weight gradient). LoRA: 4N for the frozen base (no weight
    gradient) plus 6 x the adapter's parameters. Causal attention, QK^T and AV: 2 x 2 x l^2 x hidden per layer
    forward, half of it under the causal mask, 3x with backward: 6 x layers x hidden x l^2.
    """
    h, inter, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # q k v o gate up down
    dense = n * sum(a * b for a, b in shapes) + h * v
    per_token = 4 * dense + 6 * n * sum(r * (a + b) for a, b in shapes) if lora else 6 * dense
    return float(per_token), 6.0 * n * q


@dataclass
class Plan:
    shape: str
    work: Path
    model_dir: Path
    tokenizer_dir: Path  # the real Mistral tokenizer and chat template, read in place (never copied)
    data_path: Path
    cache_dir: Path
    dataset_dir: Path  # the tokenised examples as llmtrain cached them: what the HF workers train on
    seed: int
    lora: bool
    dtype: str
    mixed_precision: str
    lr: float
    steps: int
    warmup: int
    hf_micro_batch: int
    hf_grad_accum: int
    grad_accum: int
    micro_batch_tokens: int
    grad_checkpointing: bool
    compile: bool
    hf_attn: str
    device: str
    flops_per_token: float
    flops_per_square: float
    examples: int
    tokens: int
    trained_tokens: int
    lengths: list[int]  # of the N examples, in dataset order (llmtrain's data plan is a function of them)


def make_plan(args, shape: Shape, work: Path) -> Plan:
    import torch
    from transformers import AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.data.prepare import prepare_datasets

    n = shape.steps * shape.hf_micro_batch * shape.hf_grad_accum
    cfg = write_model_config(shape, args.mistral, work / "model")
    write_messages(n, args.gsm8k, work / "gsm8k_messages.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(args.mistral)
    data_cfg = DataConfig(path=str(work / "gsm8k_messages.jsonl"), format="messages", cache_dir=str(work / "cache"))
    # Tokenised here, once: the llmtrain runs hit this cache, and the HF workers load it, so every system sees the
    # same token ids and the same loss mask.
    train_ds, _, stats, _ = prepare_datasets(data_cfg, tokenizer, seed=args.seed)
    lengths = train_ds["length"]
    largest = max(max(ids) for ids in train_ds["input_ids"])
    if largest >= cfg["vocab_size"]:
        raise SystemExit(f"token id {largest} does not fit the shape's vocabulary of {cfg['vocab_size']}")
    budget = budget_for(lengths, shape.steps * shape.grad_accum, seed=args.seed)
    bins = len(planned_steps(lengths, seed=args.seed, budget=budget, micro=1, accum=1))
    if bins != shape.steps * shape.grad_accum:  # then llmtrain runs fewer steps; --smoke reports it as a failure
        log(f"warning: no token budget packs the {len(lengths)} examples into exactly {shape.steps} x "
            f"{shape.grad_accum} bins (got {bins}); change --steps or the micro-batch sizes")
    per_token, per_square = flops_per_token_and_square(cfg, lora=shape.lora)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Plan(shape=args.shape, work=work, model_dir=work / "model", tokenizer_dir=args.mistral,
                data_path=Path(data_cfg.path), cache_dir=Path(data_cfg.cache_dir),
                dataset_dir=Path(train_ds.cache_files[0]["filename"]).parent, seed=args.seed, lora=shape.lora,
                dtype=shape.dtype,
                mixed_precision=shape.mixed_precision if device == "cuda" else "no", lr=shape.lr, steps=shape.steps,
                warmup=shape.warmup, hf_micro_batch=shape.hf_micro_batch, hf_grad_accum=shape.hf_grad_accum,
                grad_accum=shape.grad_accum, micro_batch_tokens=budget, grad_checkpointing=shape.grad_checkpointing,
                compile=args.compile, hf_attn=args.hf_attn, device=device, flops_per_token=per_token,
                flops_per_square=per_square, examples=len(lengths), tokens=sum(lengths),
                trained_tokens=stats["train"].trained_tokens, lengths=lengths)


# --------------------------------------------------------------------------- running one system


def run_child(cmd: list[str], logfile: Path) -> tuple[float, int, float]:
    """Run a command to completion; returns (wall seconds, its peak RSS in bytes, its CPU seconds)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with logfile.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        # wait4 gives this child's own rusage (ru_maxrss: its peak resident set, in KiB on Linux).
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = logfile.read_text()[-4000:]
        raise SystemExit(f"{' '.join(cmd[:6])} ... exited {proc.returncode}; log {logfile}:\n{tail}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def import_baseline_rss(work: Path) -> int:
    """Peak RSS of a process that imports what the systems import, and does nothing: subtracted on CPU."""
    code = "import torch, transformers, peft, accelerate, datasets, llmtrain.cli, llmtrain.loop.train; " \
           "from transformers import Trainer"
    return run_child([sys.executable, "-c", code], work / "baseline.log")[1]


def run_llmtrain(plan: Plan, variant: str) -> dict:
    import yaml

    recipe = {
        "model": {"name_or_path": str(plan.model_dir), "tokenizer": str(plan.tokenizer_dir), "random_init": True,
                  "dtype": plan.dtype, "gradient_checkpointing": plan.grad_checkpointing},
        "data": {"path": str(plan.data_path), "format": "messages", "cache_dir": str(plan.cache_dir)},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"} if plan.lora else None,
        "train": {"epochs": 1, "lr": plan.lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                  "max_grad_norm": 1.0, "mixed_precision": plan.mixed_precision, "seed": plan.seed},
        "checkpoint": {"save_final": False},
        # every_steps=1: each step's own token count and end time, the same host sync per step as HF's logging
        "logging": {"progress": False, "every_steps": 1},
    }
    path = plan.work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = plan.work / "runs" / variant
    if variant == "llmtrain":
        keys = [f"train.micro_batch_tokens={plan.micro_batch_tokens}", f"train.grad_accum_steps={plan.grad_accum}",
                "model.attn_implementation=auto", f"model.compile={str(plan.compile).lower()}"]
        steps = planned_steps(plan.lengths, seed=plan.seed, budget=plan.micro_batch_tokens, micro=1,
                              accum=plan.grad_accum)
    else:
        keys = [f"train.micro_batch_size={plan.hf_micro_batch}", f"train.grad_accum_steps={plan.hf_grad_accum}",
                "model.attn_implementation=sdpa"]
        steps = planned_steps(plan.lengths, seed=plan.seed, budget=None, micro=plan.hf_micro_batch,
                              accum=plan.hf_grad_accum)
    cmd = [sys.executable, "-m", "llmtrain", "finetune", str(path), *keys, f"output_dir={out}", "--overwrite"]
    wall, rss, cpu = run_child(cmd, plan.work / f"{variant}.log")
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in lines if r["type"] == "train"]
    summary = json.loads((out / "summary.json").read_text())
    if [r["tokens"] for r in lines] != [sum(s) for s in steps]:
        raise SystemExit(f"{variant}: metrics.jsonl's tokens per step differ from the data plan")
    records = [{"tokens": r["tokens"], "trained": r["trained_tokens"], "squares": sum(n * n for n in s),
                "end_s": r["elapsed_s"], "loss": r["loss"]} for r, s in zip(lines, steps)]
    micro = (f"bins of <= {plan.micro_batch_tokens} tokens" if variant == "llmtrain"
             else f"{plan.hf_micro_batch} examples, padded")
    # What llmtrain says it used (its start-up line "model: ...; attention: ..."), e.g. which varlen kernel.
    said = [ln.split("attention: ", 1)[1] for ln in (plan.work / f"{variant}.log").read_text().splitlines()
            if ln.startswith("model: ") and "attention: " in ln]
    attention = said[0].strip() if said else keys[2].split("=")[1]
    if variant == "llmtrain" and plan.compile:
        attention += "; compiled layers"
    return {"micro_batch": micro, "grad_accum": plan.grad_accum if variant == "llmtrain" else plan.hf_grad_accum,
            "attention": attention, "records": records, "wall_s": wall, "peak_rss": rss, "cpu_s": cpu,
            "max_memory_allocated": summary.get("max_memory_allocated")}


def run_hf(plan: Plan, collator: str) -> dict:
    spec = plan.work / f"hf-{collator}.json"
    spec.write_text(json.dumps({**asdict(plan), "collator": collator}, default=str))
    wall, rss, cpu = run_child([sys.executable, str(Path(__file__).resolve()), "--hf-worker", str(spec)],
                               plan.work / f"hf-{collator}.log")
    result = json.loads((plan.work / f"hf-{collator}.result.json").read_text())
    return {**result, "wall_s": wall, "peak_rss": rss, "cpu_s": cpu}


# --------------------------------------------------------------------------- the HF worker (its own process)


def hf_worker(spec_path: Path) -> None:
    """HF Trainer (+peft) on the plan's model and cached data; writes <work>/hf-<collator>.result.json."""
    import datasets
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from llmtrain.data.formats import IGNORE

    spec = json.loads(spec_path.read_text())
    work, cuda = Path(spec["work"]), spec["device"] == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    tokenizer.pad_token_id = tokenizer.eos_token_id  # llmtrain's pad id; pads are masked out of attention and loss
    tokenizer.padding_side = "right"
    # The folder llmtrain's own tokenisation wrote (read directly, not through its cache key): the same ids and labels.
    train_ds = datasets.load_from_disk(spec["dataset_dir"]).select_columns(["input_ids", "labels"])

    liger = spec["collator"] == "liger"  # flattened as hf-flatten, with Liger's kernels patched in by the Trainer
    flatten = spec["collator"] in ("flatten", "liger")
    attn = "sdpa"
    if flatten and spec["hf_attn"] != "auto":
        attn = spec["hf_attn"]
    elif flatten and cuda:
        import importlib.util

        attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    set_seed(spec["seed"])  # the same init as llmtrain's random_init (same seed, same construction)
    config = AutoConfig.from_pretrained(spec["model_dir"])
    with torch.device(spec["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]), attn_implementation=attn)
    model.config.use_cache = False
    if spec["lora"]:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    if flatten:
        # flash attention reads the example boundaries from cu_seq_lens; SDPA from the restarting position ids
        inner = DataCollatorWithFlattening(return_flash_attn_kwargs=attn.startswith("flash"))
    else:
        inner = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE)

    def collate(features):
        # Counted here, on the CPU, before padding: real tokens, trained tokens and sum(l^2) of the micro-batch.
        lengths = [len(f["input_ids"]) for f in features]
        trained = sum(sum(1 for x in f["labels"][1:] if x != IGNORE) for f in features)
        batch = inner(features)
        batch["bench_counts"] = (sum(lengths), trained, sum(n * n for n in lengths))
        return batch

    records, pending, t0 = [], [0, 0, 0], [0.0]

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            counts = inputs.pop("bench_counts")  # not a model input: taken out before HF's own step runs
            for i in range(3):
                pending[i] += counts[i]
            return super().training_step(model, inputs, num_items_in_batch)

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            t0[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()  # the step's kernels are done: the same point llmtrain's .item() reaches
            records.append({"tokens": pending[0], "trained": pending[1], "squares": pending[2],
                            "end_s": time.perf_counter() - t0[0], "loss": None})
            pending[:] = [0, 0, 0]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and records:
                records[-1]["loss"] = logs["loss"]

    targs = TrainingArguments(
        output_dir=str(work / f"hf-{spec['collator']}"), report_to="none", eval_strategy="no", save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, num_train_epochs=1,
        per_device_train_batch_size=spec["hf_micro_batch"], gradient_accumulation_steps=spec["hf_grad_accum"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=spec["mixed_precision"] == "bf16", gradient_checkpointing=spec["grad_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False}, seed=spec["seed"], data_seed=spec["seed"],
        remove_unused_columns=False, dataloader_drop_last=False, use_cpu=not cuda, use_liger_kernel=liger,
    )
    CountingTrainer(model=model, args=targs, train_dataset=train_ds, data_collator=collate,
                    callbacks=[StepTimer()]).train()
    result = {"micro_batch": f"{spec['hf_micro_batch']} examples, "
                             + ("flattened" if flatten else "padded") + (", liger kernels" if liger else ""),
              "grad_accum": spec["hf_grad_accum"], "attention": attn, "records": records,
              "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None}
    (work / f"hf-{spec['collator']}.result.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- measuring and reporting


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    from llmtrain.run.metrics import PEAK_BF16_FLOPS

    name = torch.cuda.get_device_name()
    return next((f for key, f in PEAK_BF16_FLOPS if key in name), None)


def summarise(system: str, plan: Plan, run: dict, baseline_rss: int) -> dict:
    recs, w = run["records"], plan.warmup
    timed = recs[w:]
    dt = recs[-1]["end_s"] - (recs[w - 1]["end_s"] if w > 0 else 0.0)
    tokens = sum(r["tokens"] for r in timed)
    flops = sum(plan.flops_per_token * r["tokens"] + plan.flops_per_square * r["squares"] for r in timed)
    peak = peak_flops(plan.device)
    on_gpu = plan.device == "cuda"
    memory = run["max_memory_allocated"] if on_gpu else run["peak_rss"] - baseline_rss
    return {
        "system": system, "shape": plan.shape, "device": _device_name(plan.device),
        "tokens_per_s": tokens / dt, "peak_memory_bytes": memory,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if on_gpu else "peak RSS growth over imports",
        "final_loss": recs[-1]["loss"], "first_loss": recs[0]["loss"],
        "steps": len(recs), "warmup_steps": w, "timed_s": dt,
        "real_tokens_per_step": sum(r["tokens"] for r in recs) / len(recs),
        "trained_tokens_per_step": sum(r["trained"] for r in recs) / len(recs),
        "real_tokens_total": sum(r["tokens"] for r in recs),
        "micro_batch": run["micro_batch"], "grad_accum": run["grad_accum"], "attention": run["attention"],
        "tflops": flops / dt / 1e12, "mfu": flops / dt / peak if peak else None,
        "process_wall_s": run["wall_s"], "process_cpu_s": run["cpu_s"],
    }


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def ratios(rows: dict[str, dict]) -> dict:
    ours = rows.get("llmtrain")
    if ours is None:
        return {}
    others = {k: v for k, v in rows.items() if k != "llmtrain"}
    out = {"tokens_per_s": {f"llmtrain/{k}": ours["tokens_per_s"] / v["tokens_per_s"] for k, v in others.items()},
           "peak_memory": {f"llmtrain/{k}": ours["peak_memory_bytes"] / v["peak_memory_bytes"]
                           for k, v in others.items() if v["peak_memory_bytes"]}}
    hf = [k for k in others if k.startswith("hf-")]
    if hf:
        best = max(hf, key=lambda k: others[k]["tokens_per_s"])
        out["best_hf"] = best
        out["llmtrain/best_hf_tokens_per_s"] = ours["tokens_per_s"] / others[best]["tokens_per_s"]
    return out


def smoke_checks(rows: dict[str, dict], plan: Plan) -> dict:
    """What CI asserts: every system ran its S steps, all trained the same real tokens (per step within the
    tolerance, in total exactly: one epoch of the same examples), and every loss is finite."""
    problems = []
    ref = rows["llmtrain"]["real_tokens_per_step"]
    for name in SYSTEMS:
        row = rows.get(name)
        if row is None:
            problems.append(f"{name} did not run")
            continue
        if row["steps"] != plan.steps:
            problems.append(f"{name} ran {row['steps']} steps, not {plan.steps}")
        if row["real_tokens_total"] != plan.tokens:
            problems.append(f"{name} trained {row['real_tokens_total']} real tokens, not {plan.tokens}")
        if abs(row["real_tokens_per_step"] / ref - 1) > TOKENS_PER_STEP_TOLERANCE:
            problems.append(f"{name}: {row['real_tokens_per_step']:.1f} real tokens per step, llmtrain {ref:.1f}")
        if not all(isinstance(x, float) and math.isfinite(x) for x in (row["final_loss"], row["first_loss"])):
            problems.append(f"{name}: loss not finite ({row['first_loss']}, {row['final_loss']})")
    return {"smoke": "ok" if not problems else "failed", "problems": problems,
            "tolerance_tokens_per_step": TOKENS_PER_STEP_TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu-small")
    ap.add_argument("--smoke", action="store_true", help="CI: cpu-small, 2 steps; check instead of timing.")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"Comma-separated, of {','.join(SYSTEMS + OPTIONAL_SYSTEMS)}.")
    ap.add_argument("--steps", type=int, help="Optimizer steps (one epoch of steps x HF examples per step).")
    ap.add_argument("--warmup", type=int, help="Steps left out of the timing.")
    ap.add_argument("--hf-micro-batch", type=int, help="Examples per micro-batch (HF, llmtrain-baseline).")
    ap.add_argument("--hf-grad-accum", type=int, help="Micro-batches per step (HF, llmtrain-baseline).")
    ap.add_argument("--grad-accum", type=int, help="llmtrain's token-budget bins per step.")
    ap.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--lora", action=argparse.BooleanOptionalAction, default=None,
                    help="LoRA r16 all-linear (alpha 32, dropout 0.05) instead of the shape's choice.")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="llmtrain's model.compile (regional torch.compile).")
    ap.add_argument("--hf-attn", default="auto", help="hf-flatten's attention: auto (flash_attention_2 if "
                    "installed on CUDA, else sdpa), sdpa, flash_attention_2, flex_attention.")
    ap.add_argument("--mistral", type=Path, default=MISTRAL, help="Mistral-7B-Instruct-v0.3's config.json and "
                    "tokenizer (no weights are read).")
    ap.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K's train.jsonl (question, answer).")
    ap.add_argument("--repeat", type=int, default=1, help="Run the systems this many times, round robin, and "
                    "report each one's fastest run (on a shared machine, the run least disturbed by others).")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workdir", type=Path, help="Keep the runs here (default: a temporary folder, removed).")
    ap.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.mistral, args.gsm8k = args.mistral.resolve(), args.gsm8k.resolve()
    if args.hf_worker:
        hf_worker(args.hf_worker)
        return 0
    missing = [str(p) for p in (args.mistral / "config.json", args.mistral / "tokenizer.json", args.gsm8k)
               if not p.exists()]
    if missing:
        print(json.dumps({"skipped": f"not available: {', '.join(missing)}"}))
        return 0
    shape = SHAPES["cpu-small" if args.smoke else args.shape]
    if args.smoke:
        args.shape = "cpu-small"
        shape = Shape(**{**asdict(shape), **SMOKE})
    overrides = {k: getattr(args, k) for k in ("steps", "warmup", "hf_micro_batch", "hf_grad_accum", "grad_accum",
                                               "grad_checkpointing", "lora") if getattr(args, k) is not None}
    shape = Shape(**{**asdict(shape), **overrides})
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS) - set(OPTIONAL_SYSTEMS)
    if unknown or (args.smoke and set(systems) != set(SYSTEMS)):
        ap.error(f"--systems: choose from {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)} (--smoke runs {', '.join(SYSTEMS)})")

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="llmtrain-vs-hf-")
    work = args.workdir or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        plan = make_plan(args, shape, work)
        log(f"{plan.shape} on {plan.device}: {plan.examples} GSM8K examples, {plan.tokens} real tokens "
            f"({plan.trained_tokens} trained), {plan.steps} steps of {plan.tokens / plan.steps:.0f} real tokens; "
            f"llmtrain budget {plan.micro_batch_tokens} x {plan.grad_accum}; HF {plan.hf_micro_batch} x "
            f"{plan.hf_grad_accum} examples; work dir {work}")
        baseline_rss = import_baseline_rss(work) if plan.device == "cpu" else 0
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(args.repeat):  # round robin, so that a slow period of the machine hits every system alike
            for system in [s for s in systems if s in runs]:
                log(f"running {system}" + (f" ({r + 1} of {args.repeat})" if args.repeat > 1 else ""))
                load = os.getloadavg()[0]
                try:
                    if system.startswith("llmtrain"):
                        run = run_llmtrain(plan, system)
                    else:
                        run = run_hf(plan, system.removeprefix("hf-"))
                except SystemExit as failed:
                    if system not in OPTIONAL_SYSTEMS:
                        raise
                    # an optional system that cannot run here (liger-kernel missing, no CUDA): said, then skipped
                    print(json.dumps({"system": system, "failed": str(failed)[-1500:]}), flush=True)
                    del runs[system]
                    continue
                runs[system].append(summarise(system, plan, run, baseline_rss))
                # The machine's 1-minute load average before and after (the run itself adds about its threads):
                # where other work shares the cores, the timings say so.
                runs[system][-1]["host_load_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                if args.repeat == 1:
                    print(json.dumps(runs[system][-1]), flush=True)
        rows = {s: max(rs, key=lambda row: row["tokens_per_s"]) for s, rs in runs.items()}
        if args.repeat > 1:
            for system, row in rows.items():
                row["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs[system]]
                print(json.dumps(row), flush=True)
        final = {"ratios": ratios(rows), "llmtrain_micro_batch_tokens": plan.micro_batch_tokens,
                 "hf_examples_per_step": plan.hf_micro_batch * plan.hf_grad_accum}
        if args.smoke:
            final.update(smoke_checks(rows, plan))
        print(json.dumps(final), flush=True)
        return 0 if final.get("smoke", "ok") == "ok" else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
