"""`llmtrain inspect-data`, run through the real CLI: the JSON rows are exactly what training reads, the
report shows the statistics of train and eval and the examples with their trained tokens, and a bad
override is a clean user error.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import GSM8K, MISTRAL, REPO, needs
from helpers import cli, write_recipe
from typer.testing import CliRunner

from llmtrain.cli import app
from llmtrain.config import DataConfig, load_recipe
from llmtrain.data.formats import IGNORE, encode_example
from llmtrain.data.prepare import prepare_datasets
from llmtrain.inspect_data import _highlight, token_pieces


def invoke(*args: str):
    """In-process CLI run; a wide terminal so that rich does not wrap the table."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "240"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def read_jsonl(path, n: int | None = None) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def test_json_is_the_training_rows_and_nothing_else(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    recipe = write_recipe(tiny_assets, tmp_path, data={"cache_dir": str(tmp_path / "cache")})
    proc = cli("inspect-data", str(recipe), "--json", "--n", "3")  # a real process: all of its stdout
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 3 and proc.stdout.endswith("}\n")
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    cfg = load_recipe(recipe).data
    for row, ex in zip(rows, read_jsonl(tiny_assets / "data" / "train.jsonl", 3)):
        enc = encode_example(ex, tok, cfg)
        assert row == {"input_ids": enc["input_ids"], "labels": enc["labels"]}
        assert IGNORE in row["labels"] and row["labels"][-1] == tok.eos_token_id


@needs(MISTRAL)
@needs(GSM8K)
def test_json_on_gsm8k_messages_with_the_mistral_template(tmp_path):
    from transformers import AutoTokenizer

    examples = [{"messages": [{"role": "user", "content": ex["question"]},
                              {"role": "assistant", "content": ex["answer"]}]}
                for ex in read_jsonl(GSM8K / "train.jsonl", 5)]
    data = tmp_path / "gsm8k_messages.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    recipe = tmp_path / "mistral.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(MISTRAL)},
        "data": {"path": str(data), "format": "messages", "max_seq_len": 1024, "cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "run"),
    }))
    result = invoke("inspect-data", str(recipe), "--json", "--n", "3")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3
    tok = AutoTokenizer.from_pretrained(MISTRAL)
    cfg = load_recipe(recipe).data
    for row, ex in zip(rows, examples):
        enc = encode_example(ex, tok, cfg)
        assert row == {"input_ids": enc["input_ids"], "labels": enc["labels"]}
        trained = [i for i, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE]
        assert tok.decode(trained) == ex["messages"][1]["content"] + "</s>"


def test_report_shows_examples_and_the_statistics(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 20, "eval_split": 0.1,
                                                       "cache_dir": str(tmp_path / "cache")})
    result = invoke("inspect-data", str(recipe), "--n", "2")
    assert result.exit_code == 0, result.output
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    train, _, stats, hit = prepare_datasets(load_recipe(recipe).data, tok, seed=7)
    assert hit  # the command prepared the data exactly as training would, into the same cache
    # the table: one row a statistic, one column a split
    table = {cells[0]: cells[1:] for line in result.stdout.splitlines()
             if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == 3}
    assert table[""] == ["train", "eval"]
    s, e = stats["train"], stats["eval"]
    assert s.truncated > 0 and e.examples > 0  # max_seq_len 20 cuts the longer reversals
    assert table["examples"] == [f"{s.examples:,}", f"{e.examples:,}"]
    assert table["truncated"] == [f"{s.truncated:,}", f"{e.truncated:,}"]
    assert table["dropped"] == [f"{s.dropped:,}", f"{e.dropped:,}"]
    assert table["trained-token fraction"] == [f"{s.trained_fraction:.1%}", f"{e.trained_fraction:.1%}"]
    assert table["length p50 / p90 / p99 / max"][0] == f"{s.length_p50} / {s.length_p90} / {s.length_p99} / 20"
    # the first two training rows, each decoded in full under a title with its counts; the output is not a
    # terminal, so the trained tokens (the reversal, then EOS unless truncated away) stand between marks
    for i in range(2):
        ids, labels = train[i]["input_ids"], train[i]["labels"]
        trained = sum(lab != IGNORE for lab in labels[1:])
        first = next(k for k, lab in enumerate(labels) if lab != IGNORE)
        assert labels[first:] == ids[first:]
        assert f"example {i + 1}: {len(ids)} tokens, {trained} trained («between marks»)" in result.stdout
        assert tok.decode(ids[:first]) + "«" + tok.decode(ids[first:]) + "»" in result.stdout
    assert "example 3:" not in result.stdout and "example 0:" not in result.stdout  # 1-based, as errors count


def test_a_reward_models_pairs_show_the_token_each_sequence_is_scored_at(tiny_assets, tmp_path):
    """A reward model reads prompt and answer together and scores each at its last token: the report had shown the
    answers as trained tokens and a 29.6% trained-token fraction, where its own metrics count one token a sequence."""
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    recipe = write_recipe(tiny_assets, tmp_path, data=data, reward_model={})
    result = invoke("inspect-data", str(recipe), "--n", "1")
    assert result.exit_code == 0, result.output
    said = result.stdout
    assert "chosen (scored at its last token):" in said and "rejected (scored at its last token):" in said
    assert "trained tokens" not in said and "trained-token fraction" not in said
    assert "1 a sequence (its last)" in said
    assert "«</s>»" in said  # the last token alone is marked (CliRunner's output has no colour)


def test_with_eos_as_the_pad_the_token_before_the_final_eos_is_marked_as_scored(tiny_assets, tmp_path):
    """A tokenizer without a pad token (Llama 3's, Mistral's): training pads with EOS and scores the token before the
    final EOS (transformers' rule, TRL's); the report had marked the EOS (audit 29)."""
    import json
    import shutil

    model = tmp_path / "nopad"
    shutil.copytree(tiny_assets / "model", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    recipe = write_recipe(tiny_assets, tmp_path, data=data, reward_model={}, model={"name_or_path": str(model)})
    result = invoke("inspect-data", str(recipe), "--n", "1")
    assert result.exit_code == 0, result.output
    said = result.stdout
    assert "chosen (scored at its last token before the final EOS, which is the pad token):" in said
    assert "«</s>»" not in said and "»</s>" in said


def test_a_pairs_answers_are_marked_from_their_first_trained_token(tiny_assets, tmp_path):
    """Each answer is shown from its first trained token, which had been taken for a sequence's first (never
    trained) and left outside the marks: `Paris«</s>»`, the count saying 2 trained tokens."""
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    result = invoke("inspect-data", str(write_recipe(tiny_assets, tmp_path, data=data, preference={})), "--n", "2")
    assert result.exit_code == 0, result.output
    answers = [line for line in result.stdout.splitlines() if "trained tokens): " in line]
    assert len(answers) == 4
    for line in answers:
        shown = line.split("trained tokens): ", 1)[1].rstrip(" │")
        assert shown.startswith("«") and shown.endswith("»") and shown.count("«") == 1, line


def test_the_first_token_is_never_marked_trained(monkeypatch):
    """data.train_on_prompt labels every token, BOS too; nothing predicts the first one, and the count left it out
    while the highlight marked it (19 tokens, 18 trained, 19 marked)."""
    import llmtrain.inspect_data as inspect_data

    monkeypatch.setattr(inspect_data, "token_pieces", lambda ids, tokenizer: [f"t{i}" for i in ids])
    assert _highlight([1, 5, 6], [1, 5, 6], None, marks=True).plain == "t1«t5t6»"
    assert _highlight([1, 5, 6], [IGNORE, IGNORE, 6], None, marks=True).plain == "t1t5«t6»"


@needs(MISTRAL)
@needs(GSM8K)
def test_trained_tokens_are_highlighted_and_pieces_keep_their_spaces():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MISTRAL)
    ex = read_jsonl(GSM8K / "train.jsonl", 1)[0]
    msgs = [{"role": "user", "content": ex["question"] + " 😀 é日本"}, {"role": "assistant", "content": ex["answer"]}]
    enc = encode_example({"messages": msgs}, tok, DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096))
    text = _highlight(enc["input_ids"], enc["labels"], tok)
    assert text.plain == tok.decode(enc["input_ids"])  # words keep their spaces, multi-byte characters whole
    green = "".join(text.plain[s.start:s.end] for s in text.spans if s.style == "bold green")
    assert green.strip() == ex["answer"] + "</s>"
    assert all(s.style == "dim" for s in text.spans if "[INST]" in text.plain[s.start:s.end])
    assert len(token_pieces(enc["input_ids"], tok)) == len(enc["input_ids"])


@pytest.mark.parametrize("override, hint", [("data.max_len=3", "did you mean data.max_seq_len"),
                                            ("train.learning_rate=1e-4", "did you mean train.lr")])
def test_bad_override_is_a_clean_error(tiny_assets, tmp_path, override, hint):
    recipe = write_recipe(tiny_assets, tmp_path)
    result = invoke("inspect-data", str(recipe), override)
    assert result.exit_code == 2
    assert hint in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""


@needs(MISTRAL)
@needs(GSM8K)
def test_without_colour_marks_show_the_trained_answer_from_the_token_after_inst():
    """GSM8K on the Mistral recipes' data settings: the answer, its leading space (a token of its own before a
    digit) and </s> are trained, and stand between « » when the output has no colour."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MISTRAL)
    cfg = load_recipe(REPO / "recipes" / "mistral7b-lora.yaml").data
    rows = read_jsonl(GSM8K / "train.jsonl", 60)
    for ex in (rows[0], rows[59]):  # "Natalia sold ...", "15 coins collected ..."
        enc = encode_example(ex, tok, cfg)
        text = _highlight(enc["input_ids"], enc["labels"], tok, marks=True)
        assert text.plain == f"<s>[INST] {ex['question']}[/INST]« {ex['answer']}</s>»"
        assert _highlight(enc["input_ids"], enc["labels"], tok).plain == tok.decode(enc["input_ids"])
    k = next(i for i, lab in enumerate(enc["labels"]) if lab != IGNORE)  # row 59: the answer starts with a digit
    assert tok.convert_ids_to_tokens(enc["input_ids"][k - 1:k + 2]) == ["[/INST]", "▁", "1"]


def test_a_template_files_rows_are_tokenised_once_for_inspect_data_doctor_and_finetune(tiny_assets, tmp_path):
    """data.chat_template naming a file: finetune gives the tokenizer the file's template, and the cache entry's key
    holds the tokenizer's template; inspect-data (and doctor) prepared the same rows with the model's own template
    set, under another key: a large dataset was tokenised twice (audit 39). One entry now, which finetune reads."""
    from helpers import run_train

    from llmtrain.doctor import run_doctor

    cache = tmp_path / "cache"
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 1},
                          data={"path": str(tiny_assets / "data" / "train_messages.jsonl"), "format": "messages",
                                "chat_template": str(tiny_assets / "data" / "tools.jinja"), "eval_split": None,
                                "cache_dir": str(cache)})
    assert invoke("inspect-data", str(recipe), "--n", "1").exit_code == 0
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 1
    checks = run_doctor(load_recipe(recipe, [f"output_dir={tmp_path / 'run'}"]), gpu_memory=80)
    assert [c for c in checks if c[1] == "fail"] == [] and sorted(p.name for p in cache.iterdir()) == entries
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert "read from the tokenised cache" in (tmp_path / "run" / "train.log").read_text()


def test_json_says_what_the_panels_say_a_reward_models_scored_token_and_an_rl_prompts_reward_columns(tiny_assets,
                                                                                                     tmp_path):
    """--json had written a reward model's answers as trained labels (training reads no label: it scores one token)
    and left out an RL prompt's columns for the rewards, which the panels show (audit 39)."""
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    recipe = write_recipe(tiny_assets, tmp_path, name="rm.yaml", data=data, reward_model={})
    result = invoke("inspect-data", str(recipe), "--json", "--n", "2")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 and all(set(r) == {"chosen_ids", "chosen_scored_at", "rejected_ids", "rejected_scored_at"}
                                  for r in rows)
    # the tiny tokenizer pads with its own pad token: each answer is scored at its last token, its EOS
    assert all(r[f"{a}_scored_at"] == len(r[f"{a}_ids"]) - 1 for r in rows for a in ("chosen", "rejected"))
    data = {"path": str(tiny_assets / "data" / "train.jsonl"), "format": "prompt", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    recipe = write_recipe(tiny_assets, tmp_path, name="rl.yaml", data=data,
                          rl={"num_generations": 2, "rewards": [{"type": "answer_match", "column": "completion"}]})
    result = invoke("inspect-data", str(recipe), "--json", "--n", "3")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["completion"] for r in rows] == [e["completion"] for e in read_jsonl(tiny_assets / "data" /
                                                                                     "train.jsonl", 3)]
