"""What a run exports to final/: loadable with the standard Hugging Face APIs and equal to what was trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import cli, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.errors import LLMTrainError
from llmtrain.run.export import export_merged

TEXT = ["reverse abcde = edcba", "reverse qwer = rewq"]


def _load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs).eval()


@torch.no_grad()
def _logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(TEXT, return_tensors="pt", padding=True)
    return model(**batch).logits


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_assets / "model"))


@pytest.fixture(scope="module")
def full_run(tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-full")
    run_train(write_recipe(tiny_assets, tmp, train={"max_steps": 4, "lr": 3e-3}, checkpoint={"every_steps": 4}))
    return tmp / "run"


@pytest.fixture(scope="module")
def lora_run(tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-lora")
    run_train(write_recipe(tiny_assets, tmp, train={"max_steps": 4, "lr": 1e-2}, checkpoint={"every_steps": 4},
                           lora={"r": 4, "alpha": 8, "dropout": 0.1}))
    return tmp / "run"


def test_full_final_loads_and_equals_the_trained_model(full_run, tiny_assets, tokenizer):
    final = full_run / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    exported = _load(final)
    # The trained weights as the step-4 (= last) resume checkpoint holds them, in the base architecture.
    trained = _load(tiny_assets / "model")
    trained.load_state_dict(load_weights(full_run / "checkpoints" / "step_000004"), strict=True)
    logits = _logits(exported, tokenizer)
    assert torch.equal(logits, _logits(trained, tokenizer))
    # ...and they are not the untrained model's.
    assert (logits - _logits(_load(tiny_assets / "model"), tokenizer)).abs().max() > 1e-3


def test_final_holds_the_tokenizer(full_run, lora_run, tokenizer):
    from transformers import AutoTokenizer

    for run in (full_run, lora_run):
        saved = AutoTokenizer.from_pretrained(str(run / "final"))
        assert saved(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
        assert (saved.bos_token, saved.eos_token, saved.pad_token) == (tokenizer.bos_token, tokenizer.eos_token,
                                                                       tokenizer.pad_token)
        chat = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]
        assert saved.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)


def test_lora_final_is_an_adapter_equal_to_its_merged_export(lora_run, tiny_assets, tokenizer):
    from peft import PeftModel

    final = lora_run / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # never the 7B base again
    # The exported adapter is the last checkpoint's adapter (PEFT drops the adapter name from the keys).
    adapter = load_weights(final / "adapter_model.safetensors")
    ckpt = {k.replace(".default", ""): v for k, v in load_weights(lora_run / "checkpoints" / "step_000004").items()}
    assert adapter.keys() == ckpt.keys() and all(torch.equal(adapter[k], ckpt[k]) for k in adapter)

    peft_model = PeftModel.from_pretrained(_load(tiny_assets / "model"), str(final)).eval()
    adapted = _logits(peft_model, tokenizer)
    assert (adapted - _logits(_load(tiny_assets / "model"), tokenizer)).abs().max() > 1e-4  # not a no-op

    proc = cli("export", str(lora_run), "--merge")
    out, merged_dir = proc.stdout.strip(), lora_run / "final-merged"
    # the path alone on stdout; on stderr what it is, and no transformers progress bar (issue 53)
    assert f"a whole model in {merged_dir}" in proc.stderr and "Loading weights" not in proc.stderr
    assert out.endswith(str(merged_dir)) and (merged_dir / "model.safetensors").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    merged = _load(merged_dir)
    assert set(merged.state_dict()) == set(_load(tiny_assets / "model").state_dict())  # a plain Llama
    torch.testing.assert_close(_logits(merged, tokenizer), adapted, atol=1e-5, rtol=1e-5)
    # The merged folder is complete: it has the tokenizer too.
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(merged_dir))(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]


def test_an_rslora_run_scales_by_alpha_over_root_r_and_exports_so(tiny_assets, tokenizer, tmp_path):
    """lora.rslora (peft's use_rslora): the lora_run's settings (r 4, alpha 8) at scale 8 / sqrt(4) = 4 instead of
    8 / 4 = 2. The first step is the base model's either way (B starts at 0), the later ones differ; the adapter
    says use_rslora, so peft loads it at the same scale, and the merged export equals it."""
    from peft import PeftModel

    run = tmp_path / "run"
    run_train(write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "lr": 1e-2}, checkpoint={"every_steps": 4},
                           lora={"r": 4, "alpha": 8, "dropout": 0.1, "rslora": True}), "logging.every_steps=1")
    ours = [r["loss"] for r in records(run)]
    (plain := tmp_path / "plain").mkdir()
    run_train(write_recipe(tiny_assets, plain, train={"max_steps": 4, "lr": 1e-2},
                           lora={"r": 4, "alpha": 8, "dropout": 0.1}), "logging.every_steps=1")
    theirs = [r["loss"] for r in records(plain / "run")]
    assert ours[0] == pytest.approx(theirs[0], abs=1e-6) and abs(ours[-1] - theirs[-1]) > 1e-3
    peft_model = PeftModel.from_pretrained(_load(tiny_assets / "model"), str(run / "final")).eval()
    scales = {m.scaling["default"] for m in peft_model.modules() if isinstance(getattr(m, "scaling", None), dict)}
    assert peft_model.peft_config["default"].use_rslora and scales == {4.0}
    cli("export", str(run), "--merge")
    torch.testing.assert_close(_logits(_load(run / "final-merged"), tokenizer), _logits(peft_model, tokenizer),
                               atol=1e-5, rtol=1e-5)


def test_merge_refuses_full_runs_and_existing_outputs(full_run, lora_run, tmp_path):
    with pytest.raises(LLMTrainError, match="holds no LoRA adapter"):
        export_merged(full_run, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    with pytest.raises(LLMTrainError, match="already exists"):
        export_merged(lora_run, taken)
    proc = cli("export", str(lora_run), check=False)
    assert proc.returncode == 2 and "Nothing to do" in proc.stderr and "Traceback" not in proc.stderr
    # a checkpoint has a recipe.yaml and no final/: said so, with the run's folder (was: "holds no LoRA adapter")
    step = lora_run / "checkpoints" / "step_000004"
    with pytest.raises(LLMTrainError, match=rf"'{step}' is a checkpoint; --merge takes the run's output_dir "
                                            rf"\('{lora_run}'\)"):
        export_merged(step, tmp_path / "from-step")
    assert not (tmp_path / "from-step").exists()


def test_a_missing_or_damaged_adapter_and_a_run_without_final_are_said_in_a_paragraph(lora_run, tmp_path):
    """A final/ without its adapter_model.safetensors (peft then read the folder as a hub id) or with a truncated one
    (safetensors' header error) had been a traceback in export and generate (audit 26); a LoRA run without final/ had
    been called a full fine-tune's."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("final-merged", "checkpoints"))
    weights = run / "final" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    says = rf"the LoRA adapter in '{run / 'final'}' could not be read \(SafetensorError: .*truncated or damaged"
    with pytest.raises(LLMTrainError, match=says):
        export_merged(run, tmp_path / "merged")
    proc = cli("generate", str(run), "reverse abc =", check=False)
    assert proc.returncode == 2 and "truncated or damaged" in proc.stderr and "Traceback" not in proc.stderr
    weights.unlink()
    with pytest.raises(LLMTrainError, match="holds a LoRA adapter's adapter_config.json and no weights"):
        export_merged(run, tmp_path / "merged")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()  # (a finished run's final/ removed: the test below)
    with pytest.raises(LLMTrainError, match="has no final/ to merge: the run has not finished"):
        export_merged(run, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_a_finished_run_whose_final_is_gone_is_told_what_writes_it_again(lora_run, tmp_path):
    """A run that finished (summary.json) and whose final/ was removed had been told it had not finished and to
    resume with --resume auto, which refused: nothing is left to train (audit 39). It is told what works, and that
    works: summary.json moved aside, the resume trains nothing and writes final/ again, the adapter the run finished
    with; and RUN/final names the run to export, as generate and eval take it."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("final-merged"))
    shutil.rmtree(run / "final")
    with pytest.raises(LLMTrainError, match=r"finished \(its summary.json says so\), but its final/ is gone"):
        export_merged(run, tmp_path / "merged")
    proc = cli("generate", str(run), "reverse abc =", check=False)
    assert proc.returncode == 2 and "but its final/ is gone" in " ".join(proc.stderr.split())
    (run / "summary.json").rename(tmp_path / "summary.json")
    run_train(run / "recipe.yaml", f"output_dir={run}", resume="auto")
    adapter = "final/adapter_model.safetensors"
    assert max_abs_diff(load_weights(run / adapter), load_weights(lora_run / adapter)) == 0
    out = export_merged(run / "final", tmp_path / "merged")
    assert out == tmp_path / "merged" and (out / "model.safetensors").is_file()


def test_merge_writes_beside_out_under_a_name_of_its_own(lora_run, tmp_path):
    """The scratch folder was OUT.tmp, removed first whatever it held: a user's folder of that name was deleted."""
    mine = tmp_path / "merged.tmp"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    out = export_merged(lora_run, tmp_path / "merged")
    assert out == tmp_path / "merged" and (out / "model.safetensors").is_file()
    assert (mine / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.tmp"]  # no scratch folder left


def test_a_base_that_cannot_be_read_again_is_said_in_a_paragraph(tiny_assets, tmp_path):
    """A LoRA run's export and replies read its base again from model.name_or_path. A base drawn at random
    (model.random_init: its weights never saved) is refused by export, generate and eval alike, naming the key (export
    and generate had died in transformers' OSError, 'no file named model.safetensors', a traceback); a base folder
    moved away since the run is a paragraph naming the path, where export had printed a traceback."""
    import shutil

    from llmtrain.config import load_recipe
    from llmtrain.run.benchmarks import recipe_problem
    from llmtrain.run.replies import load_source

    model = tmp_path / "base"
    shutil.copytree(tiny_assets / "model", model)
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    run_train(write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model), "random_init": True},
                           train={"max_steps": 1}, lora=lora))
    run = tmp_path / "run"
    for use in (lambda: export_merged(run), lambda: load_source(str(run))):
        with pytest.raises(LLMTrainError) as refused:
            use()
        said = " ".join(str(refused.value).split())
        assert "randomly initialised" in said and "(model.random_init: true), whose weights are never saved" in said
    assert not (run / "final-merged").exists()
    assert "whose weights are never saved" in recipe_problem(load_recipe(run / "recipe.yaml"), str(run), adapter=True)

    run_train(write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model)}, train={"max_steps": 1},
                           lora=lora), f"output_dir={tmp_path / 'saved'}")
    model.rename(tmp_path / "moved")
    proc = cli("export", str(tmp_path / "saved"), "--merge", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"the model folder '{model}' (model.name_or_path / model.tokenizer) does not exist" in " ".join(
        proc.stderr.split()), proc.stderr
    assert not (tmp_path / "saved" / "final-merged").exists()


def test_a_run_on_a_relative_model_path_is_used_from_any_directory(tiny_assets, tmp_path, monkeypatch):
    """`llmtrain finetune RECIPE model.name_or_path=base` in one directory, then `generate`, `export --merge` and
    `eval` of the run from another: the run's recipe.yaml (and each checkpoint's) names the directory it was started
    in, and a relative base not found from here is read from there (it had been asked of the hub as the id 'base')."""
    import shutil

    from llmtrain.run.benchmarks import resolve
    from llmtrain.run.replies import load_source

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny_assets / "model", work / "base")
    recipe = write_recipe(tiny_assets, work, model={"name_or_path": "base"}, train={"max_steps": 2},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0}, checkpoint={"every_steps": 1, "keep_last": 1},
                          output_dir="run")
    monkeypatch.chdir(work)
    run_train(recipe)
    run = work / "run"
    for saved in (run / "recipe.yaml", run / "checkpoints" / "step_000002" / "recipe.yaml"):
        assert saved.read_text().splitlines()[0].endswith(f"started in: {work}"), saved
    monkeypatch.chdir(elsewhere)
    assert load_source(str(run)).describe.endswith(f"(a LoRA adapter on {work / 'base'})")
    assert export_merged(run) == run / "final-merged" and (run / "final-merged" / "model.safetensors").is_file()
    assert resolve(str(run), dtype="float32").base == str(work / "base")  # eval's --baseline base
    shutil.copytree(tiny_assets / "model", elsewhere / "base")  # one of that name here wins: read as given first
    assert resolve(str(run), dtype="float32").base == "base"


def test_the_templates_end_of_turn_token_is_among_the_exported_models_end_tokens(tiny_assets, tmp_path, full_run):
    """A base model trained with a chat template whose replies end with a token that is not its EOS (Qwen3-Base with
    ChatML: <|im_end|>; here <|USER|>, the next turn's marker) lists only its EOS in generation_config.json, so
    transformers' generate and servers reading it ran on past every reply. final/ (a whole model) and `export --merge`
    (an adapter's base) list the end of turn after the ids the model had; a template that ends with EOS changes
    nothing."""
    import json

    from transformers import AutoTokenizer

    template = tmp_path / "next-marker.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}<|{{ m['role'] | upper }}|>{{ m['content'] }}"
                        "{% if m['role'] == 'assistant' %}<|USER|>{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}<|ASSISTANT|>{% endif %}")
    marker = AutoTokenizer.from_pretrained(str(tiny_assets / "model")).convert_tokens_to_ids("<|USER|>")
    data = {"chat_template": str(template)}

    def ends(folder):
        return json.loads((folder / "generation_config.json").read_text())["eos_token_id"]

    assert ends(tiny_assets / "model") == 2 and ends(full_run / "final") == 2  # EOS ends the tiny template's replies
    for name in ("full", "lora"):
        (tmp_path / name).mkdir()
    run_train(write_recipe(tiny_assets, tmp_path / "full", data=data, train={"max_steps": 1}))
    assert ends(tmp_path / "full" / "run" / "final") == [2, marker]
    run_train(write_recipe(tiny_assets, tmp_path / "lora", data=data, train={"max_steps": 1}, lora={"r": 4}))
    assert not (tmp_path / "lora" / "run" / "final" / "generation_config.json").exists()  # an adapter: its base's
    assert ends(export_merged(tmp_path / "lora" / "run")) == [2, marker]



def test_a_place_the_system_refuses_and_a_failed_write_are_a_paragraph_and_leave_nothing(lora_run, tmp_path,
                                                                                         monkeypatch):
    """--out in a folder the system will not create in (/proc: writable by its permissions, so the check before had
    passed it) had ended in a traceback after the merge; it is said before the merge. A write that fails midway (a
    full disk) is said with the folder, and leaves neither --out nor its temporary folder."""
    import errno

    from transformers import PreTrainedModel

    if Path("/proc").is_dir():
        proc = cli("export", str(lora_run), "--merge", "--out", "/proc/llmtrain-merged", check=False)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and "--out '/proc/llmtrain-merged' cannot be created" in said, said
        assert "Traceback" not in proc.stderr and "merged" not in proc.stdout

    def full_disk(self, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "merged"
    with pytest.raises(LLMTrainError, match=rf"writing the merged model to '{out}' failed \(No space left on device"):
        export_merged(lora_run, out)
    assert list(tmp_path.iterdir()) == []

    def safetensors_full(self, folder, **kwargs):  # what safetensors raises on a full disk: not an OSError
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", safetensors_full)
    with pytest.raises(LLMTrainError, match="failed \\(Error while serializing: IoError"):
        export_merged(lora_run, out)
    assert list(tmp_path.iterdir()) == []
