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


def test_a_changed_recipe_against_a_finished_runs_older_checkpoint_says_the_run_finished(tmp_path):
    """A run stopped at step 2, went on to finish at step 4 (train.max_steps changed with --allow-recipe-change) and
    kept step 2's checkpoint only: the shipped recipe resumed against it named 'the run that was interrupted' where
    the run had finished; now the step it finished at and where its own recipe is."""
    grpo = load_recipe(RECIPES / "tiny-grpo.yaml")
    (tmp_path / "checkpoints").mkdir()
    ckpt = _checkpoint(tmp_path / "checkpoints", grpo)
    longer = load_recipe(RECIPES / "tiny-grpo.yaml", ["train.max_steps=90"])
    with pytest.raises(LLMTrainError, match=r"would differ from the run that was interrupted"):
        check_resume(ckpt, longer, world=1, fsdp=False, allow_recipe_change=False)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4}))
    (ckpt / "train_state.json").write_text(json.dumps({"examples_per_micro": 16, "step": 2}))
    with pytest.raises(LLMTrainError, match=r"from the run that wrote it \(which went on from it to finish at step 4: "
                       r"final/ is that run's"):
        check_resume(ckpt, longer, world=1, fsdp=False, allow_recipe_change=False)


def test_overwrite_refuses_only_what_the_run_would_read_from_the_folder_it_empties(tmp_path):
    """rundir.inputs_inside: --overwrite of a folder holding the recipe's model is refused naming the key; the
    tokenised data's cache there is not (it is made again); --resume empties nothing, and with --overwrite is
    refused as a contradiction."""
    from llmtrain.run.rundir import inputs_inside

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "cache").mkdir()
    recipe = {"model": {"name_or_path": str(out / "final")}, "data": {"path": str(tmp_path), "cache_dir":
                                                                      str(out / "cache")}, "output_dir": str(out)}
    said = inputs_inside(out, recipe, resume=None, overwrite=True)
    assert said.startswith(f"model.name_or_path '{out / 'final'}' lies inside output_dir '{out}', which --overwrite")
    recipe["model"]["name_or_path"] = str(tmp_path / "elsewhere")
    assert inputs_inside(out, recipe, resume=None, overwrite=True) is None  # the cache alone: made again
    recipe["model"]["name_or_path"] = str(out / "final")
    assert inputs_inside(out, recipe, resume="auto", overwrite=False) is None
    assert "give one of the two" in inputs_inside(out, recipe, resume="auto", overwrite=True)


@pytest.mark.parametrize("lora", [[], ["lora.r=4"]], ids=["full", "lora"])
def test_other_new_tokens_are_refused_whatever_the_flags(tmp_path, lora):
    """model.new_tokens grows the embedding and the head (LoRA: their trained copies), which the checkpoint holds at
    its rows: another list is refused with the key, --allow-recipe-change or not (it had been allowed, then the load
    ended in torch's size mismatch traceback, audit 5)."""
    recipe = load_recipe(RECIPES / "tiny.yaml", lora)
    ckpt = _checkpoint(tmp_path, recipe)
    grown = load_recipe(RECIPES / "tiny.yaml", [*lora, "model.new_tokens=['<x>']"])
    for allow in (False, True):
        with pytest.raises(LLMTrainError, match=r"has model.new_tokens=\[\] and this recipe model.new_tokens="
                                                r"\['<x>'\]: the embedding and the head have other rows"):
            check_resume(ckpt, grown, world=1, fsdp=False, allow_recipe_change=allow)


@pytest.mark.parametrize(("change", "says"), [
    (["lora.lr_ratio=16"], r"lora.lr_ratio=None and this recipe lora.lr_ratio=16.0: LoRA\+ gives the optimizer "
                           r"other parameter groups"),
    (["lora.dora=true"], r"lora.dora=False and this recipe lora.dora=True: the adapter's parameters differ"),
])
def test_an_adapter_change_the_checkpoint_cannot_be_read_into_is_refused_whatever_the_flags(tmp_path, change, says):
    """Turning LoRA+ on (its own groups for lora_B and the embeddings) or DoRA (its magnitude vectors) at a resume had
    passed the checks with --allow-recipe-change, then ended in the optimizer's 'loaded state dict has a different
    number of parameter groups' traceback, or DoRA's refusal once the model was built (audit 47); a rate of LoRA+
    changed to another stays allowed (the groups are the same, their rates put back after the load)."""
    recipe = load_recipe(RECIPES / "tiny.yaml", ["lora.r=4"])
    ckpt = _checkpoint(tmp_path, recipe)
    for allow in (False, True):
        with pytest.raises(LLMTrainError, match=says):
            check_resume(ckpt, load_recipe(RECIPES / "tiny.yaml", ["lora.r=4", *change]), world=1, fsdp=False,
                         allow_recipe_change=allow)
    (tmp_path / "plus").mkdir()
    plus = _checkpoint(tmp_path / "plus", load_recipe(RECIPES / "tiny.yaml", ["lora.r=4", "lora.lr_ratio=16"]))
    notes = check_resume(plus, load_recipe(RECIPES / "tiny.yaml", ["lora.r=4", "lora.lr_ratio=8"]), world=1,
                         fsdp=False, allow_recipe_change=True)
    assert any("lora.lr_ratio changed from 16.0 to 8.0" in n for n in notes)


def test_a_finished_run_named_by_another_spelling_of_its_output_dir_is_still_finished(tmp_path, monkeypatch):
    """runs/x finished, then --resume auto with output_dir=/abs/runs/x: the saved recipe's output_dir differed, so the
    finished run was taken for an interrupted one and the refusal said so (audit 53)."""
    from llmtrain.run.preflight import finished_run

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "train_state.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"steps": 4}))
    recipe = load_recipe(RECIPES / "tiny.yaml", ["output_dir=runs/x"])
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    absolute = load_recipe(RECIPES / "tiny.yaml", [f"output_dir={run}"])
    assert finished_run(run, absolute, allow_recipe_change=False) == {"steps": 4}
    longer = load_recipe(RECIPES / "tiny.yaml", [f"output_dir={run}", "train.max_steps=600"])
    with pytest.raises(LLMTrainError, match=r"is complete, and this recipe changes train.max_steps 300 -> 600"):
        finished_run(run, longer, allow_recipe_change=False)
