"""The hub asked once per process (llmtrain/hub.py): out of reach, the commands read hub ids from the local cache only
and say so in one line, instead of retrying every file for about 50 s. The hub is never really asked: HF_ENDPOINT
points at a closed local port, which refuses at once."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from helpers import ENV, LLMTRAIN, REPO, open_port

from llmtrain import hub

PROXIES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")  # the probe asks them


def offline_env(tmp_path) -> dict:
    """The environment of a command run where the hub cannot be reached, with an empty cache."""
    env = {**ENV, "HF_ENDPOINT": f"http://127.0.0.1:{open_port()}", "HF_HOME": str(tmp_path / "hf"),
           "COLUMNS": "400"}  # rich's tables on one line a row
    for name in ("HF_HUB_OFFLINE", *PROXIES):
        env.pop(name, None)
    return env


def test_an_unreachable_hub_is_asked_once_quickly_and_turns_offline_mode_on(monkeypatch):
    import huggingface_hub.constants

    port = open_port()
    for name in PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test, as is the constant below
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_answers", {})
    connections = []
    connect = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: connections.append(a) or connect(*a, **k))

    start = time.monotonic()
    status, line = hub.check(["meta-llama/Llama-2-7b-hf", "openai/gsm8k"])
    assert time.monotonic() - start < 1.0
    assert status == "warn" and line.startswith(f"127.0.0.1:{port} cannot be reached (")
    assert "meta-llama/Llama-2-7b-hf, openai/gsm8k read from the local Hugging Face cache only" in line
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert hub.check(["openai/gsm8k"]) is None and hub.fall_back(["openai/gsm8k"]) is None  # offline: no question
    assert hub.unreachable() is not None and len(connections) == 1  # asked once per process


def test_behind_a_proxy_the_proxy_is_asked(monkeypatch):
    """A cluster that reaches the hub through HTTPS_PROXY cannot connect to huggingface.co itself: the probe asks
    the proxy, unless NO_PROXY names the hub."""
    for name in ("HF_ENDPOINT", "no_proxy", "NO_PROXY", *PROXIES):
        monkeypatch.delenv(name, raising=False)
    assert hub.endpoint() == ("huggingface.co", 443)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.endpoint() == ("proxy.example", 3128)
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert hub.endpoint() == ("huggingface.co", 443)


def test_local_paths_and_data_files_are_not_hub_ids(tmp_path):
    (tmp_path / "model").mkdir()
    assert hub.hub_ids(str(tmp_path / "model"), "./m", "data/train.jsonl", None, ["a.jsonl"], "org/model",
                       "org/model", "openai/gsm8k") == ["org/model", "openai/gsm8k"]
    assert hub.check([]) is None  # nothing to read from the hub: nothing asked


@pytest.mark.parametrize("name, local", [("gpt2", False), ("org/model", False), ("runs/sft", True),
                                         ("runs/sft/final", True), ("./model", True), ("~/model", True),
                                         ("train.jsonl", True)])
def test_every_reader_of_a_name_agrees_whether_it_is_a_hub_id(tmp_path, monkeypatch, name, local):
    """Four places decided it and disagreed on a bare name such as gpt2 (issue 53): the hub check, the model's
    load error, the data's missing-path message and the estimate's config reader now ask hub.is_local_path.
    (runs/sft: local because runs/ exists here, before that run is trained.)"""
    from llmtrain.data.sources import _missing_local
    from llmtrain.memory.params import reads_hub
    from llmtrain.model.modeling import _load_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert hub.is_local_path(name) == local
    assert (hub.hub_ids(name) == []) == local
    assert (_missing_local(name) is not None) == local
    assert reads_hub(name) == (not local)
    assert ("does not exist" in str(_load_error("model", name, OSError("404")))) == local


def test_what_is_surely_local_is_said_missing_without_the_hub_and_an_owner_folder_here_is_not(tmp_path, monkeypatch):
    """A folder named like a hub owner beside a `hf download --local-dir` (./mistralai/Mistral-7B-v0.1) must not
    turn mistralai/Other-Model into a missing local path: only a folder that holds runs does (runs/tiny-sfT)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mistralai" / "Mistral-7B-v0.1").mkdir(parents=True)
    (tmp_path / "mistralai" / "Mistral-7B-v0.1" / "config.json").write_text("{}")
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "recipe.yaml").write_text("{}")
    assert hub.is_local_path("mistralai/Other-Model") and not hub.surely_local("mistralai/Other-Model")
    assert hub.surely_local("runs/tiny-sfT") and hub.surely_local("runs/tiny-sfT/final")
    assert hub.surely_local("./model") and hub.surely_local("data.jsonl") and not hub.surely_local("gpt2")
    assert not hub.surely_local("org/model")  # no folder org/ here: a hub id
    # ... and the hub is asked for it (once, briefly, offline mode after): it had been taken for a local path, never
    # asked, and the command retried the network for 75 s before calling it a missing "model folder"
    assert hub.hub_ids("mistralai/Other-Model", "mistralai/Mistral-7B-v0.1", "runs/tiny-sfT") == [
        "mistralai/Other-Model"]


def test_a_local_model_path_that_is_not_there_is_refused_before_transformers_asks_the_hub(tmp_path, monkeypatch):
    """A mistyped runs/tiny-sfT/final was handed to from_pretrained as a hub id: without network, a minute of
    "Retrying" lines (70 s measured) before "does not exist". The tokenizer, the config, the model and a
    distillation teacher now say it at once."""
    import transformers

    from llmtrain.config import ModelConfig, Recipe
    from llmtrain.errors import LLMTrainError
    from llmtrain.model.modeling import load_model, load_model_config, load_tokenizer
    from llmtrain.model.teacher import vocabulary_problem

    def asked(*a, **k):
        raise AssertionError("transformers was asked for a local path that is not there")

    for auto in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", asked)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    cfg = ModelConfig(name_or_path="runs/sft/final")
    for load in (load_tokenizer, load_model_config, lambda c: load_model(c, None)):
        with pytest.raises(LLMTrainError, match=r"the model folder 'runs/sft/final' .* does not exist\. .* It is the "
                                                r"final/ of the run 'runs/sft', which has not been trained here"):
            load(cfg)
    recipe = Recipe.model_validate({"model": {"name_or_path": "gpt2"}, "output_dir": "runs/x",
                                    "data": {"path": "d.jsonl", "format": "prompt_completion"},
                                    "distill": {"teacher": "runs/teacher/final"}})
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: None)  # the student's config
    assert vocabulary_problem(recipe, None) == ("distill.teacher 'runs/teacher/final' does not exist. Give a local "
                                                "model folder (config.json and weights; a run's final/ once it is "
                                                "trained) or a hub id.")


def test_estimate_memory_offline_says_so_once_and_prints_its_table_at_once(tmp_path):
    """Before: 10 'Retrying' lines and 52 s on this recipe (its tokenizer and data are read for the prompts'
    lengths)."""
    proc = subprocess.run([*LLMTRAIN, "estimate-memory", "recipes/llama3-8b-grpo.yaml"], env=offline_env(tmp_path),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Retrying" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "cannot be reached" in line]
    assert len(lines) == 1 and ("meta-llama/Llama-3.1-8B-Instruct, openai/gsm8k read from the local Hugging Face "
                                "cache only") in lines[0], proc.stderr
    assert "total per GPU" in proc.stdout and "recommendation: fits" in proc.stdout
    assert "the prompts could not be read" in proc.stdout  # so each is taken at data.max_seq_len


def test_finetune_of_a_hub_id_offline_ends_at_once_saying_it_is_not_in_the_cache(tmp_path):
    """Before: 10 'Retrying' lines and 51 s before the error."""
    out = tmp_path / "run"
    proc = subprocess.run([*LLMTRAIN, "finetune", "recipes/llama7b-lora.yaml", f"output_dir={out}"],
                          env=offline_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Retrying" not in said and "Traceback" not in said, said
    assert said.count("cannot be reached") == 1
    assert ("the tokenizer 'meta-llama/Llama-2-7b-hf' (model.name_or_path / model.tokenizer) is not in the local "
            "Hugging Face cache") in said and "hf download meta-llama/Llama-2-7b-hf" in said
    assert not out.exists()


@pytest.mark.parametrize("command", [["generate", "mistralai/Mistral-7B-v0.3", "hi"],
                                     ["eval", "mistralai/Mistral-7B-v0.3", "--tasks", "tiny_reverse",
                                      "--include-path", "tasks", "--limit", "1"]])
def test_generate_and_eval_of_a_hub_id_offline_end_at_once(tmp_path, command):
    """generate and eval ask the hub first too, as finetune does (they had each retried the network for about 50 s,
    printing a 'Retrying' line a try): one line says the ids are read from the cache, then the paragraph (eval's had
    been transformers' OSError in the harness, with its traceback)."""
    began = time.monotonic()
    proc = subprocess.run([*LLMTRAIN, *command], env=offline_env(tmp_path), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Retrying" not in said and "Traceback" not in said, said
    lines = [line for line in said.splitlines() if "cannot be reached" in line]
    assert len(lines) == 1 and "mistralai/Mistral-7B-v0.3" in lines[0], said
    assert "is not in the local Hugging Face cache" in said, said
    assert time.monotonic() - began < 40  # (about 50 s of retries before)


def test_a_recipes_eval_tasks_are_asked_for_with_its_hub_ids(tmp_path):
    """A recipe's eval section checks its tasks at start-up, and a built-in task reads its dataset from the hub: the
    one probe covers it, so offline it is read from the cache at once (it had retried for 24 s, in 5 'Retrying'
    lines, before failing)."""
    from llmtrain.config import Recipe

    base = {"model": {"name_or_path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.jsonl"), "format": "text"},
            "output_dir": str(tmp_path / "run")}
    assert hub.recipe_hub_ids(Recipe.model_validate(base)) == []
    with_eval = Recipe.model_validate({**base, "eval": {"tasks": ["gsm8k"]}})
    assert hub.recipe_hub_ids(with_eval) == ["eval.tasks' datasets"]


def test_tasks_on_local_files_read_nothing_from_the_hub(tmp_path):
    """`llmtrain eval --include-path tasks` of the tiny task (data: a JSON file here) had asked the hub for "the tasks'
    datasets" and, out of reach, said they were read from the local cache only: tasks whose YAML names a packaged
    builder (json, csv, ...) on files here, or a folder here, are local; a hub dataset, a file on the hub or the web,
    an include: of another file (its data unread here), or a name no YAML defines is not."""
    from llmtrain.config import Recipe

    tasks = str(REPO / "tasks")
    assert hub.local_tasks([tasks], ["tiny_reverse", "tiny_reverse_ll"])
    for name, body in (("on_hub", "dataset_path: openai/gsm8k\n"),
                       ("hf_file", "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: hf://x/y.jsonl\n"),
                       ("included", "include: other.yaml\ndataset_path: json\ndataset_kwargs:\n  data_files: a.json\n"),
                       ("folder", f"dataset_path: {tmp_path}\nprocess_docs: !function utils.process\n")):
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\n{body}")
    assert [hub.local_tasks([str(tmp_path)], [n]) for n in ("on_hub", "hf_file", "included", "folder")] == \
        [False, False, False, True]
    assert not hub.local_tasks([tasks], ["tiny_reverse", "gsm8k"]) and not hub.local_tasks([], ["tiny_reverse"])
    base = {"model": {"name_or_path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.jsonl"), "format": "text"},
            "output_dir": str(tmp_path / "run")}
    local = Recipe.model_validate({**base, "eval": {"tasks": ["tiny_reverse"], "include_path": [tasks]}})
    assert hub.recipe_hub_ids(local) == []


def test_eval_of_a_local_run_on_local_tasks_says_nothing_of_the_hub(tiny_assets, tmp_path):
    """The whole command, the hub out of reach: no line about it (a finished run's final/ of the tiny model, scored on
    5 examples of the shipped tiny task)."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (run / "final" / name).write_bytes((tiny_assets / "model" / name).read_bytes())
    recipe = (REPO / "recipes" / "tiny.yaml").read_text().replace("assets/tiny", str(tiny_assets))
    (run / "recipe.yaml").write_text(recipe)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "t.yaml").write_text((REPO / "tasks" / "tiny_reverse.yaml").read_text().replace(
        "assets/tiny/data/eval.jsonl", str(tiny_assets / "data" / "eval.jsonl")))
    proc = subprocess.run([*LLMTRAIN, "eval", str(run), "--tasks", "tiny_reverse", "--include-path", str(tasks),
                           "--limit", "5", "--batch-size", "5"], env=offline_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot be reached" not in proc.stderr and "exact_match" in proc.stdout, proc.stderr


def test_a_run_under_runs_is_a_path_before_runs_exists_and_generate_and_eval_say_so(tmp_path, monkeypatch):
    """runs/NAME is a run's folder (every recipe's output_dir), not a hub id, whether runs/ exists yet: in a fresh
    clone `generate runs/tiny` had told the user to `hf download runs/tiny` (and eval named the recipe keys
    model.name_or_path / model.tokenizer, there being no recipe; audit 11). Both say it does not exist and how a run's
    folder is made; owner/name ids stay the hub's."""
    from typer.testing import CliRunner

    from llmtrain.cli import app

    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert hub.is_local_path("runs/tiny") and hub.missing_local("runs/tiny") and hub.hub_ids("runs/tiny") == []
    assert not hub.is_local_path("mistralai/Mistral-7B-v0.1") and hub.hub_ids("gpt2") == ["gpt2"]
    for args in (["generate", "runs/tiny", "reverse abc ="], ["eval", "runs/tiny", "--tasks", "tiny_reverse"]):
        result = CliRunner().invoke(app, args)
        said = " ".join(result.output.split())
        assert result.exit_code == 2, said
        assert "'runs/tiny' does not exist. Give a run's output_dir" in said and "make demo` writes runs/tiny" in said
        assert "hf download" not in said and "model.name_or_path" not in said


def test_generate_and_eval_of_a_run_still_training_say_so_and_not_to_resume_it(tmp_path):
    """A run without final/ whose folder's lock is held is still training: wait, or use a checkpoint (resuming it,
    which they had advised, is refused as in use; audit 11)."""
    import fcntl

    from llmtrain.run.rundir import MARKER, unfinished

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    assert "finish it with `llmtrain finetune" in unfinished(run, "Generate from")
    with open(run / MARKER, "w") as f:
        f.write("llmtrain run\npid: 4242\nhost: here\nstarted: now\ncommand: llmtrain finetune r.yaml\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        said = unfinished(run, "Generate from")
    assert said.startswith(f"'{run}' is still training (pid 4242 on here") and "--resume" not in said
    assert "checkpoints (" in said and "step_000002" in said
