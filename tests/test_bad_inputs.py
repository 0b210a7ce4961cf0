"""Bad input, table-driven: recipe, overrides, data files, model, LoRA, resume and export.

Every case runs the real CLI (typer's runner, in this process) against a finished run folder, and must
exit non-zero with a message that names the key or the file, print no traceback, and leave the run folder
byte for byte as it was: every check runs before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import run_train, write_recipe
from typer.testing import CliRunner

from llmtrain.cli import app

pytestmark = pytest.mark.slow


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    """A finished full run and a finished LoRA run (2 steps, a checkpoint at each), plus files for the cases."""
    root = tmp_path_factory.mktemp("bad-inputs")
    full = write_recipe(tiny_assets, root, name="full.yaml", train={"max_steps": 2}, checkpoint={"every_steps": 1},
                        output_dir=str(root / "full-run"))
    lora = write_recipe(tiny_assets, root, name="lora.yaml", train={"max_steps": 2}, checkpoint={"every_steps": 1},
                        lora={"r": 4, "alpha": 8, "dropout": 0.0}, output_dir=str(root / "lora-run"))
    run_train(full)
    run_train(lora)
    files = root / "files"
    files.mkdir()
    (files / "bad.yaml").write_text("model:\n  name_or_path: [unclosed\n")
    rows = {
        "number.jsonl": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 42}]},
        "norole.jsonl": {"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]},
        "noreply.jsonl": {"messages": [{"role": "user", "content": "hi"}]},
        "columns.jsonl": {"a": "x", "b": "y"},
    }
    for name, row in rows.items():
        (files / name).write_text(json.dumps(row) + "\n")
    (files / "feedback.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "completion": str(i + 1 + i % 2),
                                                              "label": i % 2 == 0}) + "\n" for i in range(8)))
    (files / "broken.jsonl").write_text('{"prompt": "a", "completion": \n')
    (files / "empty.jsonl").write_text("")
    (files / "blank.jsonl").write_text("\n  \n\n")
    (files / "other.csv").write_text("prompt,completion\na,b\n")
    model = files / "damaged-model"
    shutil.copytree(tiny_assets / "model", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(tiny_assets / "model")  # another tokenizer: "reverse" one id past the model's
    grown.add_tokens(["reverse"])
    grown.save_pretrained(files / "grown-tokenizer")
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # a reward model's final/ as it is saved: the decoder under a one-output score head
    scorer = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_assets / "model",
                                                                                       num_labels=1))
    scorer.save_pretrained(files / "scorer")
    grown.save_pretrained(files / "scorer")
    (files / "not-a-dir").write_text("x")
    (files / "stranger").mkdir()
    (files / "stranger" / "notes.txt").write_text("mine")
    return {"full": full, "lora": lora, "full_run": root / "full-run", "lora_run": root / "lora-run", "files": files,
            "data": tiny_assets / "data" / "train.jsonl"}


def F(name: str) -> str:  # a file made by the fixture
    return f"{{files}}/{name}"


# (case id, recipe (full|lora), arguments after the recipe, text the message must contain)
CASES = [
    # recipe and overrides
    ("negative lr", "full", ["train.lr=-1"], "train.lr"),
    # transformers' ImportError had come as a traceback once the run started, doctor passing it (audit 49)
    ("flash-attn on a CPU", "full", ["model.attn_implementation=flash_attention_2"],
     "model.attn_implementation=flash_attention_2 needs the flash-attn package (or kernels, which fetches "),
    ("nan lr", "full", ["train.lr=.nan"], "train.lr"),
    ("negative max_grad_norm", "full", ["train.max_grad_norm=-1"], "train.max_grad_norm"),
    ("alias typo", "full", ["train.learning_rate=1e-4"], "did you mean train.lr"),
    ("zero micro-batch", "full", ["train.micro_batch_size=0"], "train.micro_batch_size"),
    ("unknown precision", "full", ["train.mixed_precision=fp8"], "train.mixed_precision"),
    ("unknown dtype", "full", ["model.dtype=float64"], "model.dtype"),
    ("unknown format", "full", ["data.format=chatml"], "data.format"),
    ("eval fraction > 1", "full", ["data.eval_split=1.5"], "data.eval_split"),
    ("both batch units", "full", ["train.micro_batch_size=4", "train.micro_batch_tokens=64"], "micro_batch_tokens"),
    ("section as value", "full", ["train=5"], "train"),
    ("override without =", "full", ["train.lr"], "key=value"),
    ("unknown section", "full", ["optimizer.name=adam"], "optimizer"),
    ("zero LoRA rank", "lora", ["lora.r=0"], "lora.r"),
    ("negative warmup", "full", ["train.warmup_steps=-3"], "train.warmup_steps"),
    # (a new user's pass, 2026-12-05: these ended in tracebacks, or ran with the key unset)
    ("unclosed list override", "lora", ["lora.target_modules=[q_proj,"],
     "Override 'lora.target_modules=[q_proj,': its value is not valid YAML"),
    ("empty override value", "full", ["train.max_steps="], "Override 'train.max_steps=' has no value"),
    ("negative seed", "full", ["train.seed=-5"], "train.seed (the override train.seed=-5)"),
    ("seed past 2**32", "full", ["train.seed=99999999999"], "train.seed"),
    ("eval split of every row", "full", ["data.eval_split=0.9999"], "leaving none to train on"),
    # data files
    ("missing data file", "full", ["data.path=/nonexistent/train.jsonl"], "/nonexistent/train.jsonl"),
    ("wrong columns", "full", [f"data.path={F('columns.jsonl')}", "data.eval_split=null"], "data.fields"),
    ("number as content", "full", [f"data.path={F('number.jsonl')}", "data.format=messages", "data.eval_split=null"],
     "number.jsonl, row 1"),
    ("message without role", "full", [f"data.path={F('norole.jsonl')}", "data.format=messages",
                                      "data.eval_split=null"], "has no 'role'"),
    ("no assistant turn", "full", [f"data.path={F('noreply.jsonl')}", "data.format=messages", "data.eval_split=null"],
     "no assistant message"),
    ("malformed json", "full", [f"data.path={F('broken.jsonl')}", "data.eval_split=null"],
     "broken.jsonl' line 1: not valid JSON"),
    ("unpaired feedback as SFT", "full", [f"data.path={F('feedback.jsonl')}", "data.eval_split=null"],
     "'label' column of true and false (or 1 and 0): its rows look like unpaired feedback"),
    ("unpaired feedback as pairs", "full", [f"data.path={F('feedback.jsonl')}", "data.eval_split=null",
                                            "data.format=preference", "preference.beta=0.1"], "which no data.fields"),
    ("empty data file", "full", [f"data.path={F('empty.jsonl')}", "data.eval_split=null"],
     "empty.jsonl' (data.path) holds no rows"),
    ("blank data file", "full", [f"data.path={F('blank.jsonl')}", "data.eval_split=null"],
     "blank.jsonl' (data.path) holds no rows"),
    ("mixed extensions", "full", [f"data.path=[{{data}}, {F('other.csv')}]"], "must all be one of"),
    ("budget below an example", "full", ["train.micro_batch_size=1", "train.micro_batch_tokens=4"],
     "train.micro_batch_tokens=4"),
    # model and LoRA
    ("tokenizer not the model's", "full", [f"model.tokenizer={F('grown-tokenizer')}"],
     "model.tokenizer '{files}/grown-tokenizer' gives the data token ids up to 104 ('reverse'), and the model"),
    ("missing model dir", "full", ["model.name_or_path=/nonexistent/model"], "/nonexistent/model"),
    ("damaged weights", "full", [f"model.name_or_path={F('damaged-model')}"], "truncated or damaged"),
    ("a folder above the model", "full", ["model.name_or_path={files}"],
     "is a folder without a tokenizer's files (no tokenizer.json or tokenizer_config.json or tokenizer.model): give "
     "the folder that holds them. Did you mean {files}/damaged-model?"),
    ("unknown LoRA target", "lora", ["lora.target_modules=[nope_proj]"], "lora.target_modules"),
    # a run's folder where its model is meant (the SFT run a next run starts from): which folder holds the model
    ("a run as the model", "lora", ["model.name_or_path={full_run}"],
     "'{full_run}' (model.name_or_path) is a run's folder, not a model: set model.name_or_path={full_run}/final."),
    ("a LoRA run as the model", "full", ["model.name_or_path={lora_run}"],
     "its final/ is a LoRA adapter: `llmtrain export {lora_run} --merge` writes the whole model to "
     "{lora_run}/final-merged; then set model.name_or_path={lora_run}/final-merged."),
    # (the LoRA recipe: the full one's --overwrite of its own folder would delete the teacher, refused first)
    ("a run as the teacher", "lora", ["distill={{teacher: {full_run}, max_completion_tokens: 4}}"],
     "'{full_run}' (distill.teacher) is a run's folder, not a model: set distill.teacher={full_run}/final."),
    # a reward model where a causal LM is read: its score head is no LM head (a random one had trained, 0.315 -> 0.0)
    ("a reward model as the model", "full", ["model.name_or_path={files}/scorer"],
     "'{files}/scorer' (model.name_or_path) is a sequence classifier (LlamaForSequenceClassification: a reward "
     "model's final/ is saved as one)"),
    ("a reward model as the teacher", "lora", ["distill={{teacher: {files}/scorer, max_completion_tokens: 4}}"],
     "'{files}/scorer' (distill.teacher) is a sequence classifier"),
    # output folder
    ("output_dir is a file", "full", [f"output_dir={F('not-a-dir')}"], "is a file"),
    ("overwrite a stranger", "full", [f"output_dir={F('stranger')}"], "not an llmtrain run"),
    ("overwrite the base it reads", "full", ["model.name_or_path={full_run}/final"],
     "model.name_or_path '{full_run}/final' lies inside output_dir '{full_run}', which --overwrite empties"),
    ("overwrite and resume", "full", ["--overwrite", "--resume", "auto"], "give one of the two"),
    # resume
    ("resume a non-checkpoint", "full", ["--resume", "/nonexistent/step_000001"], "does not exist"),
    ("resume by a name not there", "full", ["--resume", "latest"],
     "'latest' does not exist; the checkpoints in {full_run}/checkpoints are step_000001, step_000002"),
    ("LoRA recipe on a full run", "lora", ["output_dir={full_run}", "--resume", "auto"], "full fine-tuning"),
    ("full recipe on a LoRA run", "full", ["output_dir={lora_run}", "--resume", "auto"], "LoRA"),
    ("changed LoRA rank", "lora", ["lora.r=8", "--resume", "auto"], "lora.r=4"),
    ("changed batch layout", "full", ["train.micro_batch_size=2", "--resume", "auto"],
     "micro_batch_size x data-parallel ranks"),
    ("changed data", "full", [f"data.path={F('columns.jsonl')}", "--resume", "auto"], "data.path"),
    ("longer run without the flag", "full", ["train.max_steps=4", "--resume", "auto"], "--allow-recipe-change"),
    ("changed schedule mid-run", "full", ["train.lr=1e-2", "--resume", "{full_run}/checkpoints/step_000001"],
     "--allow-recipe-change"),
]


ON_CUDA = {"flash-attn on a CPU"}  # what a CUDA machine runs (transformers' kernels package fetches flash-attn)


@pytest.mark.parametrize(("case", "which", "args", "expected"), [
    pytest.param(*c, marks=pytest.mark.skipif(c[0] in ON_CUDA and __import__("torch").cuda.is_available(),
                                              reason="it runs on CUDA")) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_cleanly(runs, case, which, args, expected):
    values = {k: str(v) for k, v in runs.items()}
    args = [a.format(**values) for a in args]
    expected = expected.format(**values)
    run = runs["lora_run" if which == "lora" else "full_run"]
    touched = {run, runs["full_run"], runs["lora_run"]}
    before = {p: _snapshot(p) for p in touched}
    flags = [] if "--resume" in args else ["--overwrite"]
    result = CliRunner().invoke(app, ["finetune", str(runs[which]), *args, *flags])
    output = result.output + (result.stderr if hasattr(result, "stderr") and result.stderr_bytes else "")
    assert result.exit_code not in (0, None), output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # ours, not an uncaught error
    assert "Traceback" not in output
    flat = " ".join(output.split())
    assert expected in flat, flat
    for p in touched:
        assert _snapshot(p) == before[p], f"{p} changed"


def test_table_covers_thirty_inputs():
    assert len(CASES) >= 30


def test_export_errors(runs, tmp_path):
    full = CliRunner().invoke(app, ["export", str(runs["full_run"]), "--merge"])
    assert full.exit_code == 2 and "Traceback" not in full.output
    missing = CliRunner().invoke(app, ["export", str(tmp_path / "nope"), "--merge"])
    assert missing.exit_code == 2 and f"'{tmp_path / 'nope'}' does not exist: --merge takes a LoRA run's output_dir" \
        in " ".join(missing.output.split()), missing.output  # it had said its final/ "holds no LoRA adapter"


def test_a_complete_run_is_left_as_it_is(runs):
    run = runs["full_run"]
    before = _snapshot(run)
    result = CliRunner().invoke(app, ["finetune", str(runs["full"]), "--resume", "auto"])
    assert result.exit_code == 0, result.output
    assert "already complete" in " ".join(result.output.split())
    assert _snapshot(run) == before
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["max_steps"] == 2


@pytest.mark.parametrize("args", [["train.max_steps=4", "--allow-recipe-change"], ["train.lr=1e-2"], []],
                         ids=["longer", "changed lr", "same recipe"])
def test_a_finished_run_without_a_checkpoint_is_never_restarted_by_resume(tiny_assets, tmp_path, args):
    """checkpoint.every_steps above max_steps: only final/ is kept. --resume auto cannot continue it (no optimizer
    state), and starting again from step 0 would replace its final/ and metrics: refused (or, unchanged, left as
    complete), the folder byte for byte as it was, and the way to train further named."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 100},
                          output_dir=str(tmp_path / "run"))
    assert CliRunner().invoke(app, ["finetune", str(recipe)]).exit_code == 0
    run = tmp_path / "run"
    assert (run / "final").is_dir() and not list((run / "checkpoints").glob("step_*"))
    before = _snapshot(run)
    result = CliRunner().invoke(app, ["finetune", str(recipe), *args, "--resume", "auto"])
    flat = " ".join(result.output.split())
    assert result.exit_code == (0 if not args else 2), flat
    assert "Traceback" not in result.output
    assert f"model.name_or_path={run}/final" in flat and "no checkpoint" in flat
    assert _snapshot(run) == before


def test_a_malformed_data_file_is_named_with_its_first_bad_line_as_an_editor_counts(tmp_path):
    from llmtrain.data.sources import bad_json_line, load_raw
    from llmtrain.errors import LLMTrainError

    good = '{"prompt": "a", "completion": "b"}'
    cases = {"ok.jsonl": f"{good}\n\n{good}\n", "cut.jsonl": f"{good}\n\n{good}\n" + '{"prompt": "c"\n',
             "list.jsonl": f"{good}\n[1, 2]\n", "array.json": f"[{good},\n{good}\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert bad_json_line(str(tmp_path / "ok.jsonl")) is None
    assert f"'{tmp_path / 'cut.jsonl'}' line 4: not valid JSON" in bad_json_line(str(tmp_path / "cut.jsonl"))
    assert "line 2: a JSON list, not an object" in bad_json_line(str(tmp_path / "list.jsonl"))
    assert "line 3, column 1: not valid JSON" in bad_json_line(str(tmp_path / "array.json"))  # the missing ]
    with pytest.raises(LLMTrainError, match="cut.jsonl' line 4: not valid JSON"):
        load_raw(str(tmp_path / "cut.jsonl"))


def test_data_files_datasets_cannot_read_are_named_with_what_is_wrong(tmp_path):
    """A Latin-1 row in a .jsonl file (a UnicodeDecodeError traceback from the row checks, naming no file), two
    files whose columns differ and a CSV line of three fields (datasets' "An error occurred while generating the
    dataset", naming nothing): each one paragraph with the file, and the line or the columns."""
    from llmtrain.data.sources import load_raw
    from llmtrain.errors import LLMTrainError

    good = '{"prompt": "a", "completion": "b"}\n'
    (tmp_path / "latin1.jsonl").write_bytes((good * 2).encode() + '{"prompt": "caf\u00e9", "completion": "x"}\n'
                                            .encode("latin-1"))
    with pytest.raises(LLMTrainError, match=r"latin1.jsonl' \(data.path\) line 3: byte 0xe9 at byte offset 85 of the "
                                            r"file is not UTF-8: .* iconv -f latin1 -t utf-8"):
        load_raw(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "a.jsonl").write_text(good)
    (tmp_path / "b.jsonl").write_text('{"prompt": "a", "completion": "b", "id": 1}\n')
    with pytest.raises(LLMTrainError, match=r"have different columns \('.*a.jsonl' has \['completion', 'prompt'\]; "
                                            r"'.*b.jsonl' has \['completion', 'id', 'prompt'\]\)"):
        load_raw([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    (tmp_path / "sub").mkdir()  # a folder among several paths had been said not to exist
    with pytest.raises(LLMTrainError, match=r"sub' \(data.path\) is a folder among several paths: a list names files"):
        load_raw([str(tmp_path / "a.jsonl"), str(tmp_path / "sub")])
    (tmp_path / "bad.csv").write_text("prompt,completion\na,b\nc,d,e\n")
    with pytest.raises(LLMTrainError, match=r"Expected 2 fields in line 3, saw 3"):
        load_raw(str(tmp_path / "bad.csv"))


def test_an_output_path_under_a_file_is_refused_before_any_work(runs, tmp_path):
    """prepare-tiny, plot --out, export --out and finetune's output_dir under a file: one paragraph naming the file,
    exit 2, no traceback; finetune says it before reading data or the model."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for args in (["prepare-tiny", str(blocker)], ["prepare-tiny", str(blocker / "sub")],
                 ["plot", str(runs["full_run"]), "--out", str(blocker / "loss.png")],
                 ["export", str(runs["lora_run"]), "--merge", "--out", str(blocker / "merged")],
                 ["finetune", str(runs["full"]), f"output_dir={blocker / 'run'}"]):
        result = CliRunner().invoke(app, args)
        flat = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, flat)
        assert f"'{blocker}' is a file" in flat, (args, flat)
        assert "data:" not in flat and "model:" not in flat, (args, flat)
    assert blocker.read_text() == "x"


def test_a_run_not_trained_yet_as_the_model_is_named_as_such_and_not_asked_of_the_hub(runs, tmp_path):
    """A GRPO or distillation recipe starts from an SFT run's final/: before that run exists, the refusal names the
    run to train first (not prepare-tiny, not a 'tokenizer directory'), and the path is never taken for a hub id."""
    from llmtrain.hub import hub_ids

    assert hub_ids("runs/tiny-sft/final", "mistralai/Mistral-7B-v0.3", "gpt2") == ["mistralai/Mistral-7B-v0.3", "gpt2"]
    missing = tmp_path / "runs" / "tiny-sft" / "final"
    result = CliRunner().invoke(app, ["finetune", str(runs["full"]), f"model.name_or_path={missing}",
                                      f"output_dir={tmp_path / 'out'}"])
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, flat
    assert f"the model folder '{missing}'" in flat and f"the run '{missing.parent}', which has not been trained" in flat
    assert "prepare-tiny" not in flat and not (tmp_path / "out").exists()


def test_estimate_memory_reads_the_headers_launch_where_the_gpu_count_agrees():
    """--num-gpus 8 of recipes/llama7b.yaml, whose header launches FSDP on 8 GPUs, is that launch (it had dropped the
    header: 'say how they are used with --strategy'); another count still asks for the strategy."""
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "llama7b.yaml")
    said = " ".join(CliRunner().invoke(app, ["estimate-memory", recipe, "--num-gpus", "8"]).output.split())
    assert "fsdp.yaml, from the recipe's header" in said and "fsdp on 8 GPUs" in said
    other = CliRunner().invoke(app, ["estimate-memory", recipe, "--num-gpus", "4"])
    assert other.exit_code == 2 and "4 GPUs: say how they are used with --strategy" in other.output


def test_small_refusals_name_what_the_user_gave(runs, tmp_path):
    """A folder as the recipe; a bad value set by an override (said as the override, not only the file); a missing
    eval file named by its own key; a row without its completion key; --num-gpus 0."""
    from llmtrain.data.formats import row_problem

    def refused(*args: str) -> str:
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        return " ".join(result.output.split())

    assert f"Recipe '{tmp_path}' is a folder" in refused("finetune", str(tmp_path))
    assert "train.lr (the override train.lr=abc): must be a number" in refused(
        "finetune", str(runs["full"]), "train.lr=abc")
    assert f"'{tmp_path / 'nope.jsonl'}' does not exist (data.eval_split)" in refused(
        "finetune", str(runs["full"]), f"data.eval_split={tmp_path / 'nope.jsonl'}", f"output_dir={tmp_path / 'o'}")
    from llmtrain.config import load_recipe

    cfg = load_recipe(runs["full"]).data
    assert row_problem({"prompt": "a"}, cfg) == "'completion' (completion) is missing (no such key, or null)"
    assert row_problem({"prompt": "a", "completion": None}, cfg).endswith("is missing (no such key, or null)")
    assert "--num-gpus" in refused("estimate-memory", "--model", "mistral-7b", "--num-gpus", "0")
    # a new user's pass (2026-12-05): division by zero, or a meaningless rate taken, or 0 GiB read as 80
    for flags, said in ((("--mfu", "0"), "--mfu 0:"), (("--mfu", "5"), "(0 < mfu <= 1"),
                        (("--peak-tflops", "0"), "--peak-tflops 0: the step time's rates must be positive"),
                        (("--strategy", "fsdp", "--num-gpus", "2", "--intra-gbps", "0"), "--intra-gbps 0:")):
        assert said in refused("estimate-memory", "--model", "mistral-7b", *flags)
    for gib in ("0", "-5"):
        assert f"--gpu-memory {gib}: a GPU's memory must be positive" in refused(
            "doctor", str(runs["full"]), "--gpu-memory", gib)
    assert "--samples 3 draws several replies a prompt, and they are sampled greedily (temperature 0, the default)" \
        in refused("generate", str(runs["full_run"]), "reverse abc =", "--samples", "3")
    stranger = tmp_path / "mine"
    (stranger / "data").mkdir(parents=True)
    (stranger / "data" / "train.jsonl").write_text("precious\n")
    assert f"prepare-tiny's folder '{stranger}' already holds data, which prepare-tiny did not write" in refused(
        "prepare-tiny", str(stranger))
    assert (stranger / "data" / "train.jsonl").read_text() == "precious\n"
    ddp = str(Path(__file__).resolve().parent.parent / "accelerate_configs" / "cpu_ddp.yaml")
    assert "--resume needs a value after it" in refused("launch", "--config_file", ddp, str(runs["full"]), "--resume")
    assert "'--num_procs' after the recipe is not an option of finetune's" in refused(
        "launch", str(runs["full"]), "--num_procs", "2")
    assert "lies inside output_dir" in refused("launch", "--config_file", ddp, str(runs["full"]),
                                               f"model.name_or_path={runs['full_run']}/final", "--overwrite")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": 5}\n')
    assert "line 1 has a \"prompt\" that is 5, an int, not text" in refused(
        "generate", str(runs["full_run"]), "--prompts", str(prompts))
    assert "Invalid value for '--n' / '-n'" in refused("inspect-data", str(runs["full"]), "--n", "-3")


def test_what_the_run_itself_deletes_is_refused_as_an_output_or_an_input(runs, tmp_path):
    """`finetune runs/x/my.yaml --overwrite` deleted the recipe file it was given, and `export --out` inside the run's
    final/ or checkpoints/ was accepted, where the run's next resume prunes or rewrites it (audit 46): refused before
    anything is written. The run's own recipe.yaml stays a recipe to give."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["full_run"], run)
    mine = run / "my-recipe.yaml"
    shutil.copy(runs["full"], mine)
    before = _snapshot(run)
    result = CliRunner().invoke(app, ["finetune", str(mine), f"output_dir={run}", "--overwrite"])
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and f"the recipe file '{mine}' lies inside output_dir" in flat, flat
    assert _snapshot(run) == before
    lora = tmp_path / "lora"
    shutil.copytree(runs["lora_run"], lora)
    for inside in (lora / "final" / "merged", lora / "checkpoints" / "step_000001" / "merged"):
        result = CliRunner().invoke(app, ["export", str(lora), "--merge", "--out", str(inside)])
        flat = " ".join(result.output.split())
        assert result.exit_code == 2 and "lies inside the run's final/ or checkpoints/" in flat, flat
        assert not inside.exists()


def test_a_resume_that_cannot_write_its_recipe_leaves_the_old_one_whole(runs, tmp_path):
    """A full disk as a resume wrote the run's recipe.yaml had cut it at the disk's end (4,096 bytes of 1,889 written
    over) with a traceback, and generate, export and eval of the run then read 'output_dir: required key is missing'
    (audit 46). The file-size limit stands in for the full disk."""
    import resource
    import shutil

    from helpers import cli

    run = tmp_path / "run"
    shutil.copytree(runs["full_run"], run)
    before = (run / "recipe.yaml").read_bytes()
    limit = len(before) // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = cli("finetune", str(run / "recipe.yaml"), f"output_dir={run}", "train.max_steps=3", "--resume", "auto",
               "--allow-recipe-change", check=False, preexec_fn=small_files)
    flat = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"cannot write {run / 'recipe.yaml'}" in flat
    assert (run / "recipe.yaml").read_bytes() == before and not (run / "recipe.yaml.tmp").exists()


def test_a_refused_export_leaves_no_folder_it_made(runs, tmp_path):
    """A merge refused once --out's folders were made (the base moved away) had left them, empty (audit 46)."""
    import shutil

    lora = tmp_path / "lora"
    shutil.copytree(runs["lora_run"], lora)
    recipe = yaml.safe_load((lora / "recipe.yaml").read_text())
    recipe["model"]["name_or_path"] = str(tmp_path / "moved-away")
    (lora / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["export", str(lora), "--merge", "--out", str(tmp_path / "new" / "sub" / "m")])
    assert result.exit_code == 2 and "moved-away" in " ".join(result.output.split()), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]
