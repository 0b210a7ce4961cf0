"""Loss masks, truncation, dropping, caching and packing: the data exactly as training sees it.

The chat-template tests use the real Mistral-7B-Instruct-v0.3 tokenizer and template from ../shared and
GSM8K turned into messages; they skip cleanly where ../shared is absent.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain.batching import collate, rank_micro_batches
from llmtrain.config import DataConfig
from llmtrain.data import IGNORE, compute_stats, encode_example, prepare_datasets
from llmtrain.errors import LLMTrainError
from llmtrain.train import compute_loss

from conftest import GSM8K, MISTRAL, needs


def trained_segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    segs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i  # labels are aligned with the inputs, never shifted here
            cur.append(i)
        elif cur:
            segs.append(cur)
            cur = []
    return segs + ([cur] if cur else [])


@pytest.fixture(scope="module")
def mistral():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MISTRAL)


def gsm8k(n: int) -> list[dict]:
    with open(GSM8K / "train.jsonl") as f:
        return [json.loads(next(f)) for _ in range(n)]


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_template_trains_only_assistant_turns_and_eos(mistral):
    cfg = DataConfig(path="x.jsonl", format="messages", max_seq_len=4096)
    for ex in gsm8k(20):
        msgs = [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
        enc = encode_example({"messages": msgs}, mistral, cfg)
        ids, labels = enc["input_ids"], enc["labels"]
        assert ids[0] == mistral.bos_token_id
        segs = trained_segments(ids, labels)
        assert len(segs) == 1
        assert mistral.decode(segs[0]) == ex["answer"] + "</s>"
        assert segs[0][-1] == mistral.eos_token_id
        inst_close = mistral.convert_tokens_to_ids("[/INST]")
        assert all(lab != i for i, lab in zip(ids, labels) if i == inst_close)


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_multi_turn_with_system_prompt(mistral):
    a, b = gsm8k(2)
    msgs = [{"role": "system", "content": "Answer with steps."},
            {"role": "user", "content": a["question"]}, {"role": "assistant", "content": a["answer"]},
            # a reply that also occurs inside the prompt: must be masked at its own position only
            {"role": "user", "content": b["question"] + " 72"}, {"role": "assistant", "content": "72"}]
    enc = encode_example({"messages": msgs}, mistral, DataConfig(path="x.jsonl", format="messages"))
    segs = [mistral.decode(s) for s in trained_segments(enc["input_ids"], enc["labels"])]
    assert segs == [a["answer"] + "</s>", "72</s>"]


@needs(MISTRAL)
@needs(GSM8K)
def test_prompt_completion_with_field_mapping(mistral):
    cfg = DataConfig(path="x.jsonl", format="prompt_completion", fields={"prompt": "question", "completion": "answer"})
    ex = gsm8k(1)[0]
    enc = encode_example(ex, mistral, cfg)
    (seg,) = trained_segments(enc["input_ids"], enc["labels"])
    assert mistral.decode(seg) == ex["answer"] + "</s>"
    on_prompt = encode_example(ex, mistral, cfg.model_copy(update={"train_on_prompt": True}))
    assert on_prompt["labels"] == on_prompt["input_ids"]


def test_formats_on_the_tiny_tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    alpaca = encode_example({"instruction": "Reverse the string.", "input": "abc", "output": "cba"}, tok,
                            DataConfig(path="x.jsonl", format="alpaca"))
    assert [tok.decode(s) for s in trained_segments(alpaca["input_ids"], alpaca["labels"])] == ["cba</s>"]
    assert "### Input:\nabc" in tok.decode(alpaca["input_ids"])
    text = encode_example({"text": "hello"}, tok, DataConfig(path="x.jsonl", format="text"))
    assert text["labels"] == text["input_ids"] and text["input_ids"][-1] == tok.eos_token_id
    assert text["trained"] == len(text["input_ids"]) - 1  # the first token is never a target


def test_truncation_and_dropping_are_counted(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    rows = [{"prompt": "p" * 5, "completion": "c" * 5},   # 1 + 5 + 5 + 1 = 12 tokens, fits
            {"prompt": "p" * 5, "completion": "c" * 20},  # truncated to 16, still has trained tokens
            {"prompt": "p" * 30, "completion": "c" * 5}]  # truncated inside the prompt: dropped
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), format="prompt_completion", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    train, _, stats, hit = prepare_datasets(cfg, tok, seed=0)
    s = stats["train"]
    assert (s.examples, s.truncated, s.dropped, hit) == (2, 1, 1, False)
    assert [len(x) for x in train["input_ids"]] == [12, 16]
    assert s.trained_tokens == 6 + 10  # 5 + EOS, and the 10 completion tokens that fit
    again, _, _, hit = prepare_datasets(cfg, tok, seed=0)
    assert hit and again["input_ids"] == train["input_ids"]
    _, _, _, hit = prepare_datasets(cfg.model_copy(update={"max_seq_len": 17}), tok, seed=0)
    assert not hit  # a different option never reuses the cache


def test_stats_percentiles_by_hand():
    s = compute_stats(list(range(1, 101)), [1] * 100, [False] * 100, dropped=3)
    assert (s.length_p50, s.length_p90, s.length_p99, s.length_max) == (51, 90, 99, 100)
    assert s.dropped == 3 and s.trained_fraction == pytest.approx(100 / 5050)


def test_bad_columns_and_files_are_named(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    cfg = DataConfig(path=str(path), format="prompt_completion", cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=r"needs prompt \(column 'prompt'\).*\['question', 'answer'\]"):
        prepare_datasets(cfg, tok, seed=0)
    with pytest.raises(LLMTrainError, match="nope.jsonl' does not exist"):
        prepare_datasets(cfg.model_copy(update={"path": str(tmp_path / "nope.jsonl")}), tok, seed=0)


def test_packed_row_restarts_positions_and_shifts_per_example():
    a = {"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}
    b = {"input_ids": [1, 7], "labels": [IGNORE, 7]}
    packed = collate([a, b], pad_id=0, packing=True)
    assert packed["input_ids"].tolist() == [[1, 5, 6, 1, 7]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # the last token of `a` must not learn to predict the first token of `b`
    assert packed["targets"].tolist() == [[5, 6, IGNORE, 7, IGNORE]]
    assert "attention_mask" not in packed


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_logits_equal_each_example_alone(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation=attn)).eval()
    examples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (5, 9, 3)]
    packed = collate(examples, pad_id=0, packing=True)
    with torch.no_grad():
        # as compute_loss calls it (use_cache=False: see there)
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        padded = collate(examples, pad_id=0, packing=False)
        assert compute_loss(model, packed).item() == pytest.approx(compute_loss(model, padded).item(), abs=1e-4)
        start = 0
        for ex in examples:
            alone = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            n = len(ex["input_ids"])
            torch.testing.assert_close(logits[start:start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_rank_micro_batches_cover_each_example_once():
    n = 23
    per_rank = [rank_micro_batches(n, seed=1, epoch=0, micro_batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1])  # equal step counts, or collectives hang
    flat = sorted(i for batches in per_rank for b in batches for i in b)
    assert flat == list(range(n))
    one = rank_micro_batches(n, seed=1, epoch=0, micro_batch_size=4, rank=0, world_size=1)
    assert [sorted(a + b) for a, b in zip(*per_rank)] == [sorted(x) for x in one]
    assert one == rank_micro_batches(n, seed=1, epoch=0, micro_batch_size=4, rank=0, world_size=1)
    assert one != rank_micro_batches(n, seed=1, epoch=1, micro_batch_size=4, rank=0, world_size=1)
