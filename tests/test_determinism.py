"""train.deterministic (llmtrain/loop/determinism.py): what is set for the run, what is put back, and the one part of
a step (RL sampling) that runs warn-only. On the CPU every kernel is deterministic anyway; the GPU proof is
`benchmarks/gpu_session.sh smoke`'s resume check ("equal": true)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import losses, run_train, write_recipe

from llmtrain.loop.determinism import CUBLAS_WORKSPACE, deterministic_algorithms, sampling_warn_only


@pytest.fixture
def torch_mode():
    """Whatever a test does to torch's global mode, the next test starts from the default."""
    yield
    torch.use_deterministic_algorithms(False)


def mode() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize("before", [(False, False), (True, True)])
def test_strict_mode_and_cublas_workspace_for_the_run_then_the_previous_mode(monkeypatch, torch_mode, before):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    with deterministic_algorithms():
        # strict: warn_only off is the only mode in which aten's flash attention backward is deterministic
        assert mode() == (True, False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
    assert mode() == before
    # cuBLAS read the variable at its first handle and keeps it for the process: it stays
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_workspace_the_user_set_is_kept(monkeypatch, torch_mode):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other setting cuBLAS documents as deterministic
    with deterministic_algorithms():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_mode_is_restored_when_the_run_fails(torch_mode):
    with pytest.raises(RuntimeError, match="boom"), deterministic_algorithms():
        raise RuntimeError("boom")
    assert mode() == (False, False)


def test_sampling_is_warn_only_inside_strict_mode_and_untouched_outside(torch_mode):
    with deterministic_algorithms():
        with sampling_warn_only():
            assert mode() == (True, True)
        assert mode() == (True, False)
        with pytest.raises(RuntimeError, match="boom"), sampling_warn_only():
            raise RuntimeError("boom")
        assert mode() == (True, False)
    for before in [(False, False), (True, True)]:  # not strict: nothing to relax, nothing changed
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        with sampling_warn_only():
            assert mode() == before
        assert mode() == before


def test_eval_counts_each_examples_hits_without_a_weighted_bincount(monkeypatch, torch_mode):
    """eval_sums counts an example's argmax hits with index_add (CUDA's weighted bincount raises in strict mode):
    examples 0, 0, 1, 2, 2, 2 with hits 1, 0, 1, 1, 1, 1: example 0 has 1 of 2 right, 1 has 1 of 1, 2 has 3 of 3,
    so 5 hits in 6 tokens and two teacher-forced matches of three examples."""
    from llmtrain.objectives import objective as O

    hits = torch.tensor([True, False, True, True, True, True])
    monkeypatch.setattr(O, "compute_loss", lambda model, batch, return_hits: (torch.tensor(3.0), hits))
    with deterministic_algorithms():
        sums = O.CausalLM(pad_id=0, packing=True).eval_sums(None, {"loss_example": torch.tensor([0, 0, 1, 2, 2, 2])},
                                                           "cpu")
    assert sums.tolist() == [3.0, 6.0, 5.0, 2.0, 3.0]


def test_rl_sampling_runs_warn_only_and_the_update_strict(tiny_assets, tmp_path, monkeypatch, torch_mode):
    """A GRPO step under train.deterministic: the rollout (sampling) sees warn-only, the loss strict; and the eval,
    which samples too (rl.num_generations_eval at rl.temperature: the float cumsum CUDA refuses in strict mode), sees
    warn-only (it ran strict until 2026-12-06, which would have failed the step-0 eval on a GPU)."""
    import llmtrain.objectives.grpo as grpo

    seen = {"rollout": set(), "loss": set(), "eval": set()}
    rollout, loss, evaluate = grpo.GRPO.rollout, grpo.GRPO.loss, grpo.GRPO.eval_sums
    monkeypatch.setattr(grpo.GRPO, "rollout",
                        lambda self, *a, **k: seen["rollout"].add(mode()) or rollout(self, *a, **k))
    monkeypatch.setattr(grpo.GRPO, "loss", lambda self, *a, **k: seen["loss"].add(mode()) or loss(self, *a, **k))
    monkeypatch.setattr(grpo.GRPO, "eval_sums",
                        lambda self, *a, **k: seen["eval"].add(mode()) or evaluate(self, *a, **k))
    recipe = write_recipe(tiny_assets, tmp_path, data={"format": "prompt", "max_seq_len": 32, "eval_split": 0.002},
                          rl={"num_generations": 2, "max_completion_tokens": 4, "num_generations_eval": 2,
                              "rewards": [{"type": "format", "pattern": "[aeiou]"}]},
                          train={"max_steps": 2, "micro_batch_size": 2, "deterministic": True, "eval_every_steps": 2})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    assert seen == {"rollout": {(True, True)}, "loss": {(True, False)}, "eval": {(True, True)}}
    assert len(losses(tmp_path / "run")) == 2
    assert mode() == (False, False)
