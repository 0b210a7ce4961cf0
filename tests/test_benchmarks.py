"""`llmtrain eval`: a run's benchmark scores through lm-evaluation-harness are the numbers the harness's own CLI prints
for the same model (a whole model, and a LoRA adapter on its base), on 2 processes as on 1; bad input is one
paragraph and writes nothing. The tasks are the tiny task on local files (tasks/tiny_reverse*.yaml, pointed here at
the test's data), and GSM8K's test split from ../shared where this machine has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ENV, LLMTRAIN, REPO, cli, invoke, run_train, write_recipe

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.long(110)  # tests/conftest.py

OFFLINE = {**ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
LIMIT = "40"


def task_folder(tiny: Path, folder: Path) -> Path:
    """The shipped tiny tasks, their data path pointed at this test's tiny data."""
    out = folder / "tasks"
    out.mkdir(exist_ok=True)
    for name in ("tiny_reverse.yaml", "tiny_reverse_ll.yaml"):
        text = (REPO / "tasks" / name).read_text()
        assert "assets/tiny/data/eval.jsonl" in text
        (out / name).write_text(text.replace("assets/tiny/data/eval.jsonl", str(tiny / "data" / "eval.jsonl")))
    return out


def table_rows(output: str) -> list[str]:
    """The harness's results table: its rows, as printed."""
    return [line for line in output.splitlines() if line.startswith("|")]


def harness_cli(model_args: str, tasks: Path) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks",
                           "tiny_reverse,tiny_reverse_ll", "--include_path", str(tasks), "--limit", LIMIT,
                           "--batch_size", "8", "--device", "cpu"],
                          env=OFFLINE, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return table_rows(proc.stdout)


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    """(a full fine-tune's run, the task folder): 120 steps of the tiny task, part-way to learning it (the scores
    are neither 0 nor 1)."""
    folder = tmp_path_factory.mktemp("eval")
    recipe = write_recipe(tiny_assets, folder, data={"max_seq_len": 64},
                          train={"max_steps": 120, "micro_batch_size": 16, "lr": 1e-3, "warmup_steps": 10},
                          checkpoint={"every_steps": 60, "save_final": True})
    run_train(recipe)
    return folder / "run", task_folder(tiny_assets, folder)


@pytest.mark.slow
@pytest.mark.extended  # main tier: the LoRA run's test below (the harness's CLI on a model and its adapter)
def test_a_runs_scores_are_the_harness_clis_for_its_final_model(trained):
    run, tasks = trained
    ours = cli("eval", str(run), "--tasks", "tiny_reverse,tiny_reverse_ll", "--include-path", str(tasks),
               "--limit", LIMIT, "--batch-size", "8", "--baseline", "base", env=OFFLINE)
    rows, want = table_rows(ours.stdout), harness_cli(f"pretrained={run / 'final'}", tasks)
    assert rows[:len(want)] == want and len(rows) == 2 * len(want)  # then the baseline's own table
    assert "against" in ours.stdout and "difference" in ours.stdout  # the base model beside it
    named = [line for line in ours.stdout.splitlines() if line.endswith(":") and not line.startswith("|")]
    assert named[0] == f"{run / 'final'}:" and named[1].endswith("(the baseline):"), ours.stdout  # each table's
    assert "(the baseline) on tiny_reverse, tiny_reverse_ll" in ours.stderr
    written = json.loads((run / "lm_eval" / "tiny_reverse-tiny_reverse_ll.json").read_text())
    exact = written["results"]["tiny_reverse"]["exact_match,none"]
    assert 0 < exact < 1 and any("exact_match" in row and f"{exact:g}" in row for row in rows)
    assert written["limit"] == float(LIMIT) and written["model_args"]["pretrained"] == str(run / "final")
    # the recipe's base, the random tiny model: it reverses nothing
    assert written["baseline"]["target"].endswith("model") and written["baseline"]["target"] != str(run / "final")
    assert written["baseline"]["results"]["tiny_reverse"]["exact_match,none"] == 0.0
    # its last checkpoint is the same weights, loaded by llmtrain and handed over as a model object
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert last.name == "step_000120"
    again = cli("eval", str(last), "--tasks", "tiny_reverse,tiny_reverse_ll", "--include-path", str(tasks),
                "--limit", LIMIT, "--batch-size", "8", env=OFFLINE)
    assert table_rows(again.stdout) == want  # (no baseline: one table)
    assert (run / "lm_eval" / "tiny_reverse-tiny_reverse_ll-2.json").is_file()  # a second call: a new file


@pytest.mark.slow
@pytest.mark.extended  # 63 s; main tier: the QLoRA run's adapter on its 4-bit base as transformers and peft load it
def test_a_lora_run_is_its_adapter_on_its_base_as_the_harness_loads_it(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}, lora={"r": 8, "alpha": 16, "dropout": 0.0},
                          train={"max_steps": 20, "micro_batch_size": 16, "lr": 1e-2, "warmup_steps": 5})
    run_train(recipe)
    tasks = task_folder(tiny_assets, tmp_path)
    ours = cli("eval", str(tmp_path / "run"), "--tasks", "tiny_reverse,tiny_reverse_ll", "--include-path",
               str(tasks), "--limit", LIMIT, "--batch-size", "8", env=OFFLINE)
    final = tmp_path / "run" / "final"
    harness = harness_cli(f"pretrained={tiny_assets / 'model'},peft={final},tokenizer={final}", tasks)
    assert table_rows(ours.stdout) == harness
    written = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse-tiny_reverse_ll.json").read_text())
    assert written["model_args"]["peft"] == str(final) and written["limit"] == float(LIMIT)
    # the harness's own bars (building contexts, running requests) pass disable= themselves: silenced all the same
    assert "%|" not in ours.stderr and "it/s]" not in ours.stderr, ours.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.slow
def test_a_qlora_run_is_its_adapter_on_its_4bit_base_as_transformers_and_peft_load_it(tiny_assets, tmp_path):
    """The harness's hf model cannot quantize a base as llmtrain does, so llmtrain hands it the model built (4-bit
    base, adapter): its scores are the harness's on the same model loaded with transformers' BitsAndBytesConfig and
    peft here, and differ from the adapter on the unquantized base (what `pretrained=BASE,peft=` would score);
    --baseline base is the 4-bit base without the adapter. The tiny task's reversals scored by perplexity too: a
    continuous score, which 10 steps from a random base move."""
    pytest.importorskip("bitsandbytes")
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from llmtrain.model.modeling import _keep_cpu_4bit_layout
    from llmtrain.run.benchmarks import scores

    base = tiny_assets / "model"
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}, lora={"r": 8, "alpha": 16, "dropout": 0.0},
                          model={"dtype": "bfloat16", "quantize": "nf4"},
                          train={"max_steps": 10, "micro_batch_size": 16, "lr": 1e-2, "warmup_steps": 0,
                                 "mixed_precision": "bf16"})
    run_train(recipe)
    tasks = task_folder(tiny_assets, tmp_path)
    (tasks / "tiny_reverse_ppl.yaml").write_text(yaml.safe_dump({
        "task": "tiny_reverse_ppl", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tiny_assets / "data" / "eval.jsonl")}},
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{prompt}}{{completion}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}], "metadata": {"version": 1.0}}))
    names = ["tiny_reverse_ll", "tiny_reverse_ppl"]
    cli("eval", str(tmp_path / "run"), "--tasks", ",".join(names), "--include-path", str(tasks), "--limit", LIMIT,
        "--batch-size", "8", "--baseline", "base", env=OFFLINE)
    final = tmp_path / "run" / "final"
    written = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse_ll-tiny_reverse_ppl.json").read_text())

    def scored(quantize: bool, adapter: bool = True) -> dict:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                     **({"quantization_config": q} if quantize else {}))
        # llmtrain keeps bitsandbytes' training kernel for its 4-bit layers on a CPU with AVX512-BF16 (its repacked
        # inference kernel sums in another order: 2.7e-4 of bits_per_byte here), and the same weights through the
        # same kernel are what is compared
        _keep_cpu_4bit_layout(model)
        model = (PeftModel.from_pretrained(model, str(final)) if adapter else model).eval()
        lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(final), batch_size=8)
        return scores(simple_evaluate(model=lm, tasks=names, limit=float(LIMIT), log_samples=False,
                                      task_manager=TaskManager(include_path=[str(tasks)], include_defaults=False)))

    ours, theirs, unquantized = scores(written), scored(quantize=True), scored(quantize=False)
    assert ours == theirs, (ours, theirs)
    bits = ours["tiny_reverse_ppl"]["bits_per_byte"]
    assert 0 < bits < 8 and abs(unquantized["tiny_reverse_ppl"]["bits_per_byte"] / bits - 1) > 1e-4, unquantized  # 4e-4
    assert written["model_args"] == {"pretrained": str(base), "peft": str(final), "dtype": "bfloat16",
                                     "quantize": "nf4"}
    # --baseline base: the 4-bit base the run started from, without the adapter
    assert written["baseline"]["target"] == f"{base} (in 4 bits, nf4)"
    assert scores(written["baseline"]) == scored(quantize=True, adapter=False) != ours


@pytest.mark.extended  # main tier: the 1-process tests above, whose numbers this one equals
def test_two_processes_give_the_same_scores_and_write_once(trained, free_port):
    run, tasks = trained
    one = table_rows(cli("eval", str(run), "--tasks", "tiny_reverse", "--include-path", str(tasks), "--limit", LIMIT,
                         "--batch-size", "8", env=OFFLINE).stdout)
    before = set((run / "lm_eval").glob("*.json"))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port), "-m", "llmtrain", "eval", str(run), "--tasks",
                           "tiny_reverse", "--include-path", str(tasks), "--limit", LIMIT, "--batch-size", "8"],
                          env=OFFLINE, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert table_rows(proc.stdout) == one
    assert len(set((run / "lm_eval").glob("*.json")) - before) == 1


@pytest.mark.extended  # a 2-process run, beside the one-process tests of a checkpoint and a QLoRA run (Target.load)
def test_a_model_handed_to_the_harness_is_scored_once_over_two_processes(trained, tmp_path, free_port):
    """A checkpoint is loaded by llmtrain and handed to the harness built (as a QLoRA run's 4-bit base is), which
    would have every process score every request: over 2 processes each scores its half (the loglikelihood requests
    counted per rank: 20 + 20 = the one process's 40, one a document), and the table is the one process's."""
    run, tasks = trained
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]  # step 120: scores neither 0 nor 1
    args = ["eval", str(checkpoint), "--tasks", "tiny_reverse_ll", "--include-path", str(tasks), "--limit", LIMIT,
            "--batch-size", "8"]
    counts = {n: tmp_path / f"{n}-processes" for n in (1, 2)}
    for n, folder in counts.items():
        folder.mkdir()
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", str(n),
                               "--main_process_port", str(free_port), str(REPO / "tests" / "eval_probe.py"),
                               str(folder), *args], env=OFFLINE, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts[n] = ({p.name: json.loads(p.read_text()) for p in folder.glob("rank*.json")}, table_rows(proc.stdout))
    (one, rows), (two, rows_two) = counts[1], counts[2]
    assert one == {"rank0.json": 40} and two == {"rank0.json": 20, "rank1.json": 20}, (one, two)
    assert rows_two == rows and rows and "|acc   |↑  |    0|" not in rows[-1], rows


@pytest.mark.extended  # 2 processes; main tier: the recipe's eval on one process (below)
@pytest.mark.slow
def test_a_qlora_runs_recipe_eval_on_two_processes_scores_each_request_once(tiny_assets, tmp_path, free_port):
    """A QLoRA run (its final/ handed to the harness built) with an eval: section, trained and scored on 2 processes:
    the process group lives until final/ is scored (it ended with the training: the harness's gather then failed), each
    process scores half of the requests, and the scores are `llmtrain eval`'s on one process."""
    pytest.importorskip("bitsandbytes")
    tasks = task_folder(tiny_assets, tmp_path)
    benchmark = {"tasks": ["tiny_reverse_ll"], "include_path": [str(tasks)], "limit": 40, "batch_size": 8}
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}, eval=benchmark,
                          lora={"r": 8, "alpha": 16, "dropout": 0.0}, model={"dtype": "bfloat16", "quantize": "nf4"},
                          train={"max_steps": 10, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 0,
                                 "mixed_precision": "bf16"})
    counts = tmp_path / "counts"
    counts.mkdir()
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port), str(REPO / "tests" / "eval_probe.py"), str(counts),
                           "finetune", str(recipe)], env=OFFLINE, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name: json.loads(p.read_text()) for p in counts.glob("rank*.json")} == {"rank0.json": 20,
                                                                                      "rank1.json": 20}
    at_the_end = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse_ll.json").read_text())
    cli("eval", str(tmp_path / "run"), "--tasks", "tiny_reverse_ll", "--include-path", str(tasks), "--limit", "40",
        "--batch-size", "8", env=OFFLINE)
    again = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse_ll-2.json").read_text())
    assert again["results"] == at_the_end["results"] and at_the_end["results"]["tiny_reverse_ll"]["sample_len"] == 40


@pytest.mark.slow
@pytest.mark.extended  # GSM8K's real test split through the harness's own gsm8k task settings, on local files
def test_a_task_on_local_gsm8k_runs_offline(trained, tmp_path):
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
    if not shared.is_file():
        pytest.skip("no GSM8K in ../shared")
    run, _ = trained
    # docs/eval.md's YAML: the train split too, the harness's gsm8k drawing its few-shot examples from it
    (tmp_path / "gsm8k_local.yaml").write_text(
        "include: " + str(Path(__import__("lm_eval").__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml") + "\n"
        "task: gsm8k_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    train: {shared.with_name('train.jsonl')}\n    test: {shared}\n")
    # from a folder outside any git repository, as a user's: the harness's git probe had printed "fatal: not a git
    # repository" (git's stderr) once a model
    ours = subprocess.run([*LLMTRAIN, "eval", str(run), "--tasks", "gsm8k_local", "--include-path", str(tmp_path),
                           "--limit", "3", "--num-fewshot", "1"], env=OFFLINE, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert any("gsm8k_local" in row and "exact_match" in row for row in table_rows(ours.stdout))
    assert "fatal" not in ours.stderr, ours.stderr


def test_an_unknown_task_is_named_with_the_nearest_and_nothing_is_written(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path)
    (tmp_path / "run" / "final").mkdir(parents=True)  # a finished run's folder, as resolve reads it
    (tmp_path / "run" / "recipe.yaml").write_text(recipe.read_text())
    (tmp_path / "run" / "final" / "config.json").write_text((tiny_assets / "model" / "config.json").read_text())
    proc = invoke("eval", str(tmp_path / "run"), "--tasks", "tiny_revers", "--include-path",
                  str(task_folder(tiny_assets, tmp_path)), check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "unknown task 'tiny_revers' (nearest: tiny_reverse" in said, said
    assert not (tmp_path / "run" / "lm_eval").exists()


@pytest.mark.parametrize("option, says", [
    (["--limit", "0"], "--limit 0 scores nothing"),  # the harness's ValueError traceback
    (["--batch-size", "abc"], "--batch-size abc: give a number of examples a forward pass"),  # int()'s traceback
    (["--batch-size", "0"], "--batch-size 0: give"),  # 0, -2, autox: every request in one batch, recorded as given
    (["--batch-size", "autox"], "--batch-size autox: give"),
    (["--dtype", "foo"], "--dtype foo: give auto, float32, bfloat16 or float16"),  # torch's AttributeError
    (["--device", "bogus"], "--device bogus is not a device"),  # scored on the CPU, recorded as 'bogus'
    (["--device", "cuda"], "--device cuda: this machine has no cuda device"),  # torch's AssertionError
])
def test_an_eval_option_that_cannot_run_is_refused_in_one_paragraph(tiny_assets, option, says):
    if option == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    proc = invoke("eval", str(tiny_assets / "model"), "--tasks", "tiny_reverse", "--include-path", "tasks", *option,
                  check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and says in said and "Traceback" not in said, said


def test_a_hub_task_offline_says_where_to_point_it(tiny_assets, monkeypatch):
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(key, value)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    proc = invoke("eval", str(tiny_assets / "model"), "--tasks", "gsm8k", check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "task 'gsm8k' could not read its data" in said and "--include-path" in said, said
    assert "Traceback" not in said


def test_a_reward_model_or_an_unfinished_run_is_refused(tmp_path, tiny_assets):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 1})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text(recipe.read_text())
    proc = invoke("eval", str(tmp_path / "run"), "--tasks", "tiny_reverse", check=False)
    assert proc.returncode != 0 and "has no final/" in " ".join(proc.stderr.split())
    assert not os.path.exists(tmp_path / "run" / "lm_eval")


def test_a_run_without_final_by_choice_and_a_random_base_are_said_as_they_are(tmp_path, tiny_assets):
    """checkpoint.save_final: false: eval had offered to finish the run with --resume auto, which says it is
    complete; --baseline base of a model.random_init run scored model.name_or_path's trained weights as where the
    run started."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 1}, checkpoint={"every_steps": 1,
                                                                                     "save_final": False})
    run_train(recipe)
    said = " ".join(invoke("eval", str(tmp_path / "run"), "--tasks", "tiny_reverse", check=False).stderr.split())
    assert "finished with checkpoint.save_final: false, so it has no final/: evaluate one of its checkpoints (" in \
        said and "--resume auto" not in said, said
    random = tmp_path / "random"
    random.mkdir()
    run_train(write_recipe(tiny_assets, random, train={"max_steps": 1}, model={
        "name_or_path": str(tiny_assets / "model"), "dtype": "float32", "attn_implementation": "eager",
        "random_init": True}))
    proc = invoke("eval", str(random / "run"), "--tasks", "tiny_reverse", "--include-path", "tasks", "--baseline",
                  "base", check=False)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "started from random weights (model.random_init: true): there is none to " \
        "score" in said, said
    assert not (random / "run" / "lm_eval").exists()


# --------------------------------------------------------------------------- eval: in a recipe


@pytest.mark.slow
@pytest.mark.extended  # main tier: the refusals below, and llmtrain eval's own tests above
def test_a_recipes_eval_scores_final_when_training_ends_as_llmtrain_eval_does(tiny_assets, tmp_path):
    tasks = task_folder(tiny_assets, tmp_path)
    benchmark = {"tasks": ["tiny_reverse"], "include_path": [str(tasks)], "limit": 40, "batch_size": 8}
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}, eval=benchmark,
                          train={"max_steps": 120, "micro_batch_size": 16, "lr": 1e-3, "warmup_steps": 10})
    cli("finetune", str(recipe), env=OFFLINE)
    at_the_end = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse.json").read_text())
    cli("eval", str(tmp_path / "run"), "--tasks", "tiny_reverse", "--include-path", str(tasks), "--limit", "40",
        "--batch-size", "8", env=OFFLINE)
    afterwards = json.loads((tmp_path / "run" / "lm_eval" / "tiny_reverse-2.json").read_text())
    assert at_the_end["results"] == afterwards["results"]
    assert 0 < at_the_end["results"]["tiny_reverse"]["exact_match,none"] < 1


@pytest.mark.parametrize(("change", "says"), [
    # extended (15 s of the harness's task index): main tier, llmtrain eval's unknown task (the same check_tasks)
    pytest.param({"eval": {"tasks": ["tiny_revers"]}}, "unknown task 'tiny_revers'", marks=pytest.mark.extended),
    ({"eval": {"tasks": ["tiny_reverse"]}, "checkpoint": {"save_final": False}}, "checkpoint.save_final is false"),
    ({"eval": {"tasks": ["tiny_reverse"]}, "lora": {"r": 4}, "model": {"random_init": True}}, "randomly initialised"),
])
def test_a_recipes_eval_that_cannot_run_is_refused_before_anything_is_written(tiny_assets, tmp_path, change, says):
    tasks = task_folder(tiny_assets, tmp_path)
    change["eval"]["include_path"] = [str(tasks)]
    recipe = write_recipe(tiny_assets, tmp_path, **change)
    proc = invoke("finetune", str(recipe), check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and says in said and "Traceback" not in said, said
    assert not (tmp_path / "run").exists()


def test_tasks_all_in_the_include_path_skip_the_harness_index(tiny_assets, tmp_path, monkeypatch):
    """The harness's own index (~20 s a process) is built only when a task named may need it: one not in the local
    folders, or a local group (which may name the harness's tasks)."""
    import lm_eval.tasks

    from llmtrain.run import benchmarks

    built, real = [], lm_eval.tasks.TaskManager

    def manager(include_path=None, include_defaults=True, **kw):
        built.append(include_defaults)
        return real(include_path=include_path, include_defaults=include_defaults, **kw) if not include_defaults \
            else "full index"

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)
    tasks = task_folder(tiny_assets, tmp_path)
    local = benchmarks.task_manager([str(tasks)], ["tiny_reverse", "tiny_reverse_ll"])
    assert built == [False] and sorted(local.all_tasks) == ["tiny_reverse", "tiny_reverse_ll"]
    (tasks / "group.yaml").write_text("group: tiny_group\ntask:\n  - tiny_reverse\n  - arc_easy\n")
    for names in (["tiny_reverse", "arc_easy"], ["tiny_group"]):
        built.clear()
        assert benchmarks.task_manager([str(tasks)], names) == "full index" and built == [False, True]
    built.clear()
    assert benchmarks.task_manager([], ["tiny_reverse"]) == "full index" and built == [True]


def test_a_checkpoint_is_handed_over_in_dtype_and_with_the_runs_chat_template(tiny_assets, tmp_path):
    """`llmtrain eval CHECKPOINT`: the model handed to the harness is in --dtype (it had stayed in the run's: bits per
    byte of float32 said for bfloat16, the results' model_args empty) and its tokenizer carries the run's chat
    template, which --apply-chat-template renders (it had the base's: exact match 0.0 where final/ of the same
    weights scored 1.0, audit 5); a dtype that is none is refused."""
    import torch

    from llmtrain.errors import LLMTrainError
    from llmtrain.run.benchmarks import resolve

    template = tmp_path / "mine.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]:{% endif %}")
    recipe = write_recipe(tiny_assets, tmp_path, data={"chat_template": str(template), "max_seq_len": 64},
                          train={"max_steps": 2, "micro_batch_size": 8}, checkpoint={"every_steps": 2})
    run_train(recipe)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    target = resolve(str(checkpoint), dtype="bfloat16")
    assert target.model_args == {"dtype": "bfloat16"}
    model, tokenizer = target.load("cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert tokenizer.chat_template == template.read_text()
    assert {p.dtype for p in resolve(str(checkpoint), dtype="auto").load("cpu")[0].parameters()} == {torch.float32}
    with pytest.raises(LLMTrainError, match="--dtype fp8: give auto"):
        resolve(str(checkpoint), dtype="fp8")
    weights = checkpoint / "model.safetensors"  # one byte flipped: refused as the target is named, before "scoring"
    data = bytearray(weights.read_bytes())  # and the harness (it had been found loading it, in generate's words)
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(LLMTrainError, match=r"step_000002' is damaged \(model.safetensors does not match its check"):
        resolve(str(checkpoint), dtype="auto")


def test_an_unknown_task_names_the_key_that_adds_task_folders_where_it_was_given():
    """A recipe's eval: section had been told to use --include-path, a flag of `llmtrain eval`."""
    from types import SimpleNamespace

    from llmtrain.errors import LLMTrainError
    from llmtrain.run.benchmarks import check_tasks

    manager = SimpleNamespace(all_tasks=["tiny_reverse"])
    for folders in ("--include-path", "eval.include_path"):
        with pytest.raises(LLMTrainError, match=rf"a task on local files is a YAML file in a folder given with "
                                                rf"{folders} \(tasks/tiny_reverse.yaml\)"):
            check_tasks(["nope"], manager, **({} if folders == "--include-path" else {"folders": folders}))


def test_a_hub_model_not_in_the_cache_is_named_as_the_commands_argument(monkeypatch):
    """`llmtrain eval HUB_ID` offline had named the recipe keys model.name_or_path / model.tokenizer: eval has none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = invoke("eval", "someone/not-cached-model", "--tasks", "tiny_reverse", "--include-path", "tasks",
                  check=False)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "the model 'someone/not-cached-model' (the model to score) is not in the local " \
        "Hugging Face cache" in said and "model.name_or_path" not in said, said


def _likelihood_task(tiny: Path, folder: Path) -> Path:
    """The tiny task scored by likelihood with a continuous metric beside acc (perplexity of the reference), so that
    any change in what the model is shown moves the table."""
    out = folder / "ll-tasks"
    out.mkdir(exist_ok=True)
    task = yaml.safe_load((REPO / "tasks" / "tiny_reverse_ll.yaml").read_text())
    task.update(task="tiny_reverse_ppl", metric_list=[{"metric": "acc"}, {"metric": "perplexity"}])
    task["dataset_kwargs"]["data_files"]["test"] = str(tiny / "data" / "eval.jsonl")
    (out / "tiny_reverse_ppl.yaml").write_text(yaml.safe_dump(task))
    return out


def _scores(*args: str) -> list[str]:
    return table_rows(cli("eval", *args, "--tasks", "tiny_reverse_ppl", "--limit", "20", "--batch-size", "8",
                          env=OFFLINE).stdout)


@pytest.mark.slow
def test_final_and_a_checkpoint_of_the_same_weights_render_the_runs_chats_alike(tiny_assets, tmp_path):
    """--apply-chat-template: final/'s tokenizer keeps the template without data.chat_template_kwargs, so final/ had
    been prompted without them (Qwen3's enable_thinking: false) while its checkpoints, built by llmtrain, were
    prompted with them; and neither with data.system_prompt (audit 33: acc 0.060 and 0.040 for the same weights).
    Both now render the run's chats as it trained on them, and the results record how."""
    template = tmp_path / "prefixed.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {% if m['role'] == 'user' and prefix is defined %}"
        "{{ prefix }}{% endif %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]:{% endif %}")
    recipe = write_recipe(tiny_assets, tmp_path, data={"chat_template": str(template), "max_seq_len": 64,
                                                       "chat_template_kwargs": {"prefix": "QQ "},
                                                       "system_prompt": "sys"},
                          train={"max_steps": 4, "micro_batch_size": 8, "lr": 1e-3}, checkpoint={"every_steps": 4})
    run_train(recipe)
    tasks, run = _likelihood_task(tiny_assets, tmp_path), tmp_path / "run"
    final = _scores(str(run), "--include-path", str(tasks), "--apply-chat-template")
    assert final == _scores(str(run / "checkpoints" / "step_000004"), "--include-path", str(tasks),
                            "--apply-chat-template")
    written = json.loads((run / "lm_eval" / "tiny_reverse_ppl.json").read_text())
    assert written["chats"] == {"system_instruction": "sys", "chat_template_args": {"prefix": "QQ "}}
    plain = cli("eval", str(run), "--include-path", str(tasks), "--tasks", "tiny_reverse_ppl", "--limit", "20",
                "--batch-size", "8", env=OFFLINE)
    assert final != table_rows(plain.stdout)  # (the template is what is scored)
    # the harness's own warning of a chat model scored without its template is silenced with its INFO lines: said
    assert "trained on chats rendered through its chat template" in " ".join(plain.stderr.split())


@pytest.mark.slow
def test_a_lora_run_on_a_base_with_spare_vocabulary_rows_is_scored_as_its_checkpoint(tiny_assets, tmp_path):
    """A base with more vocabulary rows than its tokenizer has tokens (Qwen's): the harness's peft path cuts the base
    to the tokenizer before reading the adapter, so a run that saved the head (modules_to_save) ended in a
    size-mismatch traceback, and any other was scored over fewer rows than it trained with (audit 33). Such a run is
    handed over built, and scores what its checkpoint of the same weights scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "padded"
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model")
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + 24)
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(base)
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(base)}, data={"max_seq_len": 64},
                          lora={"r": 8, "alpha": 16, "dropout": 0.0, "modules_to_save": ["lm_head"]},
                          train={"max_steps": 4, "micro_batch_size": 8, "lr": 1e-2}, checkpoint={"every_steps": 4})
    run_train(recipe)
    tasks, run = _likelihood_task(tiny_assets, tmp_path), tmp_path / "run"
    assert _scores(str(run), "--include-path", str(tasks)) == _scores(
        str(run / "checkpoints" / "step_000004"), "--include-path", str(tasks))


def test_a_damaged_weights_file_is_one_paragraph(trained, tmp_path):
    """The harness reads a whole model's weights itself: a truncated file had been safetensors' traceback (audit
    33); generate and a checkpoint's eval said it in a paragraph."""
    import shutil

    run, tasks = trained
    copy = tmp_path / "damaged"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "lm_eval"))
    with open(copy / "final" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    proc = cli("eval", str(copy), "--tasks", "tiny_reverse", "--include-path", str(tasks), "--limit", "4",
               env=OFFLINE, check=False)
    out = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the weights in '{copy / 'final'}' could not be read" in out and "truncated or damaged" in out, out


def test_a_local_task_whose_yaml_does_not_build_is_said_as_such_not_as_the_hub(tiny_assets, tmp_path):
    """A task on local files whose template names no field of the rows: it had been "could not read its data" with
    advice to point a hub task at local files, which it already was (audit 33)."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.run.benchmarks import check_tasks, task_manager

    folder = tmp_path / "tasks"
    folder.mkdir()
    task = yaml.safe_load((REPO / "tasks" / "tiny_reverse_ll.yaml").read_text())
    task.update(task="broken_local", doc_to_text="{{question}}")
    task["dataset_kwargs"]["data_files"]["test"] = str(tiny_assets / "data" / "eval.jsonl")
    (folder / "broken_local.yaml").write_text(yaml.safe_dump(task))
    with pytest.raises(LLMTrainError) as e:
        check_tasks(["broken_local"], task_manager([str(folder)], ["broken_local"]))
    said = " ".join(str(e.value).split())
    assert "could not be built from its YAML" in said and "'question' is undefined" in said, said
    assert "hub" not in said


def test_a_runs_final_folder_is_the_run_as_generate_reads_it(tiny_assets, tmp_path):
    """`llmtrain eval RUN/final` of a LoRA run had been refused ("neither a run folder ... nor a model folder"),
    and a whole model's final/ scored as a bare folder (no results in the run, no --baseline base), where generate
    takes a run's final/ for the run (audit 33)."""
    from llmtrain.run.benchmarks import resolve

    recipe = write_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 1, "micro_batch_size": 4})
    run_train(recipe)
    run = tmp_path / "run"
    assert resolve(str(run / "final"), dtype="auto") == resolve(str(run), dtype="auto")
    assert resolve(str(run / "final"), dtype="auto").run == run


def test_scores_a_run_cannot_keep_are_printed_with_a_note_not_a_traceback(trained, tmp_path):
    """RUN/lm_eval/ that cannot be made (a file there; a run on a read-only disk) had ended in a traceback after all
    the scoring, the printed table the only copy (audit 46): said before the scoring, the scores printed, exit 0."""
    import shutil

    run, tasks = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "lm_eval"))
    (copy / "lm_eval").write_text("mine")
    ours = cli("eval", str(copy), "--tasks", "tiny_reverse_ll", "--include-path", str(tasks), "--limit", "4",
               "--batch-size", "4", env=OFFLINE)
    assert any("tiny_reverse_ll" in row for row in table_rows(ours.stdout))
    note = " ".join(ours.stderr.split())
    assert f"note: the scores cannot be kept in {copy / 'lm_eval'}" in note and "Traceback" not in ours.stderr
    assert note.index("note: the scores cannot be kept") < note.index("scoring ")
    assert (copy / "lm_eval").read_text() == "mine"
