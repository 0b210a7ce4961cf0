"""Shared helpers for the training tests: tiny recipes written into tmp_path, runs, and their outputs.

Every recipe here trains the tiny Llama from the `tiny_assets` fixture in fp32 with eager attention
(exact, order-stable kernels), a few steps, short sequences and no progress bar, and writes its run
and its tokenisation cache under tmp_path.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LLMTRAIN = [sys.executable, "-m", "llmtrain"]
# One thread per process: faster for a model this small, and two DDP workers do not fight over 2 cores.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bf16_rows_change_results() -> bool:
    """Whether this machine's bf16 matrix product gives a row a result that depends on how many rows share the
    product. oneDNN's AMX and AVX512-BF16 kernels choose their blocking, and with it the order of a row's sums, by
    the row count (a [46, 512] x [512, 128] product's rows differ from the same rows inside a [64, 512] one, by a
    bf16 step); its AVX2 kernels, and every fp32 product, do not. A pipeline stage pads each micro-batch to
    train.micro_batch_tokens where one process packs it tight, so on such a machine the two are equal only up to
    bf16 rounding (ONEDNN_AVX2 pins the kernels that make them equal bit for bit)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, weight = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(512, 128, generator=g).bfloat16()
    whole = rows @ weight
    return any(not torch.equal(rows[:m] @ weight, whole[:m]) for m in (46, 53, 61))


ONEDNN_AVX2 = {**ENV, "ONEDNN_MAX_CPU_ISA": "AVX2"}  # oneDNN's AVX2 kernels: bf16 rows independent of the row count


def open_port() -> int:
    """A port the OS says is free (never a fixed one: parallel runs would collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(tiny: Path, tmp: Path, *, name: str = "recipe.yaml", **sections: dict) -> Path:
    """A tiny full fine-tune recipe; `sections` update it section by section (lora={"r": 4}, ...).

    The tokenisation cache is shared by the session (it sits beside the tiny assets, under pytest's
    temporary folder), so only the first run of each data layout tokenises.
    """
    recipe = {
        "model": {"name_or_path": str(tiny / "model"), "dtype": "float32", "attn_implementation": "eager"},
        "data": {"path": str(tiny / "data" / "train.jsonl"), "format": "prompt_completion", "max_seq_len": 32,
                 "cache_dir": str(tiny.parent / "data-cache")},
        "train": {"max_steps": 4, "micro_batch_size": 4, "grad_accum_steps": 1, "lr": 1e-3, "warmup_steps": 0,
                  "schedule": "cosine", "seed": 7},
        "checkpoint": {"save_final": True},
        "logging": {"progress": False, "plot": False},  # loss.png: tests/test_samples.py and test_plot.py
        "output_dir": str(tmp / "run"),
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(recipe.get(section), dict):
            recipe[section].update(values)
        else:
            recipe[section] = values
    path = tmp / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def same_length_task(tiny: Path, folder: Path, *, chars: int = 4) -> Path:
    """The tiny task's training examples whose word has `chars` characters (each then 21 tokens with 4: the BOS, the
    prompt, the completion and the EOS): rows packed to a budget of n x 21 tokens are full, none padded, so a layout
    that pads a row to its own shape (a sequence group's multiple, a pipeline stage's slots) pads nothing."""
    rows = [line for line in (tiny / "data" / "train.jsonl").read_text().splitlines()
            if len(json.loads(line)["prompt"].split()[1]) == chars]
    path = folder / f"train-{chars}.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def run_train(recipe: Path, *overrides: str, resume: str | None = None, overwrite: bool = False,
              allow_recipe_change: bool = False) -> dict:
    """Train in this process, exactly as `llmtrain finetune RECIPE OVERRIDES...` does; returns the summary."""
    from llmtrain.config import load_recipe
    from llmtrain.loop.train import train

    return train(load_recipe(recipe, list(overrides)), resume=resume, overwrite=overwrite,
                 allow_recipe_change=allow_recipe_change)


def cli(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`python -m llmtrain ARGS...` in a subprocess, text output captured."""
    proc = subprocess.run([*LLMTRAIN, *args], env=kwargs.pop("env", ENV), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout,
                          **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmtrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def invoke(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`llmtrain ARGS...` in this process, from the repository as `cli` runs it: the same command, exit status and
    output, without a subprocess's seconds of importing torch. For commands that start no process group."""
    import contextlib

    from typer.testing import CliRunner

    from llmtrain.cli import app

    with contextlib.chdir(REPO):
        result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    proc = subprocess.CompletedProcess(["llmtrain", *args], result.exit_code, result.stdout, result.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmtrain {' '.join(args)} exited {proc.returncode}:\n{result.output[-3000:]}")
    return proc


def estimate_memory(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`llmtrain estimate-memory ARGS...` in this process (`invoke`). `check`: it printed its estimate, whether the run
    fits (exit 0) or not (exit 4, memory.cli.DOES_NOT_FIT)."""
    proc = invoke("estimate-memory", *args, check=False)
    if check and proc.returncode not in (0, 4):
        raise AssertionError(f"llmtrain estimate-memory {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def tiny_gpt_oss(tiny: Path, folder: Path, *, window: int, sinks: bool = False) -> Path:
    """The tiny model's shapes and special ids as a GPT-OSS (attention sinks, 4 experts of which 2 a token, a sliding
    window on every other layer), random weights, the tiny tokenizer beside them; `sinks`: drawn from N(0, 1) each, so
    that they matter (transformers starts them at 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = json.loads((tiny / "model" / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "bos_token_id", "eos_token_id", "pad_token_id")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_oss", **{k: config[k] for k in keep}, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=window), dtype=torch.float32)
    if sinks:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny / "model").save_pretrained(folder)
    return folder


def tiny_gpt_oss_mxfp4(tiny: Path, folder: Path) -> tuple[Path, dict]:
    """tiny_gpt_oss's model with its experts stored as GPT-OSS's hub checkpoints store them: MXFP4 (each expert
    parameter as 4-bit blocks, two values a byte, and a power-of-two scale a group of 32 inputs, `<name>_blocks` and
    `<name>_scales`; `quantization_config: {quant_method: mxfp4}` in config.json); random blocks and scales of 2^-7
    to 2^-4. Returns the folder and each expert parameter as transformers dequantizes it (fp32)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tiny_gpt_oss(tiny, folder, window=8, sinks=True)
    state = load_file(str(folder / "model.safetensors"))
    generator, dense = torch.Generator().manual_seed(1), {}
    for name in [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, fan_in, fan_out = state.pop(name).shape  # [E, in, out]; the blocks are [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(120, 124, (experts, fan_out, fan_in // 32), dtype=torch.uint8, generator=generator)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder, dense


def launch_finetune(config: Path, processes: int, port: int, recipe: Path, *overrides: str,
                    resume: str | None = None, env: dict | None = None, timeout: float = 600) -> str:
    """`accelerate launch --config_file CONFIG --num_processes N -m llmtrain finetune RECIPE OVERRIDES...` (with
    --resume; in `env`, default ENV); asserts it exits 0 and returns what the main process printed.
    A launch still running after `timeout` seconds (a hang: the ranks waiting in collectives that do not match)
    fails the test, and every process of it is killed first: torchrun starts its workers in sessions of their own,
    which outlive the launcher (found by the recipe's path on their command line, as kill_launch_mid_run finds
    them)."""
    extra = ["--resume", resume] if resume else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
         str(processes), "--main_process_port", str(port), "-m", "llmtrain", "finetune", str(recipe), *overrides,
         *extra], env=env or ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-KILL", "-f", f"finetune {recipe}"], check=False)
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"the launch was still running after {timeout:g} s (killed): {stdout[-3000:]}"
                             f"{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout + ("\nSTDERR\n" + stderr if stderr else "")


def rl_under_tp_against_one(tiny: Path, tmp: Path, port: int, model: Path, *, tol: float,
                            algorithm: str = "grpo", lora: bool | dict = True, rl: dict | None = None,
                            steps: int = 2) -> str:
    """tiny-grpo.yaml with LoRA r4 (more of its settings where `lora` is a dict; lora False: a full fine-tune at lr
    1e-3) on `model` (`algorithm`: grpo or
    rloo; `rl`: more of its settings), `steps` steps, trained by one process (4 prompts a micro-batch) in `tmp`/one and
    launched on FSDP x TP 2 x 2 (cpu_tp.yaml: 2 data ranks x 2 prompts) in `tmp`/tp:
    asserts the same completions (tokens) and the rewards, losses and gradient norms to `tol`, with a signal to train
    on; returns what the launch printed."""
    import pytest

    recipe = yaml.safe_load((REPO / "recipes" / "tiny-grpo.yaml").read_text())
    recipe["data"].update(path=str(tiny / "data" / "train.jsonl"), eval_split=None)
    recipe["model"]["name_or_path"] = str(model)
    if lora:
        recipe["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, **(lora if isinstance(lora, dict) else {})}
    recipe["rl"].update(num_generations=4, algorithm=algorithm, rewards=[{"type": "format", "pattern": "[aeiou]"}],
                        **(rl or {}))
    if algorithm == "rloo":
        recipe["rl"].pop("loss_type")
    recipe["train"].update(max_steps=steps, micro_batch_size=2, eval_every_steps=None, lr=1e-2 if lora else 1e-3)
    recipe["checkpoint"] = {"every_steps": None}
    recipe["logging"] = {"progress": False, "plot": False, "every_steps": 1}
    path = tmp / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_train(path, "train.micro_batch_size=4", f"output_dir={tmp / 'one'}")
    out = launch_finetune(REPO / "accelerate_configs" / "cpu_tp.yaml", 4, port, path, f"output_dir={tmp / 'tp'}")
    got, want = records(tmp / "tp"), records(tmp / "one")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # the same completions sampled
    for key in ("reward", "loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=tol), key
    assert want[0]["grad_norm"] > 0 and want[0]["reward"] not in (0, 1)  # a signal to train on
    return out


def kill_launch_mid_run(config: Path, processes: int, port: int, recipe: Path, *overrides: str, out: Path,
                        after: int = 7) -> None:
    """Launch `llmtrain finetune` like launch_finetune (output_dir=`out`), wait for its first checkpoint and `after`
    metrics lines, then kill -9 every process of the launch mid-run, with no chance to save: torchrun starts its
    workers in sessions of their own, so they are found by their command line."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
              str(processes), "--main_process_port", str(port), "-m", "llmtrain", "finetune", str(recipe), *overrides,
              f"output_dir={out}"]
    proc = subprocess.Popen(launch, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    end = time.monotonic() + 180
    while not list((out / "checkpoints").glob("step_*")) or len(records(out)) < after:
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.02)
    subprocess.run(["pkill", "-KILL", "-f", f"output_dir={out}"], check=False)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def records(run: Path, kind: str = "train") -> list[dict]:
    """The metrics.jsonl lines of one type ('train' or 'eval')."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def assert_same_steps(run: Path, reference: Path, *, tol: float) -> None:
    """The same losses (to tol) and gradient norms (to tol, relative) at every logged step as the reference run: a
    gradient summed over ranks instead of averaged shows as a norm 2 or 4 times the reference's."""
    import pytest

    ours, theirs = records(run), records(reference)
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=tol)
    norms = [(r["grad_norm"], s["grad_norm"]) for r, s in zip(ours, theirs)]
    assert all(abs(a / b - 1) < tol for a, b in norms), norms


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in records(run)]


def load_weights(path: Path) -> dict:
    """Tensors of a safetensors file, or of `<folder>/model.safetensors`."""
    from safetensors.torch import load_file

    path = Path(path)
    return load_file(str(path / "model.safetensors" if path.is_dir() else path))


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest elementwise difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def crash_at_step(monkeypatch, recipe: Path, call: int, *overrides: str) -> None:
    """Run the recipe in this process and let it die (RuntimeError "preempted") when llmtrain.loop.train calls
    train_step for the `call`-th time (1-based), as a preempted job would: the checkpoints before it are on disk."""
    import pytest

    import llmtrain.loop.train as T

    real, calls = T.train_step, {"n": 0}

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("preempted")
        return real(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(T, "train_step", step)
        with pytest.raises(RuntimeError, match="preempted"):
            run_train(recipe, *overrides)
