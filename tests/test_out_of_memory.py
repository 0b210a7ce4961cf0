"""A run that runs out of GPU memory ends with one paragraph (where, torch's figure, the estimate on this card and
what shrinks it), and a run the estimate says will not fit is warned before the model loads. Found on the H200
(issue 40): a Mistral-7B GRPO run of 64 completions in one update pass, predicted at 163 GiB allocated, started
without a word and died with torch's traceback at 136 GiB."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import invoke, write_recipe

from llmtrain.config import load_recipe
from llmtrain.memory import estimate_for_recipe
from llmtrain.memory.fit import out_of_memory_text


@pytest.fixture
def recipe(tiny_assets, tmp_path):
    return write_recipe(tiny_assets, tmp_path)


def test_a_step_out_of_gpu_memory_ends_with_one_paragraph_and_no_traceback(recipe, tmp_path, monkeypatch):
    import llmtrain.loop.train as T

    real, calls = T.train_step, {"n": 0}

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 550.00 MiB. GPU 0 has a total "
                                         "capacity of 139.80 GiB of which 383.12 MiB is free.")
        return real(*a, **k)

    monkeypatch.setattr(T, "train_step", step)
    proc = invoke("finetune", str(recipe), "train.max_steps=4", "checkpoint.every_steps=2", check=False)
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())
    assert "the GPU ran out of memory in step 3 (CUDA out of memory. Tried to allocate 550.00 MiB)" in err
    assert f"llmtrain estimate-memory {tmp_path / 'run' / 'recipe.yaml'} --fit" in err
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()  # what was saved before it stays
    assert "the GPU ran out of memory in step 3" in (tmp_path / "run" / "train.log").read_text()


def _grpo_estimate(tiny_assets, tmp_path, *overrides: str, gib: float):
    path = write_recipe(tiny_assets, tmp_path, data={"format": "prompt", "max_seq_len": 128},
                        rl={"num_generations": 8, "max_completion_tokens": 64,
                            "rewards": [{"type": "format", "pattern": "[0-9]"}]},
                        train={"micro_batch_size": 64, "max_steps": 2})
    est = estimate_for_recipe(load_recipe(path, list(overrides)))
    return est.__class__(**{**vars(est), "spec": est.spec.but(gpu_memory_gib=gib)})


def test_the_paragraph_names_the_estimate_and_the_update_budget_of_an_rl_run(tiny_assets, tmp_path):
    est = _grpo_estimate(tiny_assets, tmp_path, gib=0.05)
    assert not est.fits
    text = out_of_memory_text(est, step=0, detail="CUDA out of memory", recipe_path="r.yaml")
    assert text.startswith("the GPU ran out of memory in step 1 (CUDA out of memory).")
    assert f"{est.per_gpu_peak_bytes / 2**30:.1f} GiB per GPU on this 0.1 GiB GPU: it does not fit" in text
    assert "rl.micro_batch_tokens" in text and "`llmtrain estimate-memory r.yaml --fit`" in text
    # a run that already splits its update is not told to
    budget = _grpo_estimate(tiny_assets, tmp_path, "rl.micro_batch_tokens=256", gib=0.05)
    assert "rl.micro_batch_tokens" not in out_of_memory_text(budget, step=0, detail="x", recipe_path="r.yaml")
    # an estimate that fits says that the estimate fell short, without advice
    roomy = _grpo_estimate(tiny_assets, tmp_path, gib=1000)
    text = out_of_memory_text(roomy, step=-1, detail="x", recipe_path="r.yaml")
    assert "before the first step" in text and "the estimate is short of this run" in text
    assert "What shrinks it" not in text


def test_a_run_over_the_gpu_is_warned_before_the_model_loads(tiny_assets, tmp_path, monkeypatch):
    from llmtrain.loop.phases import check_memory

    path = write_recipe(tiny_assets, tmp_path)
    recipe = load_recipe(path, [])
    gpu = SimpleNamespace(type="cuda")
    accelerator = SimpleNamespace(device=gpu, num_processes=1, parallelism_config=None, print=print,
                                  distributed_type=SimpleNamespace(name="NO"))
    said = []
    for total, warned in ((1 << 20, True), (1 << 40, False)):  # a 1 MiB card, a 1 TiB card
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, t=total: SimpleNamespace(total_memory=t))
        said.clear()
        est = check_memory(recipe, accelerator, data=None, say=said.append)
        assert est.spec.gpu_memory_gib == pytest.approx(total / 2**30)
        assert bool(said) == warned
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1 << 20))
    check_memory(recipe, accelerator, data=None, say=said.append)
    assert said[0].startswith("warning (memory): llmtrain's estimate for this run is ")
    assert "over this GPU's 0.0 GiB, so it will likely run out of memory: what the micro-batch keeps" in said[0]
    assert check_memory(recipe, SimpleNamespace(device=SimpleNamespace(type="cpu")), data=None, say=said.append) \
        is None
