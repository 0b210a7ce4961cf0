"""run/preflight.check_resume on a checkpoint's recipe.yaml and train_state.json alone (nothing trained): which
changes of the recipe are another run, which need --allow-recipe-change, in-process and in a second."""

import json
from pathlib import Path

import pytest

from llmtrain.capabilities import SECTIONS
from llmtrain.config import load_recipe
from llmtrain.errors import LLMTrainError
from llmtrain.run.preflight import OBJECTIVE, check_resume

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _checkpoint(tmp_path: Path, recipe) -> Path:
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    (ckpt / "recipe.yaml").write_text(recipe.to_yaml())
    (ckpt / "train_state.json").write_text(json.dumps({"examples_per_micro": recipe.train.micro_batch_size}))
    return ckpt


def test_every_modes_section_is_an_objective_key():
    assert set(SECTIONS) <= set(OBJECTIVE)


def test_grpo_to_rloo_is_a_change_of_rl_algorithm_not_another_run(tmp_path):
    """The same rl: section with another algorithm changes what the run trains (rl.algorithm, listed with the other
    rl keys that follow it), allowed with --allow-recipe-change; a distill: recipe on the RL checkpoint is another
    run, refused whatever the flags, naming both modes."""
    grpo = load_recipe(RECIPES / "tiny-grpo.yaml")
    ckpt = _checkpoint(tmp_path, grpo)
    rloo = load_recipe(RECIPES / "tiny-rloo.yaml", [f"output_dir={grpo.output_dir}"])
    with pytest.raises(LLMTrainError, match=r"^this recipe changes .*rl.algorithm 'grpo' -> 'rloo'"):
        check_resume(ckpt, rloo, world=1, fsdp=False, allow_recipe_change=False)
    notes = check_resume(ckpt, rloo, world=1, fsdp=False, allow_recipe_change=True)
    assert any("rl.algorithm changed from 'grpo' to 'rloo'" in n for n in notes)
    assert check_resume(ckpt, grpo, world=1, fsdp=False, allow_recipe_change=False) == []

    distill = load_recipe(RECIPES / "tiny-distill.yaml", [f"train.micro_batch_size={grpo.train.micro_batch_size}"])
    with pytest.raises(LLMTrainError, match=r"written by a run of online RL, GRPO \(rl:\) and this recipe trains "
                       r"distillation \(distill:\): that is another run"):
        check_resume(ckpt, distill, world=1, fsdp=False, allow_recipe_change=True)
