"""Long examples (100K+ tokens, many turns) prepared as short ones are: the same tokens and the same loss mask as the
per-token rule they were first written with, and a prepared batch held as arrays, not as Python lists of ints.

The rule is kept here as it was (`per_token_labels`: every token overlapping a reply, then, for a reply the template
closes otherwise, what follows up to the next special token): encode_messages now applies it with numpy, once per
row, where it scanned the whole token list once per reply. The Mistral tests use the real Mistral-7B-Instruct-v0.3
tokenizer and template and GSM8K from ../shared (skipped where absent).
"""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np

import pytest
from conftest import GSM8K, MISTRAL, needs
from test_chat_templates import MODELS, stand_in_tokenizer

from llmtrain.config import DataConfig
from llmtrain.data.chat import closing, render_chat
from llmtrain.data.formats import (IGNORE, _overlapping, _tokens_and_offsets, encode_example, encode_messages,
                                   special_ids)
from llmtrain.data.prepare import BATCH_BYTES, BATCH_ROWS, _batch_size, tokenize_dataset


def per_token_labels(messages: list[dict], tok, first: int = 0) -> tuple[list[int], list[int]]:
    """The loss mask as encode_messages computed it before it was vectorised, token by token."""
    text, spans = render_chat(messages, tok, first=first)
    ids, offsets = _tokens_and_offsets(tok, text)
    special, labels, closed = special_ids(tok), [IGNORE] * len(ids), True
    end_of_turn = closing(text, spans)
    for start, end in spans:
        as_text = bool(end_of_turn) and text.startswith(end_of_turn, end)
        end += len(end_of_turn) if as_text else 0
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        after = []
        if as_text:
            closed = True
        else:
            j = inside[-1] + 1 if inside else next((i for i, (a, _) in enumerate(offsets) if a >= end), len(ids))
            k = j
            while k < len(ids) and ids[k] not in special and not text[offsets[k][0]:offsets[k][1]].strip():
                k += 1
            closed = k < len(ids) and ids[k] in special
            after = list(range(j, k + 1)) if closed else []
        for i in inside + after:
            labels[i] = ids[i]
    if not closed:
        ids, labels = ids + [tok.eos_token_id], labels + [tok.eos_token_id]
    return ids, labels


def problems(n: int, skip: int = 0) -> list[dict]:
    lines = (GSM8K / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[skip: skip + n]]


def many_turns(qa: list[dict]) -> list[dict]:
    return [m for q in qa for m in ({"role": "user", "content": q["question"]},
                                    {"role": "assistant", "content": q["answer"]})]


@needs(MISTRAL)
@needs(GSM8K)
def test_a_100k_token_chat_and_a_300_turn_chat_mask_as_token_by_token(mistral):
    document = "".join(f"{q['question']}\n{q['answer']}\n\n" for q in problems(700))
    long_chat = [{"role": "user", "content": document}, {"role": "assistant", "content": problems(1)[0]["answer"]}]
    turns = many_turns(problems(300, skip=700))
    for messages, first in ((long_chat, 0), (turns, 0), (turns, 41)):
        ids, labels = encode_messages(messages, mistral, train_on_prompt=False, first=first)
        assert (ids, labels) == per_token_labels(messages, mistral, first)
        assert sum(lab != IGNORE for lab in labels) > 0
    assert len(encode_messages(long_chat, mistral, train_on_prompt=False)[0]) > 100_000
    assert len(encode_messages(turns, mistral, train_on_prompt=False)[0]) > 30_000


@pytest.mark.parametrize("name", MODELS)
def test_every_template_masks_many_turns_as_token_by_token(name):
    tok = stand_in_tokenizer(name)
    turns = [m for k in range(60) for m in ({"role": "user", "content": f"How many apples are there? {k}"},
                                           {"role": "assistant", "content": f"{k} apples and 3 pears. #### {k}"})]
    for first in (0, 7):
        assert encode_messages(turns, tok, train_on_prompt=False, first=first) == per_token_labels(turns, tok, first)


@needs(MISTRAL)
@needs(GSM8K)
def test_a_prepared_batch_of_long_rows_is_held_as_arrays_not_lists(mistral):
    """Python lists cost ~70 bytes a token (a pointer and an int object for ids and for labels): a batch of long rows
    held as lists until datasets writes it was several copies of the dataset's size. As arrays it is 12 bytes a token,
    beside one row's lists while it is encoded. The rows prepared are the ones encode_example makes, unchanged."""
    import datasets

    datasets.disable_progress_bars()
    qa = problems(24 * 30)
    rows = [{"messages": [{"role": "user", "content": "".join(q["question"] + q["answer"] for q in qa[i::24])},
                          {"role": "assistant", "content": qa[i]["answer"]}]} for i in range(24)]
    cfg = DataConfig(path="long.jsonl", format="messages", max_seq_len=131072)
    raw = datasets.Dataset.from_list(rows)
    tokenize_dataset(raw, mistral, cfg, "long")  # imports and the template's first render, outside the measure
    tracemalloc.start()
    try:
        prepared, _ = tokenize_dataset(raw, mistral, cfg, "long")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tokens = sum(prepared["length"])
    assert tokens > 100_000
    assert peak / tokens < 40, f"{peak / tokens:.0f} bytes a token at the peak"  # 58 as lists
    assert str(prepared.features) == ("{'input_ids': List(Value('int32')), 'labels': List(Value('int64')), "
                                      "'length': Value('int64'), 'row': Value('int64')}")
    for k in (0, 23):
        expected = encode_example(rows[k], mistral, cfg)
        assert prepared[k]["input_ids"] == expected["input_ids"] and prepared[k]["labels"] == expected["labels"]


def test_a_batch_of_long_rows_is_a_few_rows():
    """Rows are encoded and handed to datasets a batch at a time: 256 short rows, but only as many long ones as
    BATCH_BYTES of raw text (a batch of 64 chats of 120K tokens took 231 MiB more at the peak, 96 MiB in 8s)."""
    import datasets

    short = datasets.Dataset.from_list([{"text": "What is 2 + 3? " * 20}] * 300)
    long = datasets.Dataset.from_list([{"text": "What is 2 + 3? " * 32_000}] * 20)  # 480 KB a row
    assert _batch_size(short) == BATCH_ROWS
    assert _batch_size(long) == BATCH_BYTES // 480_000 == 8
    assert _batch_size(long.select([3, 4])) == 8  # counted on the rows, not on a selection of them


def test_the_tokens_over_a_span_by_bisection_are_the_ones_each_token_compared_gives():
    """Offsets in text order are bisected; any other order (none known) has every token compared: both give the
    tokens with text that overlap the span, as the per-token rule does, empty tokens (offsets (a, a)) left out."""
    rng = random.Random(0)
    offsets, at = [], 0
    for _ in range(500):  # tokens of 0 to 4 characters, some sharing a character's span (byte fallback)
        if offsets and rng.random() < 0.2:
            offsets.append(offsets[-1])
            continue
        width = rng.choice([0, 1, 2, 4])
        offsets.append((at, at + width))
        at += width
    starts, ends = np.array([a for a, _ in offsets]), np.array([b for _, b in offsets])
    for _ in range(300):
        start = rng.randrange(at + 2)
        end = start + rng.randrange(12)
        expected = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        for ordered in (True, False):
            assert _overlapping(starts, ends, ends > starts, start, end, ordered=ordered).tolist() == expected
    swapped = [offsets[1], offsets[0], *offsets[2:]]  # out of order: only the comparison is right
    starts, ends = np.array([a for a, _ in swapped]), np.array([b for _, b in swapped])
    expected = [i for i, (a, b) in enumerate(swapped) if a < 3 and b > 0 and b > a]
    assert _overlapping(starts, ends, ends > starts, 0, 3, ordered=False).tolist() == expected
