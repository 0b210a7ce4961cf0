"""The chat templates people fine-tune today, beside Mistral's: Llama 3.1, Qwen2.5, Qwen3, Gemma 2, Gemma 3 and Phi-3.

Each template is the model's original (tests/fixtures/templates/, copied from TRL, which keeps them to recognise
models and checks them against the hub weekly; README.md there gives sources and licences), rendered by transformers
as inference renders it. The tokenizer is a stand-in: a byte-level BPE trained here on a few sentences, with the
model's own special and added tokens and its bos, eos and pad. The real vocabularies are not kept: what the masks
depend on is the template's text and which of its markers are special tokens, and those are the model's.

For each template: the training text is the inference prompt (add_generation_prompt=True) followed by the reply as
the template renders it; the trained tokens are exactly what the model generates after that prompt (the reply and the
end-of-turn token), nothing of the prompt; a system prompt is kept where inference puts it, or refused with advice
where the template has no system role; every reply of a multi-turn chat is trained; doctor's stop-token check passes;
and the tokens TRL's own assistant masks train (its `*_training.jinja` templates) are ours plus only whitespace the
model never generates.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from conftest import MISTRAL, needs
from llmtrain.config import DataConfig
from llmtrain.data.chat import render_chat
from llmtrain.data.checks import check_eos_trained
from llmtrain.data.formats import IGNORE, encode_example
from llmtrain.errors import LLMTrainError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "templates"
MODELS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TRL_NAMES = {"llama-3.1-8b-instruct": "llama3_1", "qwen2.5-7b-instruct": "qwen2_5", "qwen3-8b": "qwen3",
             "gemma-2-9b-it": "gemma", "gemma-3-4b-it": "gemma3", "phi-3-mini-4k-instruct": "phi3",
             "gemma-4-e2b-it": "gemma4_v5", "gpt-oss-20b": "gptoss"}
END = {"llama-3.1-8b-instruct": "<|eot_id|>", "qwen2.5-7b-instruct": "<|im_end|>", "qwen3-8b": "<|im_end|>",
       "gemma-2-9b-it": "<end_of_turn>", "gemma-3-4b-it": "<end_of_turn>", "phi-3-mini-4k-instruct": "<|end|>",
       "gemma-4-e2b-it": "<turn|>", "gpt-oss-20b": "<|return|>"}
# What the template puts after the reply's end-of-turn token (never trained: generation has stopped)
AFTER = {"llama-3.1-8b-instruct": "", "qwen2.5-7b-instruct": "\n", "qwen3-8b": "\n", "gemma-2-9b-it": "\n",
         "gemma-3-4b-it": "\n", "phi-3-mini-4k-instruct": "", "gemma-4-e2b-it": "\n", "gpt-oss-20b": ""}
# GPT-OSS (harmony) ends an earlier reply with <|end|> and the last with <|return|>, and writes every reply in its
# final channel: the model generates the channel's header after the generation prompt (<|start|>assistant)
EARLIER_END = {"gpt-oss-20b": "<|end|>"}
EARLIER_BEFORE = {"gpt-oss-20b": "<|channel|>final<|message|>"}
# What the template closes the conversation with after the last reply, trained with it: Phi-3 ends with its EOS (the
# tokenizer's <|endoftext|>; generation stops at <|end|> or at it), as TRL's phi3_training template trains too.
TAIL = {"phi-3-mini-4k-instruct": "\n<|endoftext|>"}
# What the model generates after the generation prompt before the reply's text: Qwen3 (thinking mode, the default)
# renders the last reply with its reasoning block, empty when there is none.
BEFORE = {"qwen3-8b": "<think>\n\n</think>\n\n", "gpt-oss-20b": "<|channel|>final<|message|>"}
CORPUS = ["How many apples are there? 5 apples and 3 pears make 8 fruits.", "Solve it step by step. #### 42",
          "You are a helpful assistant. Be brief.", "Natalia sold clips to 48 of her friends in April."] * 8
CHAT = DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096)


def stand_in_tokenizer(name: str):
    """A small byte-level BPE with `name`'s special and added tokens, bos/eos/pad and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((FIXTURES / name / "tokens.json").read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=cfg["special"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in cfg["added"]])
    named = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token") if cfg[k]}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    fast.chat_template = (FIXTURES / name / "chat_template.jinja").read_text()
    return fast


@pytest.fixture(params=MODELS)
def model(request):
    return request.param, stand_in_tokenizer(request.param)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def trained_runs(tok, enc: dict) -> list[str]:
    """Each run of consecutive trained tokens, decoded with its special tokens."""
    runs, run = [], []
    for token, label in zip(enc["input_ids"], enc["labels"]):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [tok.decode(r) for r in runs + ([run] if run else [])]


def untrained_text(tok, enc: dict) -> str:
    return tok.decode([t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab == IGNORE])


@pytest.mark.parametrize("name", MODELS)
def test_each_template_is_trls_original(name):
    """The fixture is byte for byte the original TRL keeps for this model (where TRL is installed)."""
    trl = pytest.importorskip("trl")
    original = Path(trl.__file__).parent / "chat_templates" / f"{TRL_NAMES[name]}.jinja"
    ours = (FIXTURES / name / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(ours).hexdigest() == hashlib.sha256(original.read_bytes()).hexdigest()


def test_a_reply_is_trained_after_the_inference_prompt(model):
    name, tok = model
    messages = [user("How many apples are there?"), assistant("5 apples")]
    text, _ = render_chat(messages, tok)
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text == prompt + BEFORE.get(name, "") + "5 apples" + END[name] + TAIL.get(name, "") + AFTER[name]
    enc = encode_example({"messages": messages}, tok, CHAT)
    assert trained_runs(tok, enc) == [BEFORE.get(name, "") + "5 apples" + END[name] + TAIL.get(name, "")]
    assert untrained_text(tok, enc) == prompt + AFTER[name]  # the prompt (and the newline after the stop token)
    assert check_eos_trained([enc["labels"]], tok)[0][1] == "pass"


def test_every_reply_of_a_multi_turn_chat_is_trained(model):
    name, tok = model
    messages = [user("2+3?"), assistant("5"), user("And 5+3?"), assistant("8")]
    text, _ = render_chat(messages, tok)
    assert text.startswith(tok.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True))
    enc = encode_example({"messages": messages}, tok, CHAT)
    # Qwen3 shows reasoning only after the last user turn: the earlier reply is rendered (and trained) without it
    earlier = EARLIER_BEFORE.get(name, "") + "5" + EARLIER_END.get(name, END[name])
    assert trained_runs(tok, enc) == [earlier, BEFORE.get(name, "") + "8" + END[name] + TAIL.get(name, "")]


SYSTEM_KEPT = [m for m in MODELS if m != "gemma-2-9b-it"]


@pytest.mark.parametrize("name", SYSTEM_KEPT)
def test_a_system_prompt_stays_where_inference_puts_it(name):
    """Llama 3.1 puts it in its dated system block, Qwen2.5 in place of its default, Qwen3 as a system turn, Gemma 3
    before the first user message: in the prompt, never trained."""
    tok = stand_in_tokenizer(name)
    messages = [system("Be brief."), user("2+3?"), assistant("5")]
    enc = encode_example({"messages": messages}, tok, CHAT)
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert "Be brief." in prompt and untrained_text(tok, enc) == prompt + AFTER[name]
    assert trained_runs(tok, enc) == [BEFORE.get(name, "") + "5" + END[name] + TAIL.get(name, "")]


def test_templates_that_add_their_own_system_text():
    """Without a system prompt, Llama 3.1 still renders its dated system block and Qwen2.5 its default identity;
    both are prompt, and the reply is trained as with any other template."""
    defaults = [("llama-3.1-8b-instruct", "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"),
                ("qwen2.5-7b-instruct", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")]
    for name, default in defaults:
        tok = stand_in_tokenizer(name)
        enc = encode_example({"messages": [user("2+3?"), assistant("5")]}, tok, CHAT)
        assert default in untrained_text(tok, enc)
        assert trained_runs(tok, enc) == ["5" + END[name]]


def test_gemma_2_has_no_system_role_and_says_what_to_do():
    tok = stand_in_tokenizer("gemma-2-9b-it")
    with pytest.raises(LLMTrainError) as refused:
        encode_example({"messages": [system("Be brief."), user("2+3?"), assistant("5")]}, tok, CHAT)
    message = str(refused.value)
    assert "System role not supported" in message and "data.system_prompt" in message
    assert "first user message" in message


def test_qwen3_reasoning_in_the_last_reply_is_trained():
    tok = stand_in_tokenizer("qwen3-8b")
    reply = "<think>\nadd 5 and 3\n</think>\n\n8"
    enc = encode_example({"messages": [user("5+3?"), assistant(reply)]}, tok, CHAT)
    assert trained_runs(tok, enc) == [reply + "<|im_end|>"]


def test_qwen3_earlier_replies_with_reasoning_are_trained_as_the_history_shows_them():
    """A reasoning dataset's multi-turn rows carry <think>...</think> in every reply: Qwen3's template shows an earlier
    reply's answer alone, and such rows had been refused as a reply the template leaves out. A reply with no blank
    line after </think> (the template adds it) had been refused as text the template rewrites."""
    tok = stand_in_tokenizer("qwen3-8b")
    messages = [user("Hi"), assistant("<think>\ngreet\n</think>\n\nHello"), user("2+2?"),
                assistant("<think>\nadd\n</think>\n\n4")]
    enc = encode_example({"messages": messages}, tok, CHAT)
    assert trained_runs(tok, enc) == ["Hello<|im_end|>", "<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert "greet" not in tok.decode(enc["input_ids"])  # the earlier reasoning is not in the history, as inference
    tight = encode_example({"messages": [user("2+2?"), assistant("<think>\nadd\n</think>4")]}, tok, CHAT)
    assert trained_runs(tok, tight) == ["<think>\nadd\n</think>\n\n4<|im_end|>"]


def test_gpt_oss_reasoning_in_the_last_reply_is_trained_and_earlier_reasoning_is_dropped():
    """GPT-OSS's template renders a reply's `thinking` in its analysis channel for the last reply only (harmony drops
    earlier reasoning from the history): the last reply is trained with its reasoning and both channels' headers, as
    the model generates them after <|start|>assistant; the earlier one with its final channel alone."""
    tok = stand_in_tokenizer("gpt-oss-20b")
    messages = [user("2+3?"), {**assistant("5"), "thinking": "add 2 and 3"}, user("And 5+3?"),
                {**assistant("8"), "thinking": "add 5 and 3"}]
    enc = encode_example({"messages": messages}, tok, CHAT)
    assert trained_runs(tok, enc) == [
        "<|channel|>final<|message|>5<|end|>",
        "<|channel|>analysis<|message|>add 5 and 3<|end|><|start|>assistant<|channel|>final<|message|>8<|return|>"]
    assert "add 2 and 3" not in untrained_text(tok, enc)


def _trl_masks_beside_ours(name: str, training: str):
    """A two-turn chat through TRL's `{training}.jinja` (its `{% generation %}` blocks, return_assistant_tokens_mask)
    and through llmtrain's encoding, on the fixture `name`'s tokenizer, the same tokens (checked): the tokenizer, the
    chat, TRL's encoding, and the positions each trains."""
    trl = pytest.importorskip("trl")
    tok = stand_in_tokenizer(name)
    messages = [user("2+3?"), assistant("5 apples"), user("And 5+3?"), assistant("8")]
    template = (Path(trl.__file__).parent / "chat_templates" / f"{training}.jinja").read_text()
    theirs = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    enc = encode_example({"messages": messages}, tok, CHAT)
    assert theirs["input_ids"][: len(enc["input_ids"])] == enc["input_ids"]
    ours = {i for i, lab in enumerate(enc["labels"]) if lab != IGNORE}
    return tok, messages, theirs, ours, {i for i, m in enumerate(theirs["assistant_masks"]) if m}


@pytest.mark.parametrize("name, training", [("qwen2.5-7b-instruct", "qwen2_5_training"),
                                            ("gemma-2-9b-it", "gemma_training"),
                                            ("gemma-3-4b-it", "gemma3_training"),
                                            ("phi-3-mini-4k-instruct", "phi3_training")])
def test_trls_assistant_masks_train_ours_and_only_whitespace_more(name, training):
    """TRL's SFT assistant-only masks (its `{% generation %}` templates, return_assistant_tokens_mask) on the same
    chat and tokens: every token llmtrain trains, TRL trains too; what TRL trains beyond it is whitespace the model
    never generates (Qwen's newline of the generation prompt before the reply, the newline after the stop token)."""
    tok, _, theirs, ours, trl_trained = _trl_masks_beside_ours(name, training)
    assert ours <= trl_trained
    assert all(tok.decode([theirs["input_ids"][i]]).strip() == "" for i in trl_trained - ours)
    assert len(ours) >= 4  # "5 apples" + end, "8" + end


def test_trls_gpt_oss_masks_train_ours_and_the_generation_prompts_header_more():
    """TRL's gptoss_training template (its `{% generation %}` blocks) on the same chat and tokens: every token llmtrain
    trains, TRL trains too; beyond them TRL trains each reply's `<|start|>assistant`, which is GPT-OSS's generation
    prompt (add_generation_prompt writes it at inference, the model does not), and nothing else."""
    tok, messages, theirs, ours, trl_trained = _trl_masks_beside_ours("gpt-oss-20b", "gptoss_training")
    assert ours <= trl_trained and len(ours) >= 4
    more = sorted(trl_trained - ours)
    runs = [[more[0]]]
    for i in more[1:]:
        if i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    assert [tok.decode([theirs["input_ids"][i] for i in run]) for run in runs] == ["<|start|>assistant"] * 2
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|start|>assistant")


def test_doctors_data_checks_pass_on_gsm8k_style_chats(model, tmp_path):
    """Question/answer rows through each template (data.chat_template: true, a system prompt where the template has
    a system role), tokenised as finetune does: doctor's data checks (masks, stop token, budget) have no fail."""
    from llmtrain.config import Recipe
    from llmtrain.data.checks import check_data
    from llmtrain.data.prepare import prepare_datasets

    name, tok = model
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### "
                                        f"{a + b}"}) + "\n" for a, b in [(2, 3), (5, 8), (13, 21), (34, 55)]))
    data = {"path": str(rows), "format": "prompt_completion", "fields": {"prompt": "question", "completion": "answer"},
            "chat_template": True, "max_seq_len": 512, "cache_dir": str(tmp_path / "cache"),
            **({} if name == "gemma-2-9b-it" else {"system_prompt": "Solve it step by step. End with #### N."})}
    recipe = Recipe.model_validate({"model": {"name_or_path": "unused"}, "data": data, "output_dir": str(tmp_path)})
    train, eval_ds, stats, _ = prepare_datasets(recipe.data, tok, seed=0)
    checks = check_data(recipe, stats["train"], train, eval_ds, tok)
    assert [c for c in checks if c[1] == "fail"] == [] and ("eos trained", "pass") in [c[:2] for c in checks]
    assert stats["train"].examples == 4 and stats["train"].dropped == 0


def text_end_tokenizer():
    """Qwen2.5's template on a tokenizer that knows none of its tokens (as with Mistral's tokenizer, the issue's
    case): <|im_start|> and <|im_end|> are text, split into several pieces; the tokenizer's own EOS is </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (FIXTURES / "qwen2.5-7b-instruct" / "chat_template.jinja").read_text()
    return fast


def test_phi3s_end_of_turn_is_its_end_token_and_the_conversations_eos_is_not_part_of_it():
    """Phi-3 renders <|end|>, then <|endoftext|> after the conversation's last reply (trained there, as TRL's
    phi3_training trains it). The end of turn had been read as '<|end|>\\n<|endoftext|>': doctor called it text of
    several tokens that a server of the exported model needs as a stop string."""
    from llmtrain.data.chat import end_of_turn
    from llmtrain.data.checks import check_eos_trained
    from llmtrain.data.formats import encode_messages

    tok = stand_in_tokenizer("phi-3-mini-4k-instruct")
    assert end_of_turn(tok) == "<|end|>"
    _, labels = encode_messages([user("2+2?"), assistant("4")], tok, train_on_prompt=False)
    [(name, verdict, said)] = check_eos_trained([labels], tok, end_of_turn=end_of_turn(tok))
    assert verdict == "pass" and "several tokens" not in said and "stop string" not in said, said


def test_an_end_of_turn_that_is_text_is_trained_as_the_template_renders_it():
    """The reply is trained up to and including <|im_end|>, in however many pieces the tokenizer makes of it, and
    no </s> that the template never renders is appended; doctor's stop check passes on that and fails where the
    end of turn is not trained."""
    from llmtrain.data.chat import end_of_turn

    tok = text_end_tokenizer()
    assert len(tok("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1  # text, not one special token
    assert end_of_turn(tok) == "<|im_end|>"
    messages = [user("How many apples are there?"), assistant("5 apples"), user("And pears?"), assistant("3")]
    enc = encode_example({"messages": messages}, tok, CHAT)
    assert trained_runs(tok, enc) == ["5 apples<|im_end|>", "3<|im_end|>"]
    assert tok.eos_token_id not in enc["input_ids"]
    assert untrained_text(tok, enc).endswith("<|im_start|>assistant\n\n")  # the newline after the stop is prompt
    assert check_eos_trained([enc["labels"]], tok, end_of_turn="<|im_end|>")[0][1] == "pass"
    cut = [lab if i < len(enc["labels"]) - 3 else IGNORE for i, lab in enumerate(enc["labels"])]  # stop untrained
    assert check_eos_trained([cut], tok, end_of_turn="<|im_end|>")[0][1] == "fail"


def test_a_text_end_of_turn_is_where_generation_stops_as_the_tokens_it_was_trained_as():
    """The samplers stop at an end of turn the tokenizer splits (generate.Stops.sequences), read as the tokens every
    trained reply ends with (chat.turn_tokens); the completion's text is read without it, as a special token's
    would be; an end of turn that is one token is a stop id, not a sequence."""
    from types import SimpleNamespace

    from llmtrain.data.chat import turn_tokens
    from llmtrain.objectives.objective import stops_for

    tok = text_end_tokenizer()
    runs = turn_tokens(tok, "<|im_end|>")
    assert len(runs) == 1 and tok.decode(runs[0]) == "<|im_end|>" and len(runs[0]) > 1
    messages = [user("How many apples are there?"), assistant("5 apples."), user("And pears?"), assistant("3")]
    enc = encode_example({"messages": messages}, tok, CHAT)
    trained = [t for t in enc["labels"] if t != IGNORE]
    lm = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=tok.eos_token_id))
    stops = stops_for(lm, tok, "<|im_end|>")
    assert stops.sequences == runs and tok.eos_token_id in stops
    first = stops.end(trained)  # the first reply's end: where a sampler drawing these tokens stops
    assert tok.decode(trained[:first]) == "5 apples.<|im_end|>" and stops.ends(trained[:first])
    assert not stops.ends(trained[:first - 1]) and stops.end(trained[:first - 1]) is None
    assert stops.reply(tok.decode(trained[:first])) == "5 apples."
    assert turn_tokens(tok, "</s>") == () and stops_for(lm, tok, "</s>").sequences == ()


@needs(MISTRAL)
def test_on_mistrals_tokenizer_a_text_end_of_turn_ends_every_reply_with_a_run_the_samplers_stop_at(mistral):
    """`<|im_end|>` written into a template for Mistral's tokenizer: 7 pieces alone, `.<` merged after a period; the
    six after the first are what every reply ends with. `### End` has no such common run (`▁###` after a space): each
    way it is spelt alone is a run."""
    from llmtrain.data.chat import _BEFORE, turn_tokens

    (run,) = turn_tokens(mistral, "<|im_end|>")
    assert mistral.decode(run) == "|im_end|>"
    hashes = turn_tokens(mistral, "### End")
    assert len(hashes) == 2 and {mistral.decode(r).strip() for r in hashes} == {"### End"}
    for before in _BEFORE:
        for turn, runs in (("<|im_end|>", [run]), ("### End", hashes)):
            ids = mistral("The answer is 7" + before + turn, add_special_tokens=False)["input_ids"]
            assert any(tuple(ids[-len(r):]) == r for r in runs), (before, turn)


def test_an_end_of_turn_no_run_of_tokens_spells_fails_the_stop_check(monkeypatch):
    """Where no run of tokens reliably ends a reply with the template's text end of turn, generation could not stop
    at it: the check fails, saying so, instead of passing on the text."""
    import llmtrain.data.chat as chat

    tok = text_end_tokenizer()
    enc = encode_example({"messages": [user("How many apples are there?"), assistant("5 apples")]}, tok, CHAT)
    (name, status, says), = check_eos_trained([enc["labels"]], tok, end_of_turn="<|im_end|>")
    assert status == "pass" and "'<|im_end|>' is text of several tokens here: generation stops at them" in says
    monkeypatch.setattr(chat, "turn_tokens", lambda tokenizer, end: ())
    (name, status, says), = check_eos_trained([enc["labels"]], tok, end_of_turn="<|im_end|>")
    assert status == "fail" and "splits into pieces that change with the text before it" in says


def test_online_rl_is_told_whether_its_completions_can_stop_at_a_text_end_of_turn(monkeypatch, tmp_path):
    """doctor and finetune's data checks for online RL (format prompt): a text end of turn the samplers stop at is
    said to pass; one no run of tokens spells is a warning that completions run to rl.max_completion_tokens; an end
    of turn that is one token says nothing."""
    import llmtrain.data.chat as chat
    from llmtrain.config import Recipe
    from llmtrain.data.checks import check_completion_stop

    recipe = Recipe.model_validate({
        "model": {"name_or_path": "unused"}, "output_dir": str(tmp_path),
        "data": {"path": "prompts.jsonl", "format": "prompt", "chat_template": True},
        "rl": {"max_completion_tokens": 64, "rewards": [{"type": "format", "pattern": "####"}]}})
    tok = text_end_tokenizer()
    (name, status, says), = check_completion_stop(recipe, tok)
    assert (name, status) == ("completion stop", "pass") and "'<|im_end|>', text of several tokens" in says
    monkeypatch.setattr(chat, "turn_tokens", lambda tokenizer, end: ())
    (name, status, says), = check_completion_stop(recipe, tok)
    assert status == "warn" and "most at rl.max_completion_tokens=64" in says
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "</s>")  # one token: nothing to say
    assert check_completion_stop(recipe, tok) == []


def test_an_rl_prompt_the_completion_cannot_follow_is_refused_in_one_paragraph(tmp_path):
    """Online RL's prompt rows (audit 30): a template's own refusal (Gemma's alternation) had been jinja's traceback
    naming no row; a system prompt alone on Gemma rendered as `<bos><start_of_turn>model` (its text lost) and a
    template without a generation prompt left sampling after a finished turn, both without a word (TRL samples from
    them). Each is refused naming the file and row; a prompt ending with a reply where the template opens a new
    assistant turn after it (Llama 3.1's) still renders."""
    from datasets import Dataset

    from llmtrain.data.prepare import tokenize_dataset

    u, a, sys_ = user("hi"), assistant("yo"), system("Answer in French.")

    def prepared(name, prompt, **cfg):
        rows = Dataset.from_list([{"prompt": prompt}])
        return tokenize_dataset(rows, stand_in_tokenizer(name), DataConfig(
            path="x.jsonl", format="prompt", cache_dir=str(tmp_path), **cfg), "p.jsonl")[0][0]

    for name, prompt, says in (
            ("gemma-3-4b-it", [u, u], "p.jsonl, row 1: the chat template refused the conversation: Conversation roles "
                                      "must alternate"),
            ("gemma-3-4b-it", [sys_], "p.jsonl, row 1: message 1 (system: 'Answer in French.') does not appear")):
        with pytest.raises(LLMTrainError, match=re.escape(says)):
            prepared(name, prompt)
    closed = tmp_path / "closed.jinja"  # ChatML without a generation prompt
    closed.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    with pytest.raises(LLMTrainError, match="ending with a finished turn \\(the template opens no assistant turn"):
        prepared("qwen2.5-7b-instruct", [u], chat_template=str(closed))
    tok = stand_in_tokenizer("llama-3.1-8b-instruct")
    assert tok.decode(prepared("llama-3.1-8b-instruct", [u, a])["input_ids"]).endswith(
        "yo<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen3_without_thinking_renders_as_apply_chat_templates_keyword_and_trains_the_reply_alone():
    """data.chat_template_kwargs {enable_thinking: false} (TRL's chat_template_kwargs), on Qwen3's own template: the
    template with the variable set at its top (chat.read_template) renders a prompt exactly as transformers'
    apply_chat_template(..., enable_thinking=False) does, its generation prompt holding the empty reasoning block;
    so a messages row trains the reply alone (the default thinking mode trains the block with it), and an RL prompt
    (data.format prompt) ends with the block. A key a template cannot read, and rows not rendered as a chat, are
    refused naming the key."""
    from llmtrain.data.chat import read_template
    from llmtrain.data.formats import encode_prompt

    tok = stand_in_tokenizer("qwen3-8b")
    quiet = DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096,
                       chat_template_kwargs={"enable_thinking": False})
    template = read_template(quiet, tok)
    chat = [system("Be brief."), user("5+3?")]
    ours = tok.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    theirs = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert theirs != tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    row = {"messages": [user("5+3?"), assistant("8")]}
    assert trained_runs(tok, encode_example(row, tok, quiet)) == ["8<|im_end|>"]
    assert trained_runs(tok, encode_example(row, tok, CHAT)) == [BEFORE["qwen3-8b"] + "8<|im_end|>"]
    prompts = DataConfig(path="unused.jsonl", format="prompt", chat_template=True, max_seq_len=4096,
                         chat_template_kwargs={"enable_thinking": False})
    ids = encode_prompt({"prompt": "5+3?"}, tok, prompts, template=read_template(prompts, tok))["input_ids"]
    assert tok.decode(ids).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="'1st' is not a name a template can read"):
        DataConfig(path="x.jsonl", format="messages", chat_template_kwargs={"1st": True})
    with pytest.raises(ValueError, match="data.format text is never rendered through it; use data.format: messages"):
        DataConfig(path="x.jsonl", format="text", chat_template_kwargs={"enable_thinking": False})
