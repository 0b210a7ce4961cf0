"""Data as people have it, rendered through a chat template as inference renders it.

Question/answer rows through the model's chat template (`data.chat_template: true`, `data.system_prompt`), TRL's
conversational prompt-completion, ShareGPT `conversations` through `data.fields` / `data.roles`, a template
file, and eval data from a dataset's own split with a cap. The Mistral tests use the real
Mistral-7B-Instruct-v0.3 tokenizer and template and GSM8K from ../shared (skipped where absent): its template
shows the system prompt only on the last user turn, and a reply that starts with a digit follows [/INST] as a
lone "▁" token that the model has to generate.
"""

from __future__ import annotations

import pytest
from conftest import GSM8K, MISTRAL, REPO, needs

# mistral and tiny_tok are fixtures: imported, pytest finds them here too
from test_data import gsm8k, trained_segments, write_jsonl

from llmtrain.config import DataConfig, load_recipe
from llmtrain.data.chat import render_chat
from llmtrain.data.formats import IGNORE, chat_of, encode_example
from llmtrain.data.prepare import prepare_datasets
from llmtrain.data.sources import is_split_name
from llmtrain.errors import LLMTrainError, RecipeError

GSM8K_CHAT = DataConfig(path="unused.jsonl", format="prompt_completion", chat_template=True, max_seq_len=4096,
                        fields={"prompt": "question", "completion": "answer"})


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def inference_prompt(tok, messages: list[dict], template: str | None = None) -> list[int]:
    """The token ids a chat model is given to answer `messages` (what generation sees)."""
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def refusal(cfg: DataConfig, tok) -> str:
    """The message prepare_datasets stops with."""
    with pytest.raises(LLMTrainError) as err:
        prepare_datasets(cfg, tok, seed=0)
    return str(err.value)


def trained_tokens(tok, enc: dict) -> list[list[str]]:
    """Each run of consecutive trained tokens, as token strings."""
    return [tok.convert_ids_to_tokens(s) for s in trained_segments(enc["input_ids"], enc["labels"])]


# --------------------------------------------------------------------------- question/answer through the template


@needs(MISTRAL)
@needs(GSM8K)
def test_gsm8k_through_the_mistral_template_trains_all_that_generation_produces(mistral):
    """The prompt is token for token what inference gives the model, and every token after it is trained,
    down to </s>: also the lone "▁" that follows [/INST] before an answer starting with a digit."""
    lone = mistral.convert_tokens_to_ids("▁")
    alone = 0
    for ex in gsm8k(200):
        messages, first = chat_of(ex, GSM8K_CHAT)
        assert (messages, first) == ([user(ex["question"]), assistant(ex["answer"])], 1)
        text, _ = render_chat(messages, mistral)
        assert text == f"<s>[INST] {ex['question']}[/INST] {ex['answer'].strip()}</s>"
        enc = encode_example(ex, mistral, GSM8K_CHAT)
        ids, labels = enc["input_ids"], enc["labels"]
        prompt = inference_prompt(mistral, messages[:1])
        k = len(prompt)
        assert ids[:k] == prompt and mistral.convert_ids_to_tokens(ids[k - 1]) == "[/INST]"
        assert labels == [IGNORE] * k + ids[k:] and ids[-1] == mistral.eos_token_id
        alone += ids[k] == lone
    assert alone == 7  # the GSM8K rows (of the first 200) whose answer starts with a digit


@needs(MISTRAL)
@pytest.mark.parametrize("reply, tokens", [
    ("5 apples", ["▁", "5", "▁ap", "ples", "</s>"]),      # a digit: the template's space is its own token
    (" 5 apples", ["▁", "5", "▁ap", "ples", "</s>"]),     # a space: the template trims it
    ("\n5 apples", ["▁", "5", "▁ap", "ples", "</s>"]),    # a newline: likewise
    ("\n\nFive apples", ["▁Five", "▁ap", "ples", "</s>"]),  # a word: the space joins it
    ("#### 72", ["▁####", "▁", "7", "2", "</s>"]),
])
def test_replies_starting_with_a_digit_a_space_or_a_newline(mistral, reply, tokens):
    for sys_prompt in (None, "Solve it step by step."):
        cfg = GSM8K_CHAT.model_copy(update={"system_prompt": sys_prompt})
        enc = encode_example({"question": "How many apples?", "answer": reply}, mistral, cfg)
        assert trained_tokens(mistral, enc) == [tokens]
        end_inst = enc["input_ids"].index(mistral.convert_tokens_to_ids("[/INST]"))
        assert enc["labels"][: end_inst + 1] == [IGNORE] * (end_inst + 1)
        assert enc["labels"][end_inst + 1:] == enc["input_ids"][end_inst + 1:]


@needs(MISTRAL)
@needs(GSM8K)
def test_system_prompt_is_where_inference_puts_it(mistral):
    """Mistral-7B-Instruct-v0.3 shows the system prompt only on the last user turn: its plain rendering of
    [system, user, assistant] has no system text. The training text is the inference prompt plus the reply."""
    ex = gsm8k(1)[0]
    messages = [system("Solve it step by step."), user(ex["question"]), assistant(ex["answer"])]
    assert "step by step" not in mistral.apply_chat_template(messages, tokenize=False)  # what went wrong before
    for cfg, row in [(GSM8K_CHAT.model_copy(update={"system_prompt": "Solve it step by step."}), ex),
                     (DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096), {"messages": messages}),
                     (DataConfig(path="unused.jsonl", format="messages", max_seq_len=4096,
                                 system_prompt="Solve it step by step."), {"messages": messages[1:]})]:
        assert chat_of(row, cfg)[0] == messages
        text, _ = render_chat(messages, mistral)
        assert text == f"<s>[INST] Solve it step by step.\n\n{ex['question']}[/INST] {ex['answer']}</s>"
        enc = encode_example(row, mistral, cfg)
        prompt = inference_prompt(mistral, messages[:2])
        assert enc["input_ids"][: len(prompt)] == prompt
        assert enc["labels"] == [IGNORE] * len(prompt) + enc["input_ids"][len(prompt):]


@needs(MISTRAL)
def test_multi_turn_with_system_is_the_last_replys_inference_prompt(mistral):
    messages = [system("Be brief."), user("2+3?"), assistant("5"), user("And 4+4?"), assistant("\n8")]
    text, _ = render_chat(messages, mistral)
    assert text == "<s>[INST] 2+3?[/INST] 5</s>[INST] Be brief.\n\nAnd 4+4?[/INST] 8</s>"
    assert text == mistral.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True) + " 8</s>"
    cfg = DataConfig(path="unused.jsonl", format="messages")
    enc = encode_example({"messages": messages}, mistral, cfg)
    # both replies start with a digit: each one's "▁" after [/INST] is trained, and each one's </s>
    assert trained_tokens(mistral, enc) == [["▁", "5", "</s>"], ["▁", "8", "</s>"]]
    everything = encode_example({"messages": messages}, mistral, cfg.model_copy(update={"train_on_prompt": True}))
    assert everything["input_ids"] == enc["input_ids"] and everything["labels"] == enc["input_ids"]


# --------------------------------------------------------------------------- TRL conversational and ShareGPT


@needs(MISTRAL)
def test_trl_conversational_prompt_trains_only_the_completion(mistral):
    """A prompt that is a list of messages (a few-shot reply in it too) is rendered as a chat, with or without
    data.chat_template; only the completion, a message list or a string, is trained."""
    prompt = [system("Answer with a number."), user("2+3?"), assistant("5"), user("4+4?")]
    for completion in ([assistant("8")], "8"):
        for chat_template in (False, True):
            cfg = DataConfig(path="unused.jsonl", format="prompt_completion", chat_template=chat_template)
            row = {"prompt": prompt, "completion": completion}
            assert chat_of(row, cfg) == ([*prompt, assistant("8")], 4)
            enc = encode_example(row, mistral, cfg)
            assert trained_tokens(mistral, enc) == [["▁", "8", "</s>"]]
            assert enc["input_ids"][:-3] == inference_prompt(mistral, prompt)


@needs(MISTRAL)
def test_sharegpt_conversations_through_fields_and_roles(mistral, tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+3?"},
                               {"from": "gpt", "value": "5"}]},
            {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]}]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    cfg = DataConfig(path=str(path), format="messages", cache_dir=str(tmp_path / "cache"),
                     fields={"messages": "conversations", "role": "from", "content": "value"},
                     roles={"human": "user", "gpt": "assistant"})
    train, _, stats, _ = prepare_datasets(cfg, mistral, seed=0)
    plain = DataConfig(path="unused.jsonl", format="messages")
    same = [encode_example({"messages": [system("Be brief."), user("2+3?"), assistant("5")]}, mistral, plain),
            encode_example({"messages": [user("Say hi."), assistant("Hi!")]}, mistral, plain)]
    assert train["input_ids"] == [e["input_ids"] for e in same] and train["labels"] == [e["labels"] for e in same]
    assert [trained_tokens(mistral, e) for e in same] == [[["▁", "5", "</s>"]], [["▁Hi", "!", "</s>"]]]
    assert "Be brief" in mistral.decode(train["input_ids"][0])

    no_roles = cfg.model_copy(update={"roles": {}})
    assert refusal(no_roles, mistral) == (
        f"{path}, row 1: the conversation has no assistant message, so nothing would be trained (roles "
        "['gpt', 'human', 'system']; map yours to the template's with data.roles, e.g. {human: user, gpt: "
        "assistant}) (data.format=messages). 1 other row of it has a problem too (every row: a setting, not the "
        "data?). Fix or remove that row, or set data.format / data.fields / data.roles to match the file.")


def test_a_bad_row_is_named_by_its_first_place_in_the_file_with_how_many_others(tiny_tok, tmp_path):
    """An eval split shuffles the training rows, so the first bad row met was any row (row 147 of 300 where every
    row lacked data.roles); the refusal names the first in the file that part holds, and counts the others."""
    rows = [{"conversations": [{"from": "human", "value": f"say {i}"}, {"from": "gpt", "value": str(i)}]}
            for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(path), format="messages", cache_dir=str(tmp_path / "c"), eval_split=0.1,
                     fields={"messages": "conversations", "role": "from", "content": "value"})
    with pytest.raises(LLMTrainError) as e:
        prepare_datasets(cfg, tiny_tok, seed=0)
    first = int(str(e.value).split(", row ", 1)[1].split(":", 1)[0])
    assert first <= 5 and "35 other rows of it have a problem too (every row: a setting, not the data?)" in str(
        e.value)
    rows[6]["conversations"][1]["from"] = "human"  # one row alone: named, and no others counted
    path = write_jsonl(tmp_path / "one.jsonl", rows)
    with pytest.raises(LLMTrainError, match=r"one.jsonl, row 7: the conversation has no assistant message") as e:
        prepare_datasets(cfg.model_copy(update={"path": str(path), "roles": {"human": "user", "gpt": "assistant"},
                                               "eval_split": None}), tiny_tok, seed=0)
    assert "other row" not in str(e.value)


def test_messages_without_the_mapped_content_key_name_it(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "text": "hi"}]}])
    cfg = DataConfig(path=str(path), format="messages", cache_dir=str(tmp_path / "c"),
                     fields={"messages": "conversations", "role": "from", "content": "value"})
    with pytest.raises(LLMTrainError, match=r"row 1: message 1 \(human\) of 'conversations' has no 'value' \(its "
                                            r"text; map the key with data.fields.content\)"):
        prepare_datasets(cfg, tiny_tok, seed=0)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": [user("hi")], "completion": [user("again")]},
     "'completion' (completion) has no assistant message, so nothing would be trained (roles ['user']; map yours to "
     "the template's with data.roles, e.g. {human: user, gpt: assistant})"),
    ({"prompt": [user("hi")], "completion": None}, "'completion' (completion) is missing (no such key, or null)"),
    ({"prompt": [{"role": "user"}], "completion": "x"},
     "message 1 (user) of 'prompt' (prompt) has no 'content' (its text; map the key with data.fields.content)"),
    ({"prompt": "hi", "completion": {"role": "assistant", "content": "x"}},
     "'completion' (completion) is a dict, not text"),
    ({"prompt": 5, "completion": "x"},  # was rendered as the text '5' (issue 53)
     "'prompt' (prompt) is 5, an int, not text (quote it in the file if it is meant as text; a CSV or parquet "
     "column of numbers is read as numbers whatever the quotes: write such data as JSON lines, the value quoted)"),
    ({"prompt": "2 + 2", "completion": 4.0},
     "'completion' (completion) is 4.0, a float, not text (quote it in the file if it is meant as text; a CSV or "
     "parquet column of numbers is read as numbers whatever the quotes: write such data as JSON lines, the value "
     "quoted)"),
])
def test_conversational_rows_that_cannot_be_rendered_are_named(row, problem):
    from llmtrain.data.formats import row_problem

    assert row_problem(row, DataConfig(path="unused.jsonl", format="prompt_completion")) == problem


def test_unknown_fields_key_is_refused(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    cfg = DataConfig(path=str(path), format="prompt_completion", fields={"promt": "q"}, cache_dir=str(tmp_path / "c"))
    assert refusal(cfg, tiny_tok) == ("data.fields maps ['promt'], which data.format 'prompt_completion' does not "
                                      "read; it reads ['completion', 'content', 'prompt', 'role', 'tools']. Fix the "
                                      "names in data.fields.")


# --------------------------------------------------------------------------- template files and refusals

QA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}Question: {{ m.content }}\n"
               "{% else %}Answer: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}Answer:{% endif %}")
NO_SYSTEM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
                      "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


@needs(MISTRAL)
def test_template_file_renders_and_masks_like_the_tokenizers_own(mistral, tmp_path):
    template = tmp_path / "qa.jinja"
    template.write_text(QA_TEMPLATE)
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+3?", "answer": "5"}])
    cfg = GSM8K_CHAT.model_copy(update={"path": str(path), "chat_template": str(template),
                                        "cache_dir": str(tmp_path / "cache")})
    messages = [user("2+3?"), assistant("5")]
    text, spans = render_chat(messages, mistral, template=QA_TEMPLATE)
    assert text == "<s>Question: 2+3?\nAnswer: 5</s>\n"  # the template's newline after </s> is not generated
    assert [text[a:b] for a, b in spans] == [" 5"]
    train, _, _, hit = prepare_datasets(cfg, mistral, seed=0)
    enc = {"input_ids": train["input_ids"][0], "labels": train["labels"][0]}
    prompt = inference_prompt(mistral, messages[:1], QA_TEMPLATE)
    assert enc["input_ids"][: len(prompt)] == prompt and mistral.decode(prompt) == "<s>Question: 2+3?\nAnswer:"
    assert trained_tokens(mistral, enc) == [["▁", "5", "</s>"]]
    assert enc["labels"][-1] == IGNORE  # the "\n" after </s>

    assert prepare_datasets(cfg, mistral, seed=0)[3]
    template.write_text(QA_TEMPLATE.replace("Question:", "Q:"))
    assert not prepare_datasets(cfg, mistral, seed=0)[3]  # the template's text is part of the cache key


ROLE_COLON_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role + ': ' + m.content }}"
                       "{% if m.role == 'assistant' %}{{ '\\n' + eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@needs(MISTRAL)
def test_separator_and_newline_before_the_end_of_turn_are_trained_in_every_turn(mistral):
    """The generation prompt ends with "assistant:"; the model then generates " 5", a newline and </s>, in each
    turn. The newline the template puts after </s> is not generated."""
    messages = [user("2+3?"), assistant("5"), user("4+4?"), assistant("8")]
    text, _ = render_chat(messages, mistral, template=ROLE_COLON_TEMPLATE)
    assert text == "<s>user: 2+3?\nassistant: 5\n</s>\nuser: 4+4?\nassistant: 8\n</s>\n"
    enc = encode_example({"messages": messages}, mistral, DataConfig(path="unused.jsonl", format="messages"),
                         template=ROLE_COLON_TEMPLATE)
    assert trained_tokens(mistral, enc) == [["▁", "5", "<0x0A>", "</s>"], ["▁", "8", "<0x0A>", "</s>"]]
    assert enc["labels"][-1] == IGNORE
    prompt = inference_prompt(mistral, messages[:3], ROLE_COLON_TEMPLATE)
    assert enc["input_ids"][: len(prompt)] == prompt


@needs(MISTRAL)
def test_a_template_that_ends_a_reply_with_whitespace_alone_trains_eos_right_after_the_reply(mistral):
    """A base model's plain template ("role: content\\n"): the newline after the last reply, never trained, stood
    between the reply and the EOS appended to it, so the model never learnt to stop (eval loss 0.08, every sample
    right and then running on to the token limit). EOS now follows the reply, as TRL appends it to a completion."""
    plain = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    messages = [user("Hi"), assistant("Hello there")]
    enc = encode_example({"messages": messages}, mistral, DataConfig(path="unused.jsonl", format="messages"),
                         template=plain)
    assert trained_tokens(mistral, enc) == [["▁Hello", "▁there", "</s>"]]
    assert enc["input_ids"][-1] == mistral.eos_token_id and enc["labels"][-1] == mistral.eos_token_id
    assert mistral.decode(enc["input_ids"]) == "user: Hi\nassistant: Hello there</s>"


def test_template_file_for_a_tokenizer_without_one(tiny_tok, tmp_path):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_tok.name_or_path)
    bare.chat_template = None
    row = {"prompt": "reverse abc", "completion": "cba"}
    cfg = DataConfig(path="unused.jsonl", format="prompt_completion", chat_template=True)
    with pytest.raises(LLMTrainError, match="this tokenizer .* has none. Give a Jinja template file with "
                                            "data.chat_template: path/to/template.jinja"):
        encode_example(row, bare, cfg)
    template = tmp_path / "t.jinja"
    template.write_text(tiny_tok.chat_template)  # the tiny model's own template, as a file
    with_file = cfg.model_copy(update={"chat_template": str(template)})
    assert encode_example(row, bare, with_file) == encode_example(row, tiny_tok, cfg)
    missing = cfg.model_copy(update={"chat_template": str(tmp_path / "nope.jinja")})
    with pytest.raises(LLMTrainError, match=r"data.chat_template '.*nope.jinja' is not a file. Give the path of a "
                                            r"Jinja chat template, or true for the tokenizer's own."):
        encode_example(row, bare, missing)


@needs(MISTRAL)
def test_a_message_the_template_leaves_out_stops_naming_the_row(mistral, tmp_path):
    template = tmp_path / "no_system.jinja"
    template.write_text(NO_SYSTEM_TEMPLATE)
    rows = [{"messages": [user("2+3?"), assistant("5")]},
            {"messages": [system("Be brief and exact."), user("2+3?"), assistant("5")]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(path), format="messages", chat_template=str(template), cache_dir=str(tmp_path / "c"))
    assert refusal(cfg, mistral) == (
        f"{path}, row 2: message 1 (system: 'Be brief and exact.') does not appear in the text the chat template "
        "renders, so the model would never see it. Move its text into a message the template shows (e.g. the "
        "first user message), or give a template that shows it (data.chat_template: path/to/template.jinja).")


@needs(MISTRAL)
def test_a_conversation_the_template_refuses_names_the_row(mistral, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [user("a?"), user("b?"), assistant("c")]}])
    cfg = DataConfig(path=str(path), format="messages", cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=rf"^{path}, row 1: the chat template refused the conversation: After the "
                                            "optional system message, conversation roles must alternate"):
        prepare_datasets(cfg, mistral, seed=0)


@pytest.mark.parametrize("overrides, message", [
    (["data.format=alpaca", "data.chat_template=true"],
     "data: data.chat_template applies to formats prompt_completion, messages, preference, unpaired and prompt, not alpaca"),
    (["data.system_prompt=Be brief."],
     "data: data.system_prompt puts a system message in each chat the template renders, and nothing says these rows "
     "are rendered through the chat template: set data.chat_template: true (or a template file; a prompt that is a "
     "list of messages is rendered as a chat either way), or remove data.system_prompt"),
    # an RL recipe: the same rule for both keys (the kwargs had been taken and ignored for its plain-text prompts, and
    # the system prompt refused with "use data.format: messages", which RL cannot)
    (["data.chat_template_kwargs={enable_thinking: false}"],
     "data: data.chat_template_kwargs are variables the chat template reads, and nothing says these rows are "
     "rendered through the chat template: set data.chat_template: true (or a template file; a prompt that is a list "
     "of messages is rendered as a chat either way), or remove data.chat_template_kwargs"),
    (["data.format=text", "data.system_prompt=Be brief."],
     "data: data.system_prompt puts a system message in each chat the template renders, and nothing says these rows "
     "are rendered through the chat template: data.format text is never rendered through it; use data.format: "
     "messages, or remove data.system_prompt"),
])
def test_recipe_refuses_chat_keys_that_cannot_apply(overrides, message):
    recipe = "tiny-grpo.yaml" if "chat_template_kwargs" in overrides[0] else "tiny.yaml"
    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "recipes" / recipe, overrides)
    assert f"  - {message}\n" in str(err.value)
    if recipe == "tiny-grpo.yaml":  # said so, it renders them
        load_recipe(REPO / "recipes" / recipe, [*overrides, "data.chat_template=true"])


# --------------------------------------------------------------------------- eval data: a split, a cap


@pytest.mark.parametrize("value, split", [("test", True), ("validation[:100]", True), ("eval.jsonl", False),
                                          ("data/eval", False), (0.05, False), (["a.jsonl"], False)])
def test_eval_split_names_a_split_or_files(value, split):
    assert is_split_name(value) is split


def reversal_rows(words: list[str]) -> list[dict]:
    return [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}"} for w in words]


def test_eval_from_the_datasets_own_split_capped_in_seeded_order(tiny_tok, tmp_path):
    import datasets

    folder = tmp_path / "reverse"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", reversal_rows(["abc", "hello", "xy"]))
    test_rows = reversal_rows(["q", "rs", "tuv", "wxyz", "ab", "cde", "fghi", "jk", "lmn", "op"])
    write_jsonl(folder / "test.jsonl", test_rows)
    cfg = DataConfig(path=str(folder), format="prompt_completion", eval_split="test", cache_dir=str(tmp_path / "c"))

    train, evald, stats, _ = prepare_datasets(cfg, tiny_tok, seed=0)
    assert train["input_ids"] == [encode_example(r, tiny_tok, cfg)["input_ids"] for r in reversal_rows(
        ["abc", "hello", "xy"])]
    assert evald["input_ids"] == [encode_example(r, tiny_tok, cfg)["input_ids"] for r in test_rows]
    assert (stats["train"].examples, stats["eval"].examples) == (3, 10)

    capped = cfg.model_copy(update={"eval_max_examples": 4})
    order = datasets.Dataset.from_list(test_rows).shuffle(seed=5)["prompt"][:4]  # the first 4 in the seeded order
    _, evald, stats, _ = prepare_datasets(capped, tiny_tok, seed=5)
    assert evald["input_ids"] == [encode_example(r, tiny_tok, cfg)["input_ids"] for p in order
                                  for r in test_rows if r["prompt"] == p]
    assert stats["eval"].examples == 4 and len(set(order)) == 4
    assert prepare_datasets(capped, tiny_tok, seed=5)[1]["input_ids"] == evald["input_ids"]  # cached, the same
    assert prepare_datasets(capped, tiny_tok, seed=6)[1]["input_ids"] != evald["input_ids"]

    fraction = DataConfig(path=str(folder / "test.jsonl"), format="prompt_completion", eval_split=0.5,
                          eval_max_examples=2, cache_dir=str(tmp_path / "c"))
    train, evald, stats, _ = prepare_datasets(fraction, tiny_tok, seed=0)
    assert (len(train), len(evald), stats["eval"].examples) == (5, 2, 2)  # the held-out half, capped


def test_split_name_with_data_files_is_refused(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", reversal_rows(["abc"]))
    cfg = DataConfig(path=str(path), format="prompt_completion", eval_split="test", cache_dir=str(tmp_path / "c"))
    assert refusal(cfg, tiny_tok) == (
        f"data.eval_split 'test' is read as a split name, but data.path ['{path}'] is files, which have no splits. "
        "Give eval file(s) (with their extension), a fraction such as 0.05, or a hub dataset / dataset folder as "
        "data.path.")


def test_a_dropped_assistant_reply_gets_advice_for_a_reply_and_messages_count_from_1(tiny_tok):
    """A template that shows only the last reply drops an earlier one: the advice is about replies (not "move its
    text into the first user message", which fits a system prompt), and the message is counted from 1, as rows are."""
    from llmtrain.data.chat import render_chat

    last_only = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|{{ m['role'] | upper }}|>"
                 "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|ASSISTANT|>{% endif %}")
    chat = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "first reply"},
            {"role": "user", "content": "b?"}, {"role": "assistant", "content": "second"}]
    with pytest.raises(LLMTrainError) as err:
        render_chat(chat, tiny_tok, template=last_only)
    message = str(err.value)
    assert message.startswith("message 2 (assistant: 'first reply') does not appear in the text")
    assert "leaves that reply out" in message and "first user message" not in message


def test_a_template_that_cannot_render_a_reply_is_said_where_the_samplers_look_for_its_end_of_turn(tiny_tok):
    """Online RL, distillation and the eval samples stop a completion at the template's end of turn; a template that
    cannot render a two-message chat had made them run on to EOS without a word (audit 51): said, and the run goes on
    without it; a template that renders gives its end of turn."""
    import copy

    from llmtrain.objectives.objective import run_end_of_turn

    recipe = load_recipe(REPO / "recipes" / "tiny-grpo.yaml")
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no replies here') }}"
                         "{% endif %}{{ m.content }}<|end|>{% endfor %}")
    with pytest.warns(UserWarning, match="no replies here.*stop at the model's end-of-sequence token"):
        assert run_end_of_turn(recipe, tok) is None
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|end|>{% endfor %}"
    assert run_end_of_turn(recipe, tok) == "<|end|>"


@pytest.mark.parametrize("role, meant", [("Assistant", "assistant"), ("asistant", "assistant"),
                                         ("assistant ", "assistant"), ("gpt", "assistant"), ("model", "assistant"),
                                         ("User", "user"), ("context", None)])
def test_a_role_that_means_a_chat_role_under_another_name_is_refused(role, meant):
    """A row with an assistant reply and another under "Assistant" (or a typo, ShareGPT's gpt, Gemma's model) had
    trained the one and shown the other untrained, since templates match roles exactly (audit 50): refused naming the
    message and the data.roles mapping; a role of a template's own (context) passes, as does the mapping."""
    from llmtrain.data.formats import row_problem

    messages = [{"role": "user", "content": "reverse ab"}, {"role": role, "content": "ba"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "ba"}]
    cfg = DataConfig(path="unused.jsonl", format="messages")
    problem = row_problem({"messages": messages}, cfg)
    if meant is None:
        assert problem is None
    else:
        assert problem == (f"message 2 of 'messages' has the role {role!r}, which chat templates do not read as "
                           f"{meant!r} (they match roles exactly: a reply under another name is shown, never "
                           f"trained). Write {meant!r}, or map it with data.roles: {{\"{role}\": {meant}}}")
        assert row_problem({"messages": messages}, cfg.model_copy(update={"roles": {role: meant}})) is None
        assert row_problem({"messages": messages}, cfg.model_copy(update={"roles": {role: role}})) is None  # kept
