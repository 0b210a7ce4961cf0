"""Weighted mixtures of datasets (data.sources): which source each example comes from, by the seed and its place in
the run alone; measured in what the trainer's data plan hands to its steps, in real runs (a crash resumed, 2
processes against 1), and refused in one paragraph where a mixture cannot train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, invoke, launch_finetune, records, run_train, write_recipe

from llmtrain.config import load_recipe
from llmtrain.data.mixture import Mixture, shares

pytestmark = pytest.mark.long(90)  # tests/conftest.py


# --------------------------------------------------------------------------- the order, as a pure function


def test_quotas_split_the_epoch_by_largest_remainder():
    assert shares([0.7, 0.3], 5035) == (3525, 1510)  # 3524.5 and 1510.5: the tie to the first source
    assert shares([1, 1, 1], 10) == (4, 3, 3)
    assert sum(shares([0.2, 0.5, 0.3], 997)) == 997
    assert Mixture.of([type("S", (), {"count": 50, "weight": None})(),
                       type("S", (), {"count": 20, "weight": None})()], [10, 1000]).quotas == (50, 20)


def test_every_run_of_examples_holds_each_sources_share_to_one_example():
    """0.7 / 0.3 over sources of 100 and 900 rows: every prefix of the epoch's order has each source's share of it to
    within one example (so every step of any micro-batch size does); source 0's 100 rows are each read 7 times an
    epoch, in a new shuffle each time round; source 1's 900 give 300, none twice."""
    mix = Mixture((100, 900), shares([0.7, 0.3], 1000))
    order = mix.order(seed=3, epoch=0)
    assert len(order) == 1000 == mix.examples
    seen = [0, 0]
    for k, i in enumerate(order, 1):
        seen[i >= 100] += 1
        assert abs(seen[0] - 0.7 * k) <= 1 and abs(seen[1] - 0.3 * k) <= 1
    first = [i for i in order if i < 100]
    assert all(sorted(first[t * 100:(t + 1) * 100]) == list(range(100)) for t in range(7))  # each round: every row
    assert first[:100] != first[100:200]  # reshuffled
    second = [i for i in order if i >= 100]
    assert len(set(second)) == 300
    # the next epoch goes on where this one stopped: source 1's next 300 rows, not the same ones
    assert not set(second) & {i for i in mix.order(seed=3, epoch=1) if i >= 100}
    assert mix.order(seed=3, epoch=0) == order and mix.order(seed=4, epoch=0) != order


# --------------------------------------------------------------------------- in the trainer


def mixture_recipe(tiny: Path, folder: Path, *, weights=(0.7, 0.3), **sections) -> Path:
    """The tiny task as a mixture: its prompt/completion file and its chat (messages) file, 300 rows of it."""
    messages = folder / "messages.jsonl"
    if not messages.exists():
        lines = (tiny / "data" / "train_messages.jsonl").read_text().splitlines()[:300]
        messages.write_text("\n".join(lines) + "\n")
    data = {"sources": [{"path": str(tiny / "data" / "train.jsonl"), "format": "prompt_completion",
                         "weight": weights[0]},
                        {"path": str(messages), "format": "messages", "weight": weights[1]}],
            "max_seq_len": 32, "cache_dir": str(tiny.parent / "data-cache")}
    recipe = write_recipe(tiny, folder, **sections)
    text = recipe.read_text()
    import yaml

    values = yaml.safe_load(text)
    values["data"] = {**data, **sections.get("data", {})}
    recipe.write_text(yaml.safe_dump(values, sort_keys=False))
    return recipe


def planned_sources(recipe_path: Path, *, steps: int, world: int, micro: int) -> list[list[int]]:
    """The sources of every example the trainer's data plan gives each of `steps` steps (all ranks together)."""
    from llmtrain.config import load_recipe
    from llmtrain.data.checks import data_plan
    from llmtrain.data.prepare import prepare_datasets
    from llmtrain.model.modeling import load_tokenizer

    recipe = load_recipe(recipe_path, [f"train.micro_batch_size={micro}"])
    train = prepare_datasets(recipe.data, load_tokenizer(recipe.model), seed=recipe.train.seed)[0]
    source = train["source"]
    plan = data_plan(recipe, train["length"], world=world, sources=source)
    return [sorted(source[i] for rank in batch for i in rank) for batch in plan.global_batches_in(steps, 1)]


def test_the_trained_examples_have_each_sources_weight(tiny_assets, tmp_path):
    """100 steps of 16 examples: the prompt/completion source is 70% of them and the chat source 30%, each within 2
    points (to one example of a step, by construction); the same on 2 data-parallel ranks of 8, step by step."""
    recipe = mixture_recipe(tiny_assets, tmp_path)
    one = planned_sources(recipe, steps=100, world=1, micro=16)
    share = sum(s.count(1) for s in one) / sum(map(len, one))
    assert abs(share - 0.3) <= 0.02, share
    assert all(abs(s.count(1) - 0.3 * 16) <= 1 for s in one)
    assert planned_sources(recipe, steps=100, world=2, micro=8) == one


@pytest.mark.slow
def test_kill_9_and_resume_end_as_the_uninterrupted_run(tiny_assets, tmp_path):
    """The run killed with SIGKILL after its step-3 checkpoint (no chance to save), resumed from its saved recipe.yaml
    with --resume auto: the same losses at every step and the same final weights, bit for bit, as the run that was
    never stopped (that one and the resume in this process, as `llmtrain finetune` runs them: one subprocess less
    each)."""
    import os
    import signal
    import subprocess
    import time

    from helpers import ENV, LLMTRAIN, load_weights, max_abs_diff

    recipe = mixture_recipe(tiny_assets, tmp_path, train={"max_steps": 12, "micro_batch_size": 8},
                            checkpoint={"every_steps": 3})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*LLMTRAIN, "finetune", str(recipe), f"output_dir={cut}"], env=ENV, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    end = time.monotonic() + 180
    while not list((cut / "checkpoints").glob("step_*")) or not (cut / "metrics.jsonl").is_file() \
            or len(records(cut)) < 4:
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (cut / "final").exists() and len(records(cut)) < 12
    run_train(cut / "recipe.yaml", resume="auto")
    straight, resumed = records(tmp_path / "straight"), records(cut)
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight]
    assert max_abs_diff(load_weights(cut / "final"), load_weights(tmp_path / "straight" / "final")) == 0


@pytest.mark.slow
@pytest.mark.extended  # main tier: test_the_trained_examples_have_each_sources_weight's 2 ranks = 1 (the plan)
def test_two_processes_train_as_one(tiny_assets, tmp_path, free_port):
    recipe = mixture_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "micro_batch_size": 4,
                                                          "grad_accum_steps": 1})
    run_train(recipe, "train.micro_batch_size=8", f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(REPO / "accelerate_configs" / "cpu_ddp.yaml", 2, free_port, recipe,
                          f"output_dir={tmp_path / 'two'}")
    assert "data source:" in out and "70.0% of each step" in out
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-5)


def test_each_sources_eval_is_reported_and_the_whole_is_their_sum(tiny_assets, tmp_path):
    """With data.eval_split a fraction of every source: eval_loss[FILE] and the rest for each source, and the eval
    line over all of them is the token-weighted mean of the sources' (their sums added, as one pass over all)."""
    from llmtrain.config import load_recipe
    from llmtrain.data.formats import IGNORE
    from llmtrain.data.prepare import prepare_datasets
    from llmtrain.model.modeling import load_tokenizer

    recipe = mixture_recipe(tiny_assets, tmp_path, data={"eval_split": 0.05},
                            train={"max_steps": 2, "eval_every_steps": 2})
    run_train(recipe)
    ev = records(tmp_path / "run", "eval")[-1]
    loaded = load_recipe(recipe, [])
    evald = prepare_datasets(loaded.data, load_tokenizer(loaded.model), seed=loaded.train.seed)[1]
    tokens = {name: sum(sum(x != IGNORE for x in row["labels"][1:]) for row in evald if row["source"] == i)
              for i, name in enumerate(["train.jsonl", "messages.jsonl"])}
    assert tokens["train.jsonl"] > 0 and tokens["messages.jsonl"] > 0
    for key in ("eval_loss", "eval_token_accuracy"):
        mean = sum(ev[f"{key}[{n}]"] * t for n, t in tokens.items()) / sum(tokens.values())
        assert ev[key] == pytest.approx(mean, abs=1e-6)
    assert ev["eval_loss[train.jsonl]"] != ev["eval_loss[messages.jsonl]"]


# --------------------------------------------------------------------------- refused in one paragraph


@pytest.mark.parametrize(("change", "says"), [
    ({"weight": -0.5}, "data.sources.1.weight"),
    ({"weight": 0.3, "count": 10}, "either a weight"),
    ({"weight": None, "count": 10}, "mixes weights and counts"),
    ({"format": "prompt"}, "cannot train with it"),
    ({"format": "preference"}, "cannot train with it"),
])
def test_a_mixture_that_cannot_train_is_refused_before_anything_is_written(tiny_assets, tmp_path, change, says):
    recipe = mixture_recipe(tiny_assets, tmp_path)
    import yaml

    values = yaml.safe_load(recipe.read_text())
    source = {k: v for k, v in {**values["data"]["sources"][1], **change}.items() if v is not None}
    values["data"]["sources"][1] = source
    recipe.write_text(yaml.safe_dump(values, sort_keys=False))
    proc = invoke("finetune", str(recipe), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert says in " ".join((proc.stdout + proc.stderr).split()), proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


def test_data_path_beside_sources_is_refused(tiny_assets, tmp_path):
    recipe = mixture_recipe(tiny_assets, tmp_path)
    proc = invoke("finetune", str(recipe), f"data.path={tiny_assets / 'data' / 'train.jsonl'}", check=False)
    assert proc.returncode != 0 and "remove data.path and set it on its source" in " ".join(proc.stderr.split())


def test_inspect_data_shows_each_source_and_the_order_training_reads(tiny_assets, tmp_path):
    recipe = mixture_recipe(tiny_assets, tmp_path)
    proc = invoke("inspect-data", str(recipe), "--n", "10", "--json")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["source"] for r in rows].count(1) == 3 and len(rows) == 10  # 30% of the first ten
    proc = invoke("inspect-data", str(recipe), "--n", "2")
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "messages.jsonl (messages): 300 rows" in text and "30.0% of each step" in text


def test_under_a_token_budget_inspect_data_shows_the_examples_the_steps_read(tiny_assets, tmp_path):
    """train.micro_batch_tokens packs the epoch's examples into bins, whose order is not the mixture's: inspect-data
    had shown the mixture's (none of its first 30 among the 25 three steps trained; audit 41). It shows the run's
    data plan's: the examples of the first micro-batches, in order."""
    from llmtrain.data.chat import data_tokenizer
    from llmtrain.data.checks import data_plan
    from llmtrain.data.prepare import prepare_recipe
    from llmtrain.model.modeling import load_tokenizer

    (tmp_path / "budget").mkdir()
    recipe = mixture_recipe(tiny_assets, tmp_path / "budget", train={"micro_batch_size": 1, "micro_batch_tokens": 96})
    proc = invoke("inspect-data", str(recipe), "--n", "8", "--json")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    loaded = load_recipe(recipe)
    train = prepare_recipe(loaded, data_tokenizer(load_tokenizer(loaded.model), loaded.data))[0]
    plan = data_plan(loaded, train["length"], world=1, sources=train["source"])
    first = [i for batch in plan.global_batches_in(8, 1) for rank in batch for i in rank][:8]
    assert len(rows) == 8 and [r["input_ids"] for r in rows] == [train[i]["input_ids"] for i in first]


def test_the_memorisation_warning_counts_each_sources_reads_of_its_rows(tmp_path):
    """The warning had counted every row of a mixture once an epoch: counts 14 + 6 over 270 + 90 rows in 300 steps
    of 8 said "100 passes over the 360 train examples" where the rows are read 6 to 8 times; a one-row source
    weighted 0.9 read 287 times in 40 steps had no warning."""
    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_epochs

    def recipe(sources, steps):
        path = tmp_path / "mix.yaml"
        path.write_text(f"model: {{name_or_path: m}}\ndata: {{sources: {sources}}}\n"
                        f"train: {{max_steps: {steps}, micro_batch_size: 8}}\n")
        return load_recipe(path)

    counts = recipe("[{path: a.jsonl, format: prompt_completion, count: 14}, "
                    "{path: b.jsonl, format: prompt_completion, count: 6}]", 300)
    assert check_epochs(counts, steps_per_epoch=3, examples=360, sources=[0] * 270 + [1] * 90) == []
    one = recipe("[{path: a.jsonl, format: prompt_completion, weight: 0.1}, "
                 "{path: one.jsonl, format: prompt_completion, weight: 0.9}]", 40)
    [(name, verdict, said)] = check_epochs(one, steps_per_epoch=34, examples=271, sources=[0] * 270 + [1])
    assert verdict == "warn" and said.startswith("train.max_steps=40 reads each row of one.jsonl about 287 times"), said


def test_a_sources_data_problem_names_the_source(tiny_assets, tmp_path):
    """A mixture source's empty file or a fraction that leaves it no row had been said of data.path."""
    import json

    from llmtrain.config import DataConfig
    from llmtrain.data.prepare import prepare_datasets
    from llmtrain.errors import LLMTrainError
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "reverse ab =", "completion": " ba"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    train = str(tiny_assets / "data" / "train.jsonl")
    for second, says in ((empty, "(data.sources[1].path) holds no rows"),
                         (one, "holds out 1 of the 1 rows of data.sources[1].path, leaving none to train on. Set "
                               "data.sources[1].eval_split to a smaller fraction (e.g. 0.05) or give eval file(s), or "
                               "add rows.")):
        cfg = DataConfig(sources=[{"path": train, "format": "prompt_completion", "weight": 0.5},
                                  {"path": str(second), "format": "prompt_completion", "weight": 0.5}],
                         eval_split=0.1, max_seq_len=64, cache_dir=str(tmp_path / "cache"))
        with pytest.raises(LLMTrainError) as err:
            prepare_datasets(cfg, tok, seed=0)
        assert says in str(err.value), str(err.value)


def test_a_chat_source_after_a_plain_one_makes_the_mixture_a_chat_run(tiny_assets, tmp_path):
    """A mixture's data.format is its first source's: with the prompt/completion file first and the chat file second,
    doctor called the chat template "not used" (unchecked, though 30% of every step renders through it) and generate
    rendered prompts as plain text; the sources in the other order, chats (audit 41). Any source's chats count."""
    from llmtrain.data.checks import check_chat_template, needs_chat
    from llmtrain.model.modeling import load_tokenizer
    from llmtrain.run.replies import trained_on_chats

    recipe = load_recipe(mixture_recipe(tiny_assets, tmp_path))
    assert [s.format for s in recipe.data.sources] == ["prompt_completion", "messages"]
    assert needs_chat(recipe) and trained_on_chats(recipe.data)
    (row,) = check_chat_template(recipe, load_tokenizer(recipe.model))
    assert row[1] == "pass" and row[2].startswith("renders"), row
    plain = load_recipe(write_recipe(tiny_assets, tmp_path))  # the plain file alone: no template
    assert not needs_chat(plain) and not trained_on_chats(plain.data)


def test_a_mixtures_dropped_rows_are_named_with_their_file(tiny_assets, tmp_path):
    """Rows dropped in two sources (no trained token within data.max_seq_len) had been reported as the first
    source's row numbers alone, without a file: '3 of 40 examples dropped ... (rows 3, 4)' (audit 41). Each row is
    named with its file, every source with drops among them."""
    import yaml

    from llmtrain.data.chat import data_tokenizer
    from llmtrain.data.prepare import prepare_recipe
    from llmtrain.model.modeling import load_tokenizer

    long = " ".join(["word"] * 60)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": long if i in (2, 3) else f"reverse ab{i}", "completion": "x"}) + "\n"
                         for i in range(20)))
    b.write_text("".join(json.dumps({"messages": [{"role": "user", "content": long if i == 1 else f"hi {i}"},
                                                  {"role": "assistant", "content": "ok"}]}) + "\n" for i in range(20)))
    values = yaml.safe_load(write_recipe(tiny_assets, tmp_path).read_text())
    values["data"] = {"sources": [{"path": str(a), "format": "prompt_completion", "weight": 0.5},
                                  {"path": str(b), "format": "messages", "weight": 0.5}],
                      "max_seq_len": 32, "cache_dir": str(tmp_path / "cache"), "eval_split": None}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(values))
    recipe = load_recipe(tmp_path / "mix.yaml")
    said = prepare_recipe(recipe, data_tokenizer(load_tokenizer(recipe.model), recipe.data))[2]["train"].dropped_text()
    assert said.startswith("3 of 40 examples dropped") and said.endswith("(rows a.jsonl:3, b.jsonl:2, a.jsonl:4)")
