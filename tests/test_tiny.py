"""The tiny model, tokenizer and task that `llmtrain prepare-tiny` writes (and every CPU test trains on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.tiny import MAX_LEN, MIN_LEN, N_EVAL, N_TRAIN, ROLE_TOKENS, prepare_tiny

DATA_FILES = ["train.jsonl", "eval.jsonl", "train_messages.jsonl", "train_alpaca.jsonl"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tok(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets / "model")


# --------------------------------------------------------------------------- files and data


def test_writes_model_tokenizer_and_data(tiny_assets):
    model = tiny_assets / "model"
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (model / name).is_file(), name
    for name in DATA_FILES:
        assert (tiny_assets / "data" / name).is_file(), name


def test_task_data(tiny_assets):
    train, evald = _rows(tiny_assets / "data" / "train.jsonl"), _rows(tiny_assets / "data" / "eval.jsonl")
    assert len(train) == N_TRAIN and len(evald) == N_EVAL
    for row in train + evald:
        assert set(row) == {"prompt", "completion"}
        word = row["prompt"].removeprefix("reverse ").removesuffix(" =")
        assert row["prompt"] == f"reverse {word} =" and MIN_LEN <= len(word) <= MAX_LEN and word.islower()
        assert row["completion"] == " " + word[::-1]
    # Held-out means held out: no eval prompt appears in training, and no prompt twice.
    prompts = [r["prompt"] for r in train]
    assert len(set(prompts)) == len(prompts)
    assert not {r["prompt"] for r in evald} & set(prompts)


def test_other_formats_hold_the_same_task(tiny_assets):
    train = _rows(tiny_assets / "data" / "train.jsonl")
    messages = _rows(tiny_assets / "data" / "train_messages.jsonl")
    alpaca = _rows(tiny_assets / "data" / "train_alpaca.jsonl")
    assert len(messages) == len(alpaca) == len(train)
    for pc, m, a in zip(train[:50], messages[:50], alpaca[:50]):
        word = pc["completion"].strip()[::-1]
        assert m == {"messages": [{"role": "user", "content": f"reverse {word}"},
                                  {"role": "assistant", "content": word[::-1]}]}
        assert set(a) == {"instruction", "input", "output"}
        assert a["input"] == word and a["output"] == word[::-1]


# --------------------------------------------------------------------------- tokenizer


def test_special_tokens(tok):
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == ("<unk>", "<s>", "</s>", "<pad>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4


def test_character_level_round_trip(tok, tiny_assets):
    samples = [r["prompt"] + r["completion"] for r in _rows(tiny_assets / "data" / "eval.jsonl")]
    samples += ["Hello, World!\n\tx = [1, 2] # {ok}?", "  two  spaces ", "~`!@#$%^&*()_+-=|\\:;\"'<>,./"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
        with_bos = tok(text)["input_ids"]
        assert with_bos == [tok.bos_token_id] + ids  # Llama-like: BOS prepended, no EOS appended
        assert tok.decode(with_bos, skip_special_tokens=True) == text


def test_unknown_characters_map_to_unk(tok):
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_chat_template_renders(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"},
                {"role": "assistant", "content": "cba"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<s><|SYSTEM|>be brief<|USER|>reverse abc<|ASSISTANT|>cba</s>"
    prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|USER|>reverse abc<|ASSISTANT|>"
    # Role markers are single special tokens, so they never split into characters.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[-1] == tok.eos_token_id
    for marker in ROLE_TOKENS:
        assert tok.convert_tokens_to_ids(marker) in ids
        assert tok.convert_tokens_to_ids(marker) in tok.all_special_ids


def test_messages_mask_trains_only_the_reply(tok, tiny_assets):
    """The chat template works with the messages loss mask: the reply and its </s> are trained, nothing else.
    Replies are lower case and markers upper case, so a reply is never found inside a marker."""
    from llmtrain.data.formats import IGNORE, encode_messages

    for row in _rows(tiny_assets / "data" / "train_messages.jsonl")[:200]:
        ids, labels = encode_messages(row["messages"], tok, train_on_prompt=False)
        trained = [i for i, lab in zip(ids, labels) if lab != IGNORE]
        assert tok.decode(trained) == row["messages"][1]["content"] + "</s>"


def test_prompt_completion_encoding(tok):
    from llmtrain.data.formats import IGNORE, encode_prompt_completion

    ids, labels = encode_prompt_completion("reverse abc =", " cba", tok, train_on_prompt=False)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "reverse abc = cba"
    assert tok.decode([i for i in labels if i != IGNORE]) == " cba</s>"


def test_alpaca_prompt_has_no_unknown_characters(tok, tiny_assets):
    from llmtrain.config import DataConfig
    from llmtrain.data.formats import prompt_and_completion

    cfg = DataConfig(path="x.jsonl", format="alpaca")
    prompt, completion = prompt_and_completion(_rows(tiny_assets / "data" / "train_alpaca.jsonl")[0], cfg)
    assert tok.unk_token_id not in tok(prompt + completion)["input_ids"]


# --------------------------------------------------------------------------- model


def test_model_loads_like_a_real_checkpoint(tiny_assets, tok):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model")
    c = model.config
    assert c.model_type == "llama" and type(model).__name__ == "LlamaForCausalLM"
    assert not c.tie_word_embeddings and c.num_key_value_heads < c.num_attention_heads  # untied head, GQA
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert c.vocab_size == len(tok)
    assert model.dtype == torch.float32

    h, v, i, n = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q,o + k,v + gate,up,down + 2 RMSNorms
    expected = 2 * v * h + n * per_layer + h  # embeddings + untied head + layers + final norm
    assert sum(p.numel() for p in model.parameters()) == expected == 518_784

    ids = torch.tensor([tok("reverse abc =")["input_ids"]])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(out.loss) and 3.0 < out.loss.item() < 6.0  # about ln(vocab) at random init


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_files(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    again = tmp_path / "again"
    prepare_tiny(again)  # default seed, like the fixture
    for name in DATA_FILES:
        assert (again / "data" / name).read_bytes() == (tiny_assets / "data" / name).read_bytes(), name
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (again / "model" / name).read_text() == (tiny_assets / "model" / name).read_text(), name
    a, b = load_file(tiny_assets / "model" / "model.safetensors"), load_file(again / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)


def test_other_seed_other_data_and_weights(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    other = tmp_path / "other"
    prepare_tiny(other, seed=1)
    assert (other / "data" / "train.jsonl").read_bytes() != (tiny_assets / "data" / "train.jsonl").read_bytes()
    a, b = load_file(tiny_assets / "model" / "model.safetensors"), load_file(other / "model" / "model.safetensors")
    assert not (a["model.embed_tokens.weight"] == b["model.embed_tokens.weight"]).all()


def test_prepare_leaves_the_global_rng_alone(tmp_path):
    import random

    import torch

    torch.manual_seed(123)
    random.seed(123)
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(123)
    prepare_tiny(tmp_path / "t")
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py


def test_prepare_overwrites_in_place(tmp_path):
    prepare_tiny(tmp_path / "t")
    prepare_tiny(tmp_path / "t")  # a second `llmtrain prepare-tiny` into the same folder works
    assert len(_rows(tmp_path / "t" / "data" / "eval.jsonl")) == N_EVAL


def test_a_folder_it_wrote_is_written_again_only_as_it_was_written(tmp_path):
    """prepare-tiny into its own folder had written over a user's edit of its data and, with another --family,
    swapped the base model under any LoRA run trained on it without a word; an interrupted write was then blamed on
    the user ('holds model, which prepare-tiny did not write'; audit 46)."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.tiny import MARK

    out = tmp_path / "t"
    prepare_tiny(out)
    assert prepare_tiny(out) is True  # the same files again
    with pytest.raises(LLMTrainError, match=r"holds the tiny llama model \(seed 0\); --family qwen3 would replace it"):
        prepare_tiny(out, family="qwen3")
    with pytest.raises(LLMTrainError, match=r"seed 1 would replace it"):
        prepare_tiny(out, seed=1)
    train = out / "data" / "train.jsonl"
    train.write_text(train.read_text() + '{"prompt": "mine", "completion": " mine"}\n')
    (out / "data" / "extra.jsonl").write_text("{}\n")
    with pytest.raises(LLMTrainError, match=r"data/extra.jsonl, data/train.jsonl .*changed or added since"):
        prepare_tiny(out)
    assert train.read_text().endswith('" mine"}\n') and (out / "data" / "extra.jsonl").exists()

    cut = tmp_path / "cut"  # a write stopped after its model/ began: the folder is still prepare-tiny's
    cut.mkdir()
    (cut / MARK).write_text('{"written_by": "llmtrain prepare-tiny", "family": "llama", "seed": 0, "files": null}\n')
    (cut / "model").mkdir()
    assert prepare_tiny(cut) is True and (cut / "data" / "train.jsonl").is_file()
