"""The data exactly as training sees it: formats and loss masks, truncation and dropping, statistics, errors,
the tokenisation cache, packing, and which examples each rank runs.

The chat-template tests use the real Mistral-7B-Instruct-v0.3 tokenizer and template and GSM8K from
../shared (they skip where it is absent); the others use the tiny character-level tokenizer, where one
character is one token, so lengths can be worked out by hand.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import GSM8K, MISTRAL, needs

from llmtrain.config import DataConfig
from llmtrain.data.batching import collate, rank_micro_batches, with_loss_positions
from llmtrain.data.formats import IGNORE, encode_example
from llmtrain.data.prepare import compute_stats, prepare_datasets
from llmtrain.errors import LLMTrainError
from llmtrain.model.loss import attach_loss, compute_loss


def trained_segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive trained tokens; also checks that labels are the inputs, unshifted."""
    segs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            segs.append(cur)
            cur = []
    return segs + ([cur] if cur else [])


def decoded_segments(enc: dict, tok) -> list[str]:
    return [tok.decode(s) for s in trained_segments(enc["input_ids"], enc["labels"])]


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gsm8k(n: int) -> list[dict]:
    with open(GSM8K / "train.jsonl") as f:
        return [json.loads(next(f)) for _ in range(n)]


def chat(*turns: str, system: str | None = None) -> list[dict]:
    """user, assistant, user, assistant, ... as messages, after an optional system prompt."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


# --------------------------------------------------------------------------- Mistral chat template on GSM8K

MESSAGES = DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096)


@needs(MISTRAL)
@pytest.mark.parametrize(("prompt", "completion", "trained"), [
    ("Translate: chat\n", "cat", ["cat", "</s>"]),  # had been "▁cat": a reply with a stray space
    ("Answer: ", "4", ["4", "</s>"]),  # had been "▁", "4" after the prompt's own "▁"
    ("Q: capital?", " Paris.", ["▁Paris", ".", "</s>"]),  # (a leading space was right already)
    ("Q:", " 5 apples.</s>", ["▁", "5", "▁ap", "ples", ".", "</s>"]),  # EOS already written: not doubled
])
def test_a_plain_completion_is_trained_as_it_follows_its_prompt(mistral, prompt, completion, trained):
    """A plain prompt/completion row (and a pair's or KTO row's answer) on Mistral's tokenizer, which marks a word's
    start with "▁": the completion tokenised alone had gained one (audit 29), where TRL, tokenising them together,
    and inference after the prompt do not. The prompt's tokens stay its own (inference's)."""
    cfg = DataConfig(path="unused.jsonl", format="prompt_completion", max_seq_len=64, chat_template=False)
    enc = encode_example({"prompt": prompt, "completion": completion}, mistral, cfg)
    assert mistral.convert_ids_to_tokens([i for i, x in zip(enc["input_ids"], enc["labels"]) if x != IGNORE]) == trained
    assert enc["input_ids"][:-len(trained)] == mistral(prompt)["input_ids"]


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_trains_exactly_the_answer_and_eos(mistral):
    inst, end_inst = mistral.convert_tokens_to_ids(["[INST]", "[/INST]"])
    for ex in gsm8k(20):
        msgs = chat(ex["question"], ex["answer"])
        enc = encode_example({"messages": msgs}, mistral, MESSAGES)
        ids, labels = enc["input_ids"], enc["labels"]
        # the ids are the template's own rendering, tokenised once: nothing added or lost
        assert ids == mistral(mistral.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
        assert ids[0] == mistral.bos_token_id and ids.count(mistral.bos_token_id) == 1
        assert decoded_segments(enc, mistral) == [ex["answer"] + "</s>"]
        assert ids[-1] == labels[-1] == mistral.eos_token_id  # the stop token is trained, and only once
        first = next(i for i, lab in enumerate(labels) if lab != IGNORE)
        assert ids.index(end_inst) < first  # every prompt token, [INST] and [/INST] included, is masked
        assert labels[ids.index(inst)] == labels[ids.index(end_inst)] == IGNORE
        assert enc["trained"] == sum(lab != IGNORE for lab in labels) and not enc["truncated"]


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_multi_turn_with_system_prompt(mistral):
    a, b = gsm8k(2)
    # the second reply also occurs in the second question: it must be trained at its own position only
    msgs = chat(a["question"], a["answer"], b["question"] + " Is it 72?", "72", system="Answer step by step.")
    enc = encode_example({"messages": msgs}, mistral, MESSAGES)
    assert decoded_segments(enc, mistral) == [a["answer"] + "</s>", "72</s>"]
    ids, labels = enc["input_ids"], enc["labels"]
    assert [i for i, lab in zip(ids, labels) if lab == mistral.eos_token_id] == [mistral.eos_token_id] * 2
    inst = mistral.convert_tokens_to_ids("[INST]")
    assert all(lab == IGNORE for i, lab in zip(ids, labels) if i == inst) and ids.count(inst) == 2
    assert "Answer step by step" not in "".join(decoded_segments(enc, mistral))


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_trimmed_replies_are_found_in_place(mistral):
    """Mistral's template trims replies (`content|trim`): a reply with a trailing newline or a leading
    space, even one that also occurs in the prompt, is trained where the template put it."""
    ex = gsm8k(1)[0]
    for reply in (ex["answer"] + "\n", " " + ex["answer"], "72 "):
        msgs = chat(ex["question"] + " " + reply, reply)
        enc = encode_example({"messages": msgs}, mistral, MESSAGES)
        assert decoded_segments(enc, mistral) == [reply.strip() + "</s>"]
        # no EOS appended to a turn the template already closed
        assert enc["input_ids"] == mistral(mistral.apply_chat_template(msgs, tokenize=False),
                                           add_special_tokens=False)["input_ids"]


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_train_on_prompt_trains_everything(mistral):
    ex = gsm8k(1)[0]
    cfg = MESSAGES.model_copy(update={"train_on_prompt": True})
    enc = encode_example({"messages": chat(ex["question"], ex["answer"])}, mistral, cfg)
    assert enc["labels"] == enc["input_ids"] and enc["trained"] == len(enc["input_ids"]) - 1


@needs(MISTRAL)
@needs(GSM8K)
def test_gsm8k_prompt_completion_with_field_mapping(mistral, tmp_path):
    rows = gsm8k(6)
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    cfg = DataConfig(path=str(path), format="prompt_completion", fields={"prompt": "question", "completion": "answer"},
                     max_seq_len=1024, cache_dir=str(tmp_path / "cache"))
    train, _, stats, _ = prepare_datasets(cfg, mistral, seed=0)
    assert stats["train"].examples == len(train) == 6
    for ex, ids, labels in zip(rows, train["input_ids"], train["labels"]):
        assert [mistral.decode(s) for s in trained_segments(ids, labels)] == [ex["answer"] + "</s>"]
        assert ids[0] == mistral.bos_token_id and labels[0] == IGNORE
        first = next(i for i, lab in enumerate(labels) if lab != IGNORE)
        assert mistral.decode(ids[:first]) == "<s> " + ex["question"]  # the whole prompt, masked


# --------------------------------------------------------------------------- formats on the tiny tokenizer


ALPACA_PROMPT = "Below is an instruction that describes a task{}. Write a response that appropriately completes the " \
                "request.\n\n### Instruction:\nReverse the string.\n\n{}### Response:\n"


@pytest.mark.parametrize("fmt, example, prompt, completion", [
    ("alpaca", {"instruction": "Reverse the string.", "input": "abc", "output": "cba"},
     ALPACA_PROMPT.format(", paired with an input that provides further context", "### Input:\nabc\n\n"), "cba"),
    ("alpaca", {"instruction": "Reverse the string.", "output": "cba"}, ALPACA_PROMPT.format("", ""), "cba"),
    ("prompt_completion", {"prompt": "reverse abc =", "completion": " cba"}, "reverse abc =", " cba"),
    ("messages", {"messages": chat("reverse abc", "cba")}, "<|USER|>reverse abc<|ASSISTANT|>", "cba"),
])
def test_formats_train_only_the_completion(tiny_tok, fmt, example, prompt, completion):
    cfg = DataConfig(path="unused.jsonl", format=fmt)
    enc = encode_example(example, tiny_tok, cfg)
    assert tiny_tok.decode(enc["input_ids"]) == "<s>" + prompt + completion + "</s>"
    assert decoded_segments(enc, tiny_tok) == [completion + "</s>"]
    n_prompt = 1 + len(tiny_tok(prompt, add_special_tokens=False)["input_ids"])  # BOS + prompt
    assert enc["labels"] == [IGNORE] * n_prompt + enc["input_ids"][n_prompt:]
    everything = encode_example(example, tiny_tok, cfg.model_copy(update={"train_on_prompt": True}))
    assert everything["input_ids"] == enc["input_ids"] and everything["labels"] == enc["input_ids"]


def test_text_format_trains_every_token(tiny_tok):
    enc = encode_example({"text": "hello"}, tiny_tok, DataConfig(path="unused.jsonl", format="text"))
    assert tiny_tok.decode(enc["input_ids"]) == "<s>hello</s>"
    assert enc["labels"] == enc["input_ids"]
    assert enc["trained"] == 6  # the first token is never a target: nothing predicts it


# --------------------------------------------------------------------------- truncation, dropping, statistics


def test_truncation_and_dropping_are_counted(tiny_tok, tmp_path):
    # one character is one token: bos + prompt + completion + eos
    rows = [{"prompt": "p" * 5, "completion": "c" * 5},    # 12 tokens: fits
            {"prompt": "p" * 5, "completion": "c" * 20},   # 27 -> 16, ten completion tokens left
            {"prompt": "p" * 14, "completion": "c" * 5},   # 21 -> 16, one completion token left: kept
            {"prompt": "p" * 15, "completion": "c" * 5},   # 22 -> 16, the completion is cut away: dropped
            {"prompt": "p" * 30, "completion": "c" * 5}]   # truncated inside the prompt: dropped
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(path), format="prompt_completion", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    train, _, stats, _ = prepare_datasets(cfg, tiny_tok, seed=0)
    s = stats["train"]
    assert (s.examples, s.truncated, s.dropped) == (3, 2, 2)
    assert [len(x) for x in train["input_ids"]] == [12, 16, 16]
    assert (s.tokens, s.trained_tokens, s.length_max) == (44, 6 + 10 + 1, 16)
    assert train["labels"][1][-1] == tiny_tok.convert_tokens_to_ids("c")  # cut before EOS: no EOS trained
    assert train["labels"][2] == [IGNORE] * 15 + [tiny_tok.convert_tokens_to_ids("c")]


def test_an_eval_split_with_nothing_left_is_refused_and_a_cache_entry_of_one_prepared_again(tiny_tok, tmp_path):
    """Eval rows that all drop (each prompt filling data.max_seq_len) had ended in datasets' IndexError at the cache's
    read, and the entry kept it for every later run (audit 50): one paragraph naming the eval file and its rows, and an
    entry of such an eval written before is prepared again (refused the same way)."""
    import json as _json

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "completion": "c"}] * 3)
    held = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "p" * 40, "completion": "c"}])
    cfg = DataConfig(path=str(train), format="prompt_completion", max_seq_len=16, cache_dir=str(tmp_path / "c"),
                     eval_split=str(held))
    said = r"none of the 1 eval examples in .*e.jsonl \(data.eval_split\) can be evaluated \(1 of 1 examples dropped"
    with pytest.raises(LLMTrainError, match=said + r".*\(row 1\)\)\. Raise data.max_seq_len \(now 16\)"):
        prepare_datasets(cfg, tiny_tok, seed=0)
    assert not any((tmp_path / "c").glob("*/stats.json"))  # nothing cached
    good = cfg.model_copy(update={"max_seq_len": 64})
    prepare_datasets(good, tiny_tok, seed=0)
    entry = next((tmp_path / "c").glob("*/stats.json")).parent  # made as an older llmtrain had made it: 0 eval rows
    stats = _json.loads((entry / "stats.json").read_text())
    (entry / "stats.json").write_text(_json.dumps({**stats, "eval": {**stats["eval"], "examples": 0}}))
    for f in (entry / "eval").glob("*.arrow"):
        f.unlink()
    _, evald, stats, hit = prepare_datasets(good, tiny_tok, seed=0)
    assert not hit and len(evald) == 1 and stats["eval"].examples == 1


def test_nothing_left_after_truncation_is_an_error(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p" * 40, "completion": "c"}])
    cfg = DataConfig(path=str(path), format="prompt_completion", max_seq_len=8, cache_dir=str(tmp_path / "c"))
    # bos + 40 + 1 + eos: 43 tokens, rounded up to 64
    # the share the advised length keeps, not "95%" of a length that keeps them all (audit 11)
    with pytest.raises(LLMTrainError, match=r"\(row 1\)\)\. Raise data.max_seq_len \(now 8; 64 keeps every one of "
                                            r"the examples whole, the longest is 43 tokens\), or check data.format"):
        prepare_datasets(cfg, tiny_tok, seed=0)
    # 20 rows of 10 to 200 prompt characters (13 to 203 tokens): 95% of them fit in 193 tokens, rounded up to 256
    rows = [{"prompt": "p" * (10 * k), "completion": "c"} for k in range(1, 21)]
    cfg = cfg.model_copy(update={"path": str(write_jsonl(tmp_path / "e.jsonl", rows)), "max_seq_len": 12})
    with pytest.raises(LLMTrainError, match=r"\(now 12; 256 keeps every one of the examples whole, the longest is "
                                            r"203 "):
        prepare_datasets(cfg, tiny_tok, seed=0)
    # 19 rows of 23 tokens and one of 403: 64 keeps 19 of the 20
    rows = [{"prompt": "p" * 20, "completion": "c"}] * 19 + [{"prompt": "p" * 400, "completion": "c"}]
    cfg = cfg.model_copy(update={"path": str(write_jsonl(tmp_path / "f.jsonl", rows)), "max_seq_len": 12})
    with pytest.raises(LLMTrainError, match=r"\(now 12; 64 keeps 95% of the examples whole, the longest is 403 "):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_stats_percentiles_by_hand():
    lengths = [7, 3, 10, 1, 9, 4, 2, 8, 6, 5]  # 1..10; nearest rank on index round(q * 9)
    s = compute_stats(lengths, [2] * 10, [True, False] * 5, dropped=4)
    assert (s.length_p50, s.length_p90, s.length_p99, s.length_max) == (5, 9, 10, 10)
    assert (s.examples, s.dropped, s.truncated, s.tokens, s.trained_tokens) == (10, 4, 5, 55, 20)
    assert s.trained_fraction == pytest.approx(20 / 55)
    one = compute_stats([42], [1], [False], dropped=0)
    assert (one.length_p50, one.length_p99, one.length_max) == (42, 42, 42)
    empty = compute_stats([], [], [], dropped=2)
    assert (empty.examples, empty.length_max, empty.trained_fraction) == (0, 0, 0.0)


# --------------------------------------------------------------------------- errors name what is wrong


def test_missing_column_names_the_field_and_the_columns(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    cfg = DataConfig(path=str(path), format="prompt_completion", cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=r"needs prompt \(column 'prompt'\), completion .*\['question', 'answer'\]"):
        prepare_datasets(cfg, tiny_tok, seed=0)
    mapped = cfg.model_copy(update={"fields": {"prompt": "question", "completion": "reply"}})
    with pytest.raises(LLMTrainError, match=r"needs completion \(column 'reply'\) but") as err:
        prepare_datasets(mapped, tiny_tok, seed=0)
    assert "prompt (column" not in str(err.value)  # the mapped field is found
    assert "e.g. data.fields.completion=<column>" in str(err.value)  # the advice names the missing field
    pairs = DataConfig(path=str(path), format="preference", cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError,
                       match=r"needs chosen \(column 'chosen'\), rejected .* e\.g\. data\.fields\.chosen="):
        prepare_datasets(pairs, tiny_tok, seed=0)  # a preference file's prompt is optional: not the advice
    # a chat file read as prompt_completion with an eval split: the columns said are the file's (llmtrain's own
    # row-number column had been listed), and the format that reads them is named
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"}]}] * 4)
    split = DataConfig(path=str(chats), format="prompt_completion", eval_split=0.5, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError) as err:
        prepare_datasets(split, tiny_tok, seed=0)
    assert "has columns ['messages']. Its rows hold a 'messages' column: data.format=messages reads them as chats." \
        in str(err.value) and "__llmtrain" not in str(err.value)


def test_eval_rows_of_another_dataset_are_named_as_such_before_the_train_rows_are_tokenised(tiny_tok, tmp_path):
    # A new user's override of data.path (and data.fields) on the tiny recipe keeps its eval file of other columns:
    # the fix is the eval data, not data.fields, and nothing is tokenised (or cached) before it is said.
    train = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 4)
    other = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "q", "completion": "a"}])
    cfg = DataConfig(path=str(train), format="prompt_completion", eval_split=str(other),
                     fields={"prompt": "question", "completion": "answer"}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError) as err:
        prepare_datasets(cfg, tiny_tok, seed=0)
    said = str(err.value)
    assert said.startswith(f"the eval rows ({other}, data.eval_split) have columns ['prompt', 'completion'], without "
                           "['question', 'answer']")
    assert "data.eval_split=0.05" in said and "Map them with data.fields" not in said
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
    wrong = cfg.model_copy(update={"fields": {"prompt": "question", "completion": "reply"}})
    with pytest.raises(LLMTrainError, match=r"needs completion \(column 'reply'\) but .*qa\.jsonl"):
        prepare_datasets(wrong, tiny_tok, seed=0)  # the train rows' own mismatch is still data.fields' advice


def test_missing_data_file_names_the_path(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "completion": "a"}])
    cfg = DataConfig(path=str(tmp_path / "nope.jsonl"), format="prompt_completion", cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=re.escape(f"'{tmp_path / 'nope.jsonl'}' does not exist")):
        prepare_datasets(cfg, tiny_tok, seed=0)
    no_eval = cfg.model_copy(update={"path": str(path), "eval_split": str(tmp_path / "eval.jsonl")})
    with pytest.raises(LLMTrainError, match="eval.jsonl' does not exist"):
        prepare_datasets(no_eval, tiny_tok, seed=0)


# --------------------------------------------------------------------------- the tokenisation cache


def test_cache_returns_the_same_rows_and_is_keyed_by_every_option(tiny_assets, tiny_tok, tmp_path):
    from transformers import AutoTokenizer

    rows = [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}"} for w in ("abc", "hello", "xy", "world", "q")]
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), format="prompt_completion", max_seq_len=32,
                     eval_split=0.4, cache_dir=str(tmp_path / "cache"))
    train, evald, stats, hit = prepare_datasets(cfg, tiny_tok, seed=0)
    assert not hit and (len(train), len(evald)) == (3, 2)
    again, eval_again, stats_again, hit = prepare_datasets(cfg, tiny_tok, seed=0)
    assert hit and stats_again == stats
    assert again[:] == train[:] and eval_again[:] == evald[:]  # input_ids and labels, row for row
    assert sorted(list(again["input_ids"]) + list(eval_again["input_ids"])) == sorted(
        encode_example(r, tiny_tok, cfg)["input_ids"] for r in rows)

    def misses(c=cfg, tok=tiny_tok, seed=0) -> bool:
        return not prepare_datasets(c, tok, seed=seed)[3]

    assert misses(cfg.model_copy(update={"max_seq_len": 33}))
    assert misses(cfg.model_copy(update={"train_on_prompt": True}))
    assert misses(seed=1)  # the eval fraction is drawn with the seed
    # the same tokenizer.json with another EOS (tokenizer_config.json): every example ends differently
    assert misses(tok=AutoTokenizer.from_pretrained(tiny_assets / "model", eos_token="<pad>"))
    write_jsonl(tmp_path / "d.jsonl", rows[:4])
    assert misses()
    # a dataset folder with the cache inside it (data.cache_dir's relative default, run from the folder): the
    # cache's own files are not the data's, so the second read hits (every run had written a new entry)
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    inside = DataConfig(path=str(folder), format="prompt_completion", max_seq_len=32, cache_dir=str(folder / ".cache"))
    assert not prepare_datasets(inside, tiny_tok, seed=0)[3] and prepare_datasets(inside, tiny_tok, seed=0)[3]


# --------------------------------------------------------------------------- collation and packing


def test_packed_row_restarts_positions_and_shifts_targets_per_example():
    a = {"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}
    b = {"input_ids": [1, 7, 8, 9], "labels": [IGNORE, IGNORE, 8, 9]}
    packed = collate([a, b], pad_id=0, packing=True)
    # no attention mask: positions (and, for the varlen attention, cu_seq_lens) delimit the examples
    assert set(packed) == {"input_ids", "position_ids", "targets", "cu_seq_lens", "max_length"}
    assert packed["cu_seq_lens"].tolist() == [0, 3, 7] and packed["max_length"] == 4
    assert packed["input_ids"].tolist() == [[1, 5, 6, 1, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    # each example's last position predicts nothing: 6 must not learn to predict b's first token
    assert packed["targets"].tolist() == [[5, 6, IGNORE, IGNORE, 8, 9, IGNORE]]


def test_padded_batch_masks_padding_and_shifts_the_same_way():
    a = {"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}
    b = {"input_ids": [1, 7], "labels": [IGNORE, 7]}
    batch = collate([a, b], pad_id=0, packing=False)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["targets"].tolist() == [[5, 6, IGNORE], [7, IGNORE, IGNORE]]
    for packing in (False, True):  # a pipeline's filler (no examples): one row, nothing trained
        idle = collate([], pad_id=3, packing=packing)
        assert idle["input_ids"].tolist() == [[3]] and idle["targets"].tolist() == [[IGNORE]]


def tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    model = LlamaForCausalLM(config).float().eval()
    attach_loss(model, chunk=4)
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packing_is_exact_no_example_attends_to_another(attn):
    model = tiny_llama(attn)
    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (5, 9, 3, 7):
        ids = torch.randint(4, 64, (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE] * (n // 2) + ids[n // 2:]})
    packed, padded = collate(examples, pad_id=0, packing=True), collate(examples, pad_id=0, packing=False)
    tokens = (packed["targets"] != IGNORE).sum().item()
    assert tokens == (padded["targets"] != IGNORE).sum().item() == 3 + 5 + 2 + 4  # n - n // 2 each
    with torch.no_grad():
        loss_packed = compute_loss(model, with_loss_positions(dict(packed))).item()
        loss_padded = compute_loss(model, with_loss_positions(dict(padded))).item()
        assert loss_packed / tokens == pytest.approx(loss_padded / tokens, abs=1e-5)
        assert loss_packed == pytest.approx(loss_padded, rel=1e-6)
        # as compute_loss calls it: use_cache=False, so transformers sees the restarting positions
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        causal = model(input_ids=packed["input_ids"], use_cache=False).logits[0]  # one long sequence
        start = 0
        for i, ex in enumerate(examples):
            n = len(ex["input_ids"])
            alone = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            torch.testing.assert_close(logits[start:start + n], alone, atol=1e-5, rtol=1e-5)
            if i > 0:  # the check has teeth: attending across the boundary changes the logits
                assert (causal[start:start + n] - alone).abs().max() > 1e-3
            start += n


# --------------------------------------------------------------------------- which examples each rank runs


def epoch(n: int, *, world: int, mb: int, seed: int = 3, ep: int = 0) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one epoch."""
    return [rank_micro_batches(n, seed=seed, epoch=ep, micro_batch_size=mb, rank=r, world_size=world)
            for r in range(world)]


@pytest.mark.parametrize("n", [1, 3, 8, 21, 23, 100])
@pytest.mark.parametrize("world, mb", [(1, 4), (2, 2), (4, 1), (3, 2)])
def test_every_example_once_and_equal_step_counts(n, world, mb):
    ranks = epoch(n, world=world, mb=mb)
    assert len({len(r) for r in ranks}) == 1  # every rank runs as many micro-batches, or collectives hang
    assert sorted(i for r in ranks for b in r for i in b) == list(range(n))
    assert all(len(b) <= mb for r in ranks for b in r)


@pytest.mark.parametrize("n", [8, 21, 23])
def test_global_micro_batches_do_not_depend_on_the_split_across_ranks(n):
    def global_batches(world, mb):
        return [sorted(sum(step, [])) for step in zip(*epoch(n, world=world, mb=mb))]

    assert global_batches(2, 2) == global_batches(1, 4) == global_batches(4, 1)
    ranks = epoch(n, world=2, mb=2)
    assert [a + b for a, b in zip(*ranks)] == epoch(n, world=1, mb=4)[0]  # rank r takes the r-th slice


def test_order_is_a_function_of_seed_and_epoch():
    assert epoch(50, world=2, mb=2, seed=3, ep=1) == epoch(50, world=2, mb=2, seed=3, ep=1)
    orders = {str(epoch(50, world=1, mb=50, seed=s, ep=e)) for s in (3, 4) for e in (0, 1, 2)}
    assert len(orders) == 6  # every (seed, epoch) its own permutation
    assert rank_micro_batches(5, seed=3, epoch=0, micro_batch_size=2, rank=0, world_size=1,
                              shuffle=False) == [[0, 1], [2, 3], [4]]


def test_a_mistyped_local_data_path_is_named_as_missing_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """data.path=../shared/data/gsm8kk used to be tried as a hub dataset, with network advice. A value that looks like
    a path (a slash, and a parent folder that exists, or a leading . / ~) is said not to exist, with the nearest name;
    owner/name is still a hub id."""
    from llmtrain.data.sources import _missing_local, load_raw
    from llmtrain.errors import LLMTrainError

    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LLMTrainError, match=r"^data path 'data/gsm8kk' does not exist: there is no file or folder "
                                            r"'gsm8kk' in data; the nearest name there is 'gsm8k'\."):
        load_raw("data/gsm8kk")
    assert "no file or folder 'dta' in ." in _missing_local("./dta/gsm8k")
    assert _missing_local("openai/gsm8k") is None and _missing_local("gsm8k") is None


def test_a_hub_id_that_cannot_load_names_hf_hub_offline(monkeypatch):
    from llmtrain.model.modeling import _load_error

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    err = _load_error("model", "mistralai/Mistral-7B-Instruct-v0.3", OSError("We couldn't connect"))
    assert "HF_HUB_OFFLINE=1 makes every command say so at once" in str(err)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline (set, or by llmtrain.hub): only the cache was looked in
    err = _load_error("model", "mistralai/Mistral-7B-Instruct-v0.3", OSError("We couldn't connect"))
    assert "the model 'mistralai/Mistral-7B-Instruct-v0.3' (model.name_or_path / model.tokenizer) is not in the " \
           "local Hugging Face cache" in str(err) and "hf download mistralai/Mistral-7B-Instruct-v0.3" in str(err)


def test_long_rows_do_not_print_transformers_length_warning(tiny_assets):
    """llmtrain cuts rows at data.max_seq_len and counts them; transformers' 'Token indices sequence length is
    longer than the specified maximum' on every long-data run is noise, turned off where the tokenizer is loaded.
    (A process of its own: transformers' log handler writes to the stderr it found at import.)"""
    import subprocess
    import sys

    code = ("import sys\n"
            "from transformers import AutoTokenizer\n"
            "from llmtrain.config import ModelConfig\n"
            "from llmtrain.model.modeling import load_tokenizer\n"
            "path, long = sys.argv[1], 'a' * 600\n"  # the tiny tokenizer's model_max_length is 512
            "load_tokenizer(ModelConfig(name_or_path=path))(long)\n"
            "print('--- transformers alone', file=sys.stderr, flush=True)\n"
            "AutoTokenizer.from_pretrained(path)(long)\n")
    err = subprocess.run([sys.executable, "-c", code, str(tiny_assets / "model")], capture_output=True, text=True,
                         check=True).stderr
    ours, theirs = err.split("--- transformers alone")
    assert "Token indices sequence length" not in ours and "Token indices sequence length" in theirs


def test_eval_rows_dropped_for_having_no_trained_token_are_said_at_the_start(tiny_assets, tmp_path):
    """The eval split is tokenised as the train split is: a row whose completion lies past data.max_seq_len is
    dropped, and the eval metrics leave it out. The start-up line counted the train split's only ("0 dropped ...
    eval: 150 examples" with 50 of 200 eval rows gone); it now says the eval's too."""
    from helpers import run_train, write_recipe

    rows = [json.loads(x) for x in (tiny_assets / "data" / "eval.jsonl").read_text().splitlines()[:8]]
    for row in rows[::4]:  # 2 of 8 prompts past the 32 tokens: their completions cut away
        row["prompt"] = "x" * 40 + row["prompt"]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tiny_assets, tmp_path, data={"eval_split": str(eval_file)}, train={"max_steps": 1})
    run_train(recipe)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "eval: 6 examples (2 dropped with no trained token within data.max_seq_len=32)" in log, log


def test_a_column_of_values_of_several_types_keeps_each_value_as_the_file_writes_it(tiny_tok, tmp_path):
    """datasets 5 reads a column whose rows hold values of several types as JSON values and stores its strings
    unquoted, so "true" came back as True, "1e3" as 1000.0 and "null" as None: online RL's rewards got them, and a
    quoted completion "42" beside a conversation was refused as an int (audit 50). Each value arrives as written:
    in the raw rows, in online RL's prepared columns (what the rewards get) and prompts, and in the cache."""
    from llmtrain.data.formats import USER
    from llmtrain.data.sources import load_raw

    answers = ["true", "1e3", 5, "null", None, [1, "x"], "007", "a\u2028b"]  # (U+2028: no line break in JSON Lines)
    rl = tmp_path / "rl.jsonl"  # (the raw character, as a file written with ensure_ascii=False holds it)
    rl.write_text("".join(json.dumps({"prompt": f"reverse {'abcdefgh'[i]} =", "answer": a}, ensure_ascii=False) + "\n"
                          for i, a in enumerate(answers)), encoding="utf-8")
    assert load_raw(str(rl))["answer"] == answers
    cfg = DataConfig(path=str(rl), format="prompt", max_seq_len=64, cache_dir=str(tmp_path / "c"))
    for _ in range(2):  # prepared, then read back from the cache
        train, _, _, hit = prepare_datasets(cfg, tiny_tok, seed=0)
        assert sorted(train[USER + "answer"], key=repr) == sorted(answers, key=repr)
    assert hit
    prompts = [{"prompt": "5", "answer": "a"}, {"prompt": [{"role": "user", "content": "true"}], "answer": "b"}]
    cfg = cfg.model_copy(update={"path": str(write_jsonl(tmp_path / "p.jsonl", prompts)), "chat_template": True})
    train, _, _, _ = prepare_datasets(cfg, tiny_tok, seed=0)
    assert sorted(train["prompt"], key=repr) == sorted([p["prompt"] for p in prompts], key=repr)
    mixed = [{"prompt": "what is 6*7?", "completion": "42"},
             {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "null"}]}]
    raw = load_raw(str(write_jsonl(tmp_path / "sft.jsonl", mixed)))
    assert raw["completion"] == ["42", [{"role": "assistant", "content": "null"}]]


@pytest.mark.parametrize("labels", [[1, 0, 1], ["true", "false", "true"], ["True", "False", "False"],
                                    [True, "false", 1]])
def test_feedback_labelled_by_numbers_or_words_is_refused_as_supervised_data(tiny_tok, tmp_path, labels):
    """Unpaired feedback (KTO's rows) given to SFT was refused only where its label column was JSON's booleans; 1/0,
    "true"/"false" (a CSV's, a parquet's int column) trained every completion, the undesirable ones too (audit 50).
    A label column of other values (a class name) passes."""
    rows = [{"prompt": f"reverse {c} =", "completion": f" {c}", "label": v} for c, v in zip("abc", labels)]
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "f.jsonl", rows)), format="prompt_completion",
                     cache_dir=str(tmp_path / "c"), chat_template=False)
    with pytest.raises(LLMTrainError, match=r"has a 'label' column of true and false \(or 1 and 0\): its rows look "):
        prepare_datasets(cfg, tiny_tok, seed=0)
    other = [{**row, "label": name} for row, name in zip(rows, ["math", "code", "math"])]
    prepare_datasets(cfg.model_copy(update={"path": str(write_jsonl(tmp_path / "o.jsonl", other))}), tiny_tok, seed=0)


def test_a_mixture_of_online_rl_prompts_keeps_each_sources_values_as_written(tiny_tok, tmp_path):
    """One source's reward column of several types is kept as JSON (sources.as_written) and another's plain: putting
    them together cast the plain strings as JSON text, "42" to 42 and "007" to 7 (or, in the other order, gave the
    rewards quoted JSON text; the review of audit 50's fix)."""
    from llmtrain.data.formats import USER

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "reverse a =", "answer": 5},
                                           {"prompt": "reverse b =", "answer": "true"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "reverse c =", "answer": "42"},
                                           {"prompt": "reverse d =", "answer": "007"}])
    for order in ((a, b), (b, a)):
        cfg = DataConfig(sources=[{"path": str(p), "format": "prompt", "weight": 1} for p in order], max_seq_len=64,
                         cache_dir=str(tmp_path / "c"), eval_split=None)
        train, _, _, _ = prepare_datasets(cfg, tiny_tok, seed=0)
        assert sorted(train[USER + "answer"], key=repr) == ["007", "42", "true", 5]
