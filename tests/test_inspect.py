"""`llmtrain inspect-data`: the JSON rows are exactly what training reads; the report shows the statistics."""

from __future__ import annotations

import json

from helpers import cli, write_recipe

from llmtrain.config import load_recipe
from llmtrain.data import encode_example


def test_json_rows_equal_training_rows(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    recipe = write_recipe(tiny_assets, tmp_path)
    proc = cli("inspect-data", str(recipe), "--json", "--n", "3")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 3 and all(set(r) == {"input_ids", "labels"} for r in rows)
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    cfg = load_recipe(recipe).data
    raw = [json.loads(line) for line in (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:3]]
    for row, ex in zip(rows, raw):
        enc = encode_example(ex, tok, cfg)
        assert row == {"input_ids": enc["input_ids"], "labels": enc["labels"]}
        assert -100 in row["labels"] and row["labels"][-1] == tok.eos_token_id


def test_report_and_errors(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 20})
    proc = cli("inspect-data", str(recipe), "--n", "1")
    from transformers import AutoTokenizer

    from llmtrain.data import prepare_datasets

    _, _, stats, _ = prepare_datasets(load_recipe(recipe).data, AutoTokenizer.from_pretrained(tiny_assets / "model"),
                                      seed=7)
    s = stats["train"]
    assert s.truncated > 0  # max_seq_len 20 cuts the longer reversals
    table = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in proc.stdout.splitlines()
             if line.count("│") >= 3}
    assert table["examples"] == f"{s.examples:,}" and table["truncated"] == f"{s.truncated:,}"
    assert table["dropped (no trained token)"] == f"{s.dropped:,}"
    assert table["trained-token fraction"] == f"{s.trained_fraction:.1%}"
    bad = cli("inspect-data", str(recipe), "data.max_len=3", check=False)
    assert bad.returncode == 2 and "did you mean data.max_seq_len" in bad.stderr and "Traceback" not in bad.stderr
