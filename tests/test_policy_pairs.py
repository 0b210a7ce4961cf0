"""examples/policy_pairs.py: preference pairs from a policy's own samples (the labelling stage of RLHF), the data of
recipes/tiny-reward-policy.yaml."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "policy_pairs.py"
sys.path.insert(0, str(SCRIPT.parent))
from policy_pairs import label, pairs_from_samples  # noqa: E402


def test_each_distinct_wrong_sample_is_rejected_beside_the_answer():
    rows = [{"prompt": "reverse abc =", "completion": " cba"}, {"prompt": "reverse xy =", "completion": " yx"}]
    samples = [[" cba", "cba ", " cab", " cab", " ccc", "  ", ""], [" yx", " yx"]]
    pairs = pairs_from_samples(rows, samples, label(rows, samples), seed=0)
    # Right answers (after stripping), repeats and empty replies make no pair; a prompt sampled right every time none.
    assert sorted(p["rejected"] for p in pairs) == [" cab", " ccc"]
    assert all(p == {"prompt": "reverse abc =", "chosen": " cba", "rejected": p["rejected"]} for p in pairs)
    assert pairs_from_samples(rows, samples, label(rows, samples), seed=0) == pairs


def test_the_pairs_are_shuffled_across_prompts_by_the_seed():
    rows = [{"prompt": f"reverse {c}q =", "completion": f" q{c}"} for c in "abcdefgh"]
    samples = [[f" {c}{c}", f" q{c}q"] for c in "abcdefgh"]
    right = label(rows, samples)
    orders = {tuple(p["rejected"] for p in pairs_from_samples(rows, samples, right, seed=s)) for s in range(3)}
    assert len(orders) == 3 and all(len(o) == 16 for o in orders)
    assert sorted(next(iter(orders))) == sorted(s for group in samples for s in group)


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_script_samples_the_policy_labels_and_writes_pairs_once(tiny_assets, tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = [json.loads(line) for line in (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:6]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, again = tmp_path / "pairs" / "a.jsonl", tmp_path / "pairs" / "b.jsonl"
    done = run_script(tiny_assets / "model", data, out, "--samples", "4", "--temperature", "1.0")
    assert done.returncode == 0, done.stderr
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    answers = {r["prompt"]: r["completion"] for r in rows}
    # The random-init model gets nothing right: up to 4 distinct wrong samples of each of the 6 prompts.
    assert 6 <= len(pairs) <= 24 and {p["prompt"] for p in pairs} == set(answers)
    assert all(p["chosen"] == answers[p["prompt"]] != p["rejected"].strip() for p in pairs)
    assert f"{len(pairs)} pairs" in done.stdout
    # The same seed samples the same replies.
    assert run_script(tiny_assets / "model", data, again, "--samples", "4", "--temperature", "1.0").returncode == 0
    assert again.read_text() == out.read_text()
    # An existing file is never overwritten.
    refused = run_script(tiny_assets / "model", data, out, "--samples", "2")
    assert refused.returncode != 0 and "exists" in refused.stderr and "Traceback" not in refused.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == pairs


def test_a_row_without_its_answer_is_refused_naming_the_line(tiny_assets, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "reverse ab =", "completion": " ba"}\n{"prompt": "reverse cd ="}\n')
    refused = run_script(tiny_assets / "model", data, tmp_path / "out.jsonl")
    assert refused.returncode != 0 and "line 2" in refused.stderr and "completion" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out.jsonl").exists()


def test_the_refusal_counts_blank_lines_as_the_file_does(tiny_assets, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "reverse ab =", "completion": " ba"}\n\n{"prompt": "reverse cd ="}\n')
    refused = run_script(tiny_assets / "model", data, tmp_path / "out.jsonl")
    assert refused.returncode != 0 and "line 3" in refused.stderr
