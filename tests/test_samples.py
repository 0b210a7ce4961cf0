"""Sample generations at eval (train.eval_samples) on the tiny model: prompt and expected text are the data's,
the generation is the model's greedy continuation (checked against a plain argmax loop), deterministic, and
samples.jsonl holds one line per sample and step."""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain.data.formats import IGNORE, encode_prompt_completion
from llmtrain.run.metrics import MetricsLog
from llmtrain.run.samples import format_sample, generate_samples, split_example


def eval_rows(tiny, n: int) -> list[dict]:
    return [json.loads(line) for line in (tiny / "data" / "eval.jsonl").read_text().splitlines()[:n]]


def tokenised(tokenizer, rows: list[dict]) -> list[dict]:
    """Eval rows as the data pipeline tokenises prompt_completion data (labels -100 on the prompt)."""
    out = []
    for row in rows:
        ids, labels = encode_prompt_completion(row["prompt"], row["completion"], tokenizer, train_on_prompt=False)
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_assets):
    """The tiny model as the trainer holds it: llmtrain's varlen attention and its loss forward attached."""
    from llmtrain.config import ModelConfig
    from llmtrain.model.loss import attach_loss
    from llmtrain.model.modeling import load_model, load_tokenizer

    cfg = ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="auto")
    model = load_model(cfg, None)
    attach_loss(model, chunk=64)
    model.train()
    return model, load_tokenizer(cfg)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy decoding by hand: the full sequence through the model each time, argmax of the last position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


def test_split_example_prompt_is_the_leading_masked_run():
    assert split_example({"input_ids": [1, 5, 6, 7, 8, 2], "labels": [IGNORE, IGNORE, IGNORE, 7, 8, 2]}) == (
        [1, 5, 6], [7, 8, 2])
    # a multi-turn chat: the last reply is expected, after the turns before it (the first reply, a second user turn,
    # a tool's result); those had been expected after the first prompt, which no reply can match
    assert split_example({"input_ids": [1, 5, 6, 7], "labels": [IGNORE, 5, IGNORE, 7]}) == ([1, 5, 6], [7])
    assert split_example({"input_ids": [1, 5, 6, 7, 8, 9, 3], "labels": [IGNORE, IGNORE, 6, IGNORE, 8, 9, IGNORE]}) \
        == ([1, 5, 6, 7], [8, 9])  # what follows the last reply's end of turn is not expected
    assert split_example({"input_ids": [1, 5], "labels": [1, 5]}) == ([1], [5])  # nothing masked: BOS is the prompt


def test_samples_are_the_data_and_the_greedy_continuation(tiny_assets, tiny_model):
    model, tokenizer = tiny_model
    rows = eval_rows(tiny_assets, 3)
    examples = tokenised(tokenizer, rows)
    samples = generate_samples(model, tokenizer, examples, max_new_tokens=8, step=12)
    again = generate_samples(model, tokenizer, examples, max_new_tokens=8, step=12)
    assert samples == again  # greedy: deterministic

    assert [s["prompt"] for s in samples] == [r["prompt"] for r in rows]  # "reverse abc =" as in eval.jsonl
    assert [s["expected"] for s in samples] == [r["completion"] for r in rows]  # " cba": EOS not shown
    assert [(s["step"], s["index"]) for s in samples] == [(12, 0), (12, 1), (12, 2)]
    # The generation (SDPA with a KV cache, switched from the varlen attention) is the model's own greedy
    # continuation: the same tokens as an argmax loop over full forwards.
    for example, sample in zip(examples, samples):
        prompt, _ = split_example(example)
        want = greedy_reference(model, prompt, 8, tokenizer.eos_token_id)
        assert sample["generated"] == tokenizer.decode(want, skip_special_tokens=True)
        assert len(want) == 8 or want[-1] == tokenizer.eos_token_id
    # The model is left as training needs it.
    assert model.training and model.config._attn_implementation == "llmtrain_varlen"
    assert model.config.use_cache is False


def test_nothing_masked_generates_from_bos(tiny_assets, tiny_model):
    """data.train_on_prompt / text format: no prompt in the labels, so the sample starts from BOS."""
    model, tokenizer = tiny_model
    row = eval_rows(tiny_assets, 1)[0]
    ids, labels = encode_prompt_completion(row["prompt"], row["completion"], tokenizer, train_on_prompt=True)
    (sample,) = generate_samples(model, tokenizer, [{"input_ids": ids, "labels": labels}], max_new_tokens=4, step=1)
    assert sample["prompt"] == "" and sample["expected"] == row["prompt"] + row["completion"]
    want = greedy_reference(model, [tokenizer.bos_token_id], 4, tokenizer.eos_token_id)
    assert sample["generated"] == tokenizer.decode(want, skip_special_tokens=True)


def test_samples_follow_the_weights(tiny_assets, tiny_model):
    """A model trained on one example reproduces its completion greedily: the samples show learning."""
    from llmtrain.model.loss import causal_lm

    model, tokenizer = tiny_model
    example = tokenised(tokenizer, eval_rows(tiny_assets, 1))[0]
    lm = causal_lm(model)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    try:
        ids = torch.tensor([example["input_ids"]])
        labels = torch.tensor([example["labels"]])
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
        for _ in range(60):
            logits = lm(input_ids=ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=IGNORE)
            loss.backward()
            opt.step()
            opt.zero_grad()
        (sample,) = generate_samples(model, tokenizer, [example], max_new_tokens=12, step=60)
        assert sample["generated"] == sample["expected"]
    finally:
        lm.load_state_dict(state)


def test_samples_jsonl_lines(tmp_path):
    samples = [{"step": 20, "index": i, "prompt": f"reverse ab{i} =", "expected": f" {i}ba", "generated": " ba"}
               for i in range(2)]
    log = MetricsLog(tmp_path, enabled=True, resume_step=None)
    log.write_samples(samples)
    log.write_samples([{**s, "step": 40} for s in samples])
    lines = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == samples + [{**s, "step": 40} for s in samples]
    assert set(lines[0]) == {"step", "index", "prompt", "expected", "generated"}

    # Resumed from the checkpoint at step 20: the samples of later steps will be generated again.
    log = MetricsLog(tmp_path, enabled=True, resume_step=20)
    assert [json.loads(ln)["step"] for ln in (tmp_path / "samples.jsonl").read_text().splitlines()] == [20, 20]

    MetricsLog(tmp_path / "rank1", enabled=False, resume_step=None).write_samples(samples)  # not the main process
    assert not (tmp_path / "rank1").exists()

    # --resume auto that found no checkpoint starts again at step 0, its step-0 eval and samples too: the first run's
    # had been kept and written again beside them (audit 27: two identical step-0 eval lines, 8 samples for 4)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "eval", "step": 0, "eval_reward": 0.3}) + "\n")
    log = MetricsLog(tmp_path, enabled=True, resume_step=0)
    assert (tmp_path / "metrics.jsonl").read_text() == (tmp_path / "samples.jsonl").read_text() == ""


def test_a_resume_drops_a_line_the_stop_cut_short_and_names_a_damaged_one(tmp_path):
    """kill -9 while a line was written leaves it without its newline: the resume had died in json.loads."""
    from llmtrain.errors import LLMTrainError

    lines = [{"type": "train", "step": s, "loss": 1.0 / s} for s in (10, 20, 30)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"type": "train", "step": 40, "lo')
    MetricsLog(tmp_path, enabled=True, resume_step=20)
    assert path.read_text() == "".join(json.dumps(x) + "\n" for x in lines[:2])
    MetricsLog(tmp_path, enabled=True, resume_step=20).write(lines[2])  # the next line starts a line of its own
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines

    path.write_text(json.dumps(lines[0]) + "\n{not json\n" + json.dumps(lines[1]) + "\n")
    with pytest.raises(LLMTrainError, match=r"metrics.jsonl, line 2, is not JSON \('\{not json'\)"):
        MetricsLog(tmp_path, enabled=True, resume_step=20)
    assert "{not json" in path.read_text()  # nothing rewritten


def test_format_sample_is_short_and_keeps_the_end_of_the_prompt():
    text = format_sample({"step": 7, "index": 0, "prompt": "word " * 100 + "Question: 2+2?\n",
                          "expected": " 4", "generated": "x" * 500})
    lines = text.splitlines()
    assert lines[0] == "sample at step 7:"
    assert lines[1].startswith("  prompt:    ...") and lines[1].endswith("Question: 2+2?")
    assert lines[2] == "  expected:  4"
    assert lines[3] == "  generated: " + "x" * 240 + "..."


@pytest.mark.slow
def test_finetune_writes_samples_at_each_eval(tmp_path, tiny_assets):
    from helpers import run_train, write_recipe

    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                          data={"eval_split": str(tiny_assets / "data" / "eval.jsonl")},
                          train={"max_steps": 4, "eval_every_steps": 2, "eval_batch_size": 64, "eval_samples": 3,
                                 "eval_max_new_tokens": 6, "eval_answer_pattern": "#### (\\S+)"},
                          logging={"plot": True})
    run_train(recipe)
    # The reversal task's replies have no '#### N': every reference is a miss, and the run says so
    assert "warning (answers): 3 of 3 reference answers do not match train.eval_answer_pattern" in \
        (tmp_path / "run" / "train.log").read_text()
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    rows = eval_rows(tiny_assets, 3)
    assert [(s["step"], s["index"]) for s in lines] == [(2, 0), (2, 1), (2, 2), (4, 0), (4, 1), (4, 2)]
    assert [s["prompt"] for s in lines] == [r["prompt"] for r in rows] * 2
    assert [s["expected"] for s in lines] == [r["completion"] for r in rows] * 2
    assert all(isinstance(s["generated"], str) for s in lines)
    assert (tmp_path / "run" / "loss.png").stat().st_size > 10_000  # rewritten at each eval and at the end


def test_answer_accuracy_compares_the_extracted_answers_of_generated_and_expected_replies():
    """eval_answer_accuracy: with train.eval_answer_pattern the first group is compared (GSM8K's '#### N'), without it
    the whole stripped reply; a generated reply with no answer in it is wrong."""
    from llmtrain.run.samples import mark_answers

    samples = [{"expected": "so 3 + 4 = 7\n#### 7", "generated": "3 + 4 is 7.\n#### 7"},
               {"expected": "#### 12", "generated": "#### 13"},
               {"expected": "#### 5", "generated": "five"}]
    assert mark_answers(samples, r"#### (\S+)") == pytest.approx(1 / 3)
    assert [s["match"] for s in samples] == [True, False, False]
    assert [s["generated_answer"] for s in samples] == ["7", "13", None]
    assert mark_answers([{"expected": " cba", "generated": "cba "}], None) == 1.0
    assert mark_answers([], None) is None


def test_eval_answer_pattern_must_be_a_regex_with_a_group(tmp_path):
    from llmtrain.config import load_recipe
    from llmtrain.errors import RecipeError

    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\n")
    assert load_recipe(path, ["train.eval_answer_pattern=#### (\\S+)"]).train.eval_answer_pattern == "#### (\\S+)"
    with pytest.raises(RecipeError, match="needs a group around the answer"):
        load_recipe(path, ["train.eval_answer_pattern=####"])
    with pytest.raises(RecipeError, match="is not a regular expression"):
        load_recipe(path, ["train.eval_answer_pattern=(("])


def test_an_end_of_turn_of_several_tokens_ends_a_sample_and_is_not_shown(tiny_assets, tiny_model):
    """A template's end of turn the tokenizer splits (generate.Stops.text, as objective.stop_ids gives it for chat
    data) ends the greedy generation where it is complete (transformers' stop string), and the sample reads without
    it, as it would where the end of turn is a special token."""
    from llmtrain.model.generate import Stops

    model, tokenizer = tiny_model
    examples = tokenised(tokenizer, eval_rows(tiny_assets, 3))
    free = generate_samples(model, tokenizer, examples, max_new_tokens=12, step=1)
    text = next(s["generated"][2:5] for s in free if len(s["generated"].strip()) >= 8)  # 3 characters it writes
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    stops = Stops({tokenizer.eos_token_id}, [ids], text)
    cut = generate_samples(model, tokenizer, examples, max_new_tokens=12, step=1, stops=stops)
    for before, after in zip(free, cut):
        at = before["generated"].find(text)
        assert after["generated"] == (before["generated"] if at < 0 else before["generated"][:at])
        assert after["expected"] == before["expected"].removesuffix(text)  # the data's reply, read the same way
    assert any(text in s["generated"] for s in free) and not any(text in s["generated"] for s in cut)
