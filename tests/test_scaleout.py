"""Multi-node on one machine: 2 "nodes" x 1 process each on 127.0.0.1, with different machine ranks.

Each node is its own `accelerate launch` (torchrun underneath, static rendezvous on a port the OS said
was free), exactly as on a real cluster; the processes join one gloo group. The run must match one
process with the same global batch, step for step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.long(80)]


def _recipe(tiny: Path, tmp: Path) -> Path:
    recipe = {
        "model": {"name_or_path": str(tiny / "model"), "attn_implementation": "eager"},
        "data": {"path": str(tiny / "data" / "train.jsonl"), "format": "prompt_completion", "max_seq_len": 48,
                 "cache_dir": str(tmp / "cache")},
        "train": {"max_steps": 4, "micro_batch_size": 2, "grad_accum_steps": 2, "lr": 1e-3, "seed": 3},
        "checkpoint": {"save_final": True},
        "logging": {"progress": False},
        "output_dir": str(tmp / "unused"),
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(ln)["type"] == "train"]


def test_two_nodes_match_one_process(tiny_assets, tmp_path, free_port):
    from helpers import run_train
    from safetensors.torch import load_file

    recipe = _recipe(tiny_assets, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    run_train(recipe, f"output_dir={single}", "train.micro_batch_size=4")  # in this process, as finetune runs it

    multi = tmp_path / "multi"
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
             "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
             "--main_process_port", str(free_port), "--mixed_precision", "no", "--dynamo_backend", "no",
             "-m", "llmtrain", "finetune", str(recipe), f"output_dir={multi}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]

    assert len(_losses(single)) == 4
    assert _losses(multi) == pytest.approx(_losses(single), abs=1e-5)
    a, b = load_file(single / "final" / "model.safetensors"), load_file(multi / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.extended  # main tier: test_ddp.py, and checkpoints moved in test_fsdp.py and test_pipeline.py
def test_resume_ddp_checkpoint_on_one_process(tiny_assets, tmp_path, free_port):
    """Save with 2 DDP processes x micro-batch 2, resume on 1 process x micro-batch 4: same global batches,
    so the resumed run equals one uninterrupted single-process run (trained in this process) step for step."""
    from helpers import run_train

    from llmtrain.errors import LLMTrainError

    recipe = _recipe(tiny_assets, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["train.max_steps=4", "checkpoint.every_steps=2"]  # a checkpoint at step 2, 2 steps after the resume
    straight = tmp_path / "straight"
    run_train(recipe, f"output_dir={straight}", "train.micro_batch_size=4", *common)

    run = tmp_path / "ddp"
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                    "--num_machines", "1", "--main_process_port", str(free_port), "--mixed_precision", "no",
                    "--dynamo_backend", "no", "-m", "llmtrain", "finetune", str(recipe), f"output_dir={run}",
                    *common], check=True, env=env, capture_output=True)
    # Preempted right after the step-2 save: the later checkpoint and the export never happened.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000004")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    shutil.rmtree(run / "final")
    # On 1 process, in this one: the old micro-batch would change the global batch, and is refused before anything is
    # written; the micro-batch that keeps it resumes.
    with pytest.raises(LLMTrainError, match=r"micro_batch_size x data-parallel ranks = 4"):
        run_train(recipe, f"output_dir={run}", *common, resume="auto")
    run_train(recipe, f"output_dir={run}", "train.micro_batch_size=4", *common, resume="auto")
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in (run / "train.log").read_text()
    assert _losses(run) == pytest.approx(_losses(straight), abs=1e-5)
    assert len(_losses(run)) == 4


def test_failing_rank_brings_the_job_down_with_its_error(tiny_assets, tmp_path, free_port):
    """Rank 0 fails inside main_process_first (bad column mapping) while rank 1 waits at the barrier:
    the launcher must end the whole job quickly and show rank 0's message, not hang until the timeout."""
    import time

    recipe = _recipe(tiny_assets, tmp_path)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
         "--main_process_port", str(free_port), "-m", "llmtrain", "finetune", str(recipe),
         f"output_dir={tmp_path / 'run'}", "data.fields.prompt=question", "train.timeout_s=600"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode != 0
    assert "needs prompt (column 'question')" in proc.stderr + proc.stdout
    assert time.monotonic() - start < 120  # far below the 600 s collective timeout
