"""SFT on tool-use conversations (issue 57): TRL's conversational format with a `tools` column, assistant messages
that call tools (`tool_calls`) and `tool` messages with the results (llmtrain/data/tools.py), rendered through the
model's own chat template with its tools argument (data/chat.render_tool_chat). Trained: each assistant turn as the
template writes it, its tool calls included, with its end of turn; never the tools' schemas, the user's text or the
tools' results. Checked on Qwen2.5, Qwen3 and Llama 3.1's templates (tests/fixtures/templates, with the stand-in
tokenizers of test_chat_templates) and Mistral-7B-Instruct-v0.3's real tokenizer (../shared), against TRL's own
assistant masks where TRL keeps a training template for the model (Qwen2.5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MISTRAL, needs
from helpers import REPO
from test_chat_templates import CHAT, stand_in_tokenizer, trained_runs, untrained_text

from llmtrain.data.formats import IGNORE, encode_example, row_problem
from llmtrain.errors import LLMTrainError

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up a word's code.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "description": "the word"}},
                   "required": ["word"]}}}]
CALL = {"type": "function", "id": "abcdefghi", "function": {"name": "lookup", "arguments": {"word": "apple"}}}
CHATS = [{"role": "user", "content": "What is the code of apple?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "name": "lookup", "tool_call_id": "abcdefghi", "content": "XK-42"},
         {"role": "assistant", "content": "The code is XK-42."}]
# What each template trains: the turn that calls the tool (as the model must write it) and the reply after the result
TRAINED = {
    "qwen2.5-7b-instruct": ['<tool_call>\n{"name": "lookup", "arguments": {"word": "apple"}}\n</tool_call><|im_end|>',
                            "The code is XK-42.<|im_end|>"],
    # Qwen3 renders the last reply with its (empty) reasoning block, as inference generates it in thinking mode
    "qwen3-8b": ['<tool_call>\n{"name": "lookup", "arguments": {"word": "apple"}}\n</tool_call><|im_end|>',
                 "<think>\n\n</think>\n\nThe code is XK-42.<|im_end|>"],
    "llama-3.1-8b-instruct": ['{"name": "lookup", "parameters": {"word": "apple"}}<|eot_id|>',
                              "The code is XK-42.<|eot_id|>"],
    "mistral": ['[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "apple"}, "id": "abcdefghi"}]</s>',
                "The code is XK-42.</s>"],
    # a calling turn that ends otherwise than a reply: GPT-OSS's <|call|>, and Gemma 4's <|tool_response>, which it
    # writes after the calls in the same turn (both had been trained on through the tool's result to the final reply)
    "gpt-oss-20b": [' to=functions.lookup<|channel|>commentary json<|message|>{"word": "apple"}<|call|>',
                    "<|channel|>final<|message|>The code is XK-42.<|return|>"],
    "gemma-4-e2b-it": ['<|tool_call>call:lookup{word:<|"|>apple<|"|>}<tool_call|><|tool_response>',
                       "The code is XK-42.<turn|>"],
}


def tokenizer_for(name: str):
    if name == "mistral":
        if not MISTRAL.exists():
            pytest.skip(f"{MISTRAL} is not available")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(MISTRAL)
    return stand_in_tokenizer(name)


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_each_template_trains_the_tool_calls_and_replies_never_the_tools_or_their_results(name):
    tok = tokenizer_for(name)
    enc = encode_example({"messages": CHATS, "tools": TOOLS}, tok, CHAT)
    assert trained_runs(tok, enc) == TRAINED[name]
    shown = untrained_text(tok, enc)
    assert "Look up a word's code." in shown and "XK-42" in shown and "What is the code of apple?" in shown
    assert row_problem({"messages": CHATS, "tools": TOOLS}, CHAT) is None


def test_trls_assistant_masks_on_tool_calls_train_ours_and_only_whitespace_more():
    """TRL's SFTTrainer (assistant_only_loss, its qwen2_5_training template, tools passed as it passes them): the
    same token ids; every token llmtrain trains TRL trains; TRL's extra tokens are newlines the model never writes
    (the generation prompt's, and the one after <|im_end|>)."""
    trl = pytest.importorskip("trl")
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja").read_text()
    theirs = tok.apply_chat_template(CHATS, tools=TOOLS, chat_template=template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    enc = encode_example({"messages": CHATS, "tools": TOOLS}, tok, CHAT)
    assert theirs["input_ids"] == enc["input_ids"]
    ours = {i for i, label in enumerate(enc["labels"]) if label != IGNORE}
    trl_trained = {i for i, m in enumerate(theirs["assistant_masks"]) if m}
    assert ours <= trl_trained and len(ours) > 20
    assert {tok.decode([theirs["input_ids"][i]]) for i in trl_trained - ours} == {"\n"}


def test_json_strings_and_python_functions_give_the_same_rows(tmp_path, monkeypatch):
    """Tools as a JSON string (how a dataset keeps rows whose schemas differ), a call's arguments as a JSON string,
    and a tool named module:function (type hints and an Args docstring: transformers' get_json_schema, TRL's
    contract) render as the schemas and dicts do."""
    (tmp_path / "codebook.py").write_text('def lookup(word: str) -> str:\n    """Look up a word\'s code.\n\n'
                                          '    Args:\n        word: the word\n    """\n    return "XK-42"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    want = encode_example({"messages": CHATS, "tools": TOOLS}, tok, CHAT)
    as_strings = [dict(m) for m in CHATS]
    as_strings[1] = {**CHATS[1], "tool_calls": [{**CALL, "function": {"name": "lookup",
                                                                     "arguments": '{"word": "apple"}'}}]}
    assert encode_example({"messages": as_strings, "tools": json.dumps(TOOLS)}, tok, CHAT) == want
    described = [{"type": "function", "function": {**TOOLS[0]["function"], "return": {"type": "string"}}}]
    assert encode_example({"messages": CHATS, "tools": ["codebook:lookup"]}, tok, CHAT) == encode_example(
        {"messages": CHATS, "tools": described}, tok, CHAT) != want  # the schema says what it returns, too


@pytest.mark.parametrize(("row", "says"), [
    ({"tools": ["codebook_missing:lookup"]}, "the tool 'codebook_missing:lookup' cannot be imported"),
    ({"tools": ["json:dumps"]}, "the tool 'json:dumps' cannot be described to the model"),
    ({"tools": "[{"}, "'tools' is a string that is not JSON"),
    ({"tools": [5]}, "tool 1 is '5': give a JSON schema"),
    ({"messages": [CHATS[0], {"role": "assistant", "tool_calls": [{"function": {"name": "lookup",
                                                                                "arguments": "{word"}}]}]},
     "the arguments of the call to 'lookup' are not JSON"),
    ({"messages": [CHATS[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "a tool call is"),
])
def test_a_tool_that_cannot_be_shown_is_refused_naming_it(row, says):
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    with pytest.raises(LLMTrainError, match=says.replace("(", r"\(").replace("[", r"\[")):
        encode_example({"messages": CHATS, "tools": TOOLS, **row}, tok, CHAT)


@pytest.mark.parametrize(("source", "says"), [
    ('raise RuntimeError("missing API key")\n', "RuntimeError: missing API key. The module was found; fix the error"),
    ("def lookup(word: str) -> str\n    return word\n", "SyntaxError: expected ':'"),
])
def test_a_tool_module_that_fails_while_importing_is_one_paragraph(tmp_path, monkeypatch, source, says):
    """A tool module's own error (a syntax error, a raise at its top level) had been a traceback (audit 25); it is said
    as a reward function's is."""
    (tmp_path / "broken_tools.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    with pytest.raises(LLMTrainError, match=r"the tool 'broken_tools:lookup' cannot be imported: importing "
                                            rf"broken_tools failed: {says}"):
        encode_example({"messages": CHATS, "tools": ["broken_tools:lookup"]}, tok, CHAT)


def test_a_call_given_as_the_functions_object_alone_keeps_its_id():
    """{"id", "name", "arguments"} (the function's object alone, docs/tools.md) had lost its id, which Mistral's
    template requires."""
    from llmtrain.data.tools import tool_messages

    flat = {"id": "abcdefghi", "name": "lookup", "arguments": {"word": "apple"}}
    assert tool_messages([{"role": "assistant", "tool_calls": [flat]}], "the row")[0]["tool_calls"] == [CALL]


def test_a_conversational_prompt_completion_row_shows_its_tools_as_a_messages_row_does():
    """TRL's conversational prompt/completion row with a `tools` column: its calls had been trained with the schemas
    never shown (only format: messages read the column; audit 25). TRL's SFTTrainer passes them; so does llmtrain: the
    row encodes as the same chat in messages form does."""
    from llmtrain.config import DataConfig

    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    pc = DataConfig(path="unused.jsonl", format="prompt_completion", max_seq_len=4096)
    row = {"prompt": CHATS[:1], "completion": CHATS[1:], "tools": TOOLS}
    enc = encode_example(row, tok, pc)
    assert enc == encode_example({"messages": CHATS, "tools": TOOLS}, tok, CHAT)
    assert "Look up a word's code." in untrained_text(tok, enc) and row_problem(row, pc) is None


def test_a_template_without_tools_is_refused_in_one_paragraph():
    """Gemma 3's template never reads `tools` or `tool_calls`: transformers would render the chat without them and
    the model would learn replies to calls it never saw."""
    tok = stand_in_tokenizer("gemma-3-4b-it")
    with pytest.raises(LLMTrainError, match="the chat template never reads 'tools' or 'tool_calls'"):
        encode_example({"messages": CHATS, "tools": TOOLS}, tok, CHAT)
    assert encode_example({"messages": [CHATS[0], CHATS[3]]}, tok, CHAT)["trained"] > 0  # plain chats still train


def test_chats_without_tools_render_as_before():
    """A row with no tools, tool calls or tool messages takes the plain chat path, whatever its `tools` column
    holds for other rows (null or [] from a dataset)."""
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    plain = {"messages": [CHATS[0], CHATS[3]]}
    assert encode_example({**plain, "tools": None}, tok, CHAT) == encode_example(plain, tok, CHAT)
    assert encode_example({**plain, "tools": []}, tok, CHAT) == encode_example(plain, tok, CHAT)




def test_a_tool_use_dataset_prepares_and_trains_as_each_row_encodes(tmp_path):
    """A JSON-lines file of tool conversations with different tools and arguments (and one plain chat), read by
    datasets and prepared as a run prepares it: `inspect-data --json` gives each row's tokens and labels as
    encode_example gives them from the file's rows, and a 3-step run on a tiny Qwen2 with the stand-in Qwen2.5
    tokenizer trains on them (the loss falls)."""
    from helpers import cli, records, run_train
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    model = tmp_path / "model"
    tok.save_pretrained(model)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=False)).save_pretrained(model)
    weather = {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    rows = [{"messages": CHATS, "tools": TOOLS},
            {"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "weather",
                                                                "arguments": {"city": "Paris", "days": 2}}}]},
                          {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
             "tools": [weather]},
            {"messages": [CHATS[0], CHATS[3]]}]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {model}, dtype: float32}}\n"
                      f"data: {{path: {data}, format: messages, max_seq_len: 1024, cache_dir: {tmp_path / 'cache'}}}\n"
                      f"train: {{max_steps: 3, micro_batch_size: 3, lr: 3e-3}}\noutput_dir: {tmp_path / 'run'}\n")
    shown = [json.loads(line) for line in cli("inspect-data", str(recipe), "--json").stdout.splitlines()
             if line.startswith("{")]
    want = [encode_example(r, tok, CHAT) for r in rows]
    assert [(s["input_ids"], s["labels"]) for s in shown] == [(w["input_ids"], w["labels"]) for w in want]
    run_train(recipe)
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_rows_that_call_tools_without_schemas_are_counted_and_warned(tiny_assets, tmp_path):
    """Rows whose assistant turns call tools and give no `tools` trained without a word: the template shows no schema,
    and the model learns to call tools it is never shown. The preparation counts them (DataStats.untooled, over every
    row, a mixture's sources added up, as its empty replies now are: a mixture had counted none), and finetune's and
    doctor's data checks warn; the same rows with their tools do not."""
    from transformers import AutoTokenizer

    from llmtrain.config import load_recipe
    from llmtrain.data.checks import load_data
    from llmtrain.data.prepare import prepare_recipe

    rows = [json.loads(line) for line in (tiny_assets / "data" / "train_tools.jsonl").read_text().splitlines()]
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "tools"}) + "\n" for r in rows))
    calling = sum(any(m.get("tool_calls") for m in r["messages"]) for r in rows)
    assert 0 < calling < len(rows)
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    base = [f"model.name_or_path={tiny_assets / 'model'}", f"data.cache_dir={tmp_path / 'cache'}",
            f"data.chat_template={tiny_assets / 'data' / 'tools.jinja'}", "data.eval_split=null"]
    tools_recipe = REPO / "recipes" / "tiny-tools-sft.yaml"

    def warned(recipe) -> list[str]:
        return [text for name, status, text in load_data(recipe, tok) if name == "tool schemas" and status == "warn"]

    with_tools = load_recipe(tools_recipe, [*base, f"data.path={tiny_assets / 'data' / 'train_tools.jsonl'}"])
    assert prepare_recipe(with_tools, tok)[2]["train"].untooled == 0 and warned(with_tools) == []
    without = load_recipe(tools_recipe, [*base, f"data.path={bare}"])
    assert prepare_recipe(without, tok)[2]["train"].untooled == calling
    assert warned(without) == [f"{calling:,} of {len(rows):,} examples call tools and give no `tools`: the chat "
                               "template shows the model no schema, so it learns to call tools it is never shown. "
                               "Give each row its tools (a `tools` column of JSON schemas, TRL's format: "
                               "docs/tools.md); where a system message of the rows describes them, as some datasets' "
                               "do, this is as meant."]
    empty = tmp_path / "empty.jsonl"  # a source of empty replies beside it: the mixture counts both sources' rows
    empty.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                      {"role": "assistant", "content": ""}]}) + "\n"
                             for i in range(4)))
    mixture = load_recipe(tools_recipe, [*base, "data.path=null", f"data.sources=[{{path: {bare}, format: messages, "
                                         f"weight: 1}}, {{path: {empty}, format: messages, weight: 1}}]"])
    stats = prepare_recipe(mixture, tok)[2]["train"]
    assert (stats.untooled, stats.one_token) == (calling, 4)


@needs(MISTRAL)
def test_mistrals_tools_before_the_last_user_turn_only_refuse_an_earlier_turn_with_advice(mistral):
    """Mistral v0.3 renders [AVAILABLE_TOOLS] before the last user message: with a second user turn after the tool
    call, the call's turn would be trained after a prompt inference never gives it, so the row is refused."""
    later = [*CHATS, {"role": "user", "content": "And of pear?"}, {"role": "assistant", "content": "I do not know."}]
    with pytest.raises(LLMTrainError, match="Split the conversation into rows that end at each assistant turn"):
        encode_example({"messages": later, "tools": TOOLS}, mistral, CHAT)
    assert trained_runs(mistral, encode_example({"messages": CHATS, "tools": TOOLS}, mistral, CHAT)) == TRAINED[
        "mistral"]


def test_text_the_template_drops_beside_calls_or_as_a_result_is_refused_naming_the_message():
    """Llama 3.1's template writes a turn with tool calls as its call alone: text beside the calls would be dropped
    from training without a word (audit 25). A template that leaves the tools' results out would teach the model to
    answer without them. Both are refused naming the message, as a plain chat's unshown message is."""
    beside = [CHATS[0], {**CHATS[1], "content": "Let me look that up."}, *CHATS[2:]]
    with pytest.raises(LLMTrainError, match=r"message 2 \(assistant: 'Let me look that up.'\) has text beside its "
                                            "tool calls, and the chat template writes that turn as its calls alone"):
        encode_example({"messages": beside, "tools": TOOLS}, stand_in_tokenizer("llama-3.1-8b-instruct"), CHAT)
    qwen = stand_in_tokenizer("qwen2.5-7b-instruct")  # Qwen writes both: the text is trained before the call
    enc = encode_example({"messages": beside, "tools": TOOLS}, qwen, CHAT)
    assert trained_runs(qwen, enc)[0].startswith("Let me look that up.\n<tool_call>")
    dropped = qwen.chat_template.replace("{{- message.content }}\n        {{- '\\n</tool_response>' }}",
                                         "{{- '\\n</tool_response>' }}")
    assert dropped != qwen.chat_template
    with pytest.raises(LLMTrainError, match=r"message 3 \(tool: 'XK-42'\) is a tool's result that the chat template "
                                            "does not show"):
        _encode_with_template(dropped)


def _encode_with_template(template: str):
    from llmtrain.data.chat import render_tool_chat
    from llmtrain.data.tools import tool_messages

    return render_tool_chat(tool_messages(CHATS, "the row"), stand_in_tokenizer("qwen2.5-7b-instruct"),
                            template=template, tools=TOOLS)


def test_a_template_that_writes_the_result_inside_the_calling_turn_is_refused():
    """A template whose calling turn runs on through the result and the reply, closed once at the end (as Gemma 4's
    and GPT-OSS's seemed to be before their calling turns were read as they end when the chat stops there; those two
    are in TRAINED above): the model would learn to write the results. Refused once per template, by a probe chat."""
    template = ("{% for m in messages %}{% if m.role == 'user' %}<|USER|>{{ m.content }}"
                "{% elif m.role == 'tool' %}<r>{{ m.content }}</r>"
                "{% elif m.tool_calls %}<|A|>{% for c in m.tool_calls %}<call>{{ c.function | tojson }}</call>"
                "{% endfor %}{% if loop.last %}</s>{% endif %}"
                "{% else %}{% if not loop.previtem or loop.previtem.role != 'tool' %}<|A|>{% endif %}"
                "{{ m.content }}</s>{% endif %}{% endfor %}"
                "{% if add_generation_prompt and messages[-1].role != 'tool' %}<|A|>{% endif %}{# tools #}")
    with pytest.raises(LLMTrainError, match="writes a tool's result inside the assistant turn that called it"):
        _encode_with_template(template)


HERMES = [CHATS[0], {"role": "assistant", "content": '<tool_call>{"name": "lookup", "arguments": {"word": "apple"}}'
                                                     "</tool_call>"}, CHATS[2], CHATS[3]]


@pytest.mark.parametrize(("messages", "says"), [
    ([CHATS[0], {"role": "assistant", "tool_calls": [{"function": {"name": "lookup", "parameters": {"word": "a"}}}]}],
     "message 2: the call to 'lookup' has no 'arguments' but 'parameters'"),  # Llama 3.1's key: it had been {}
    ([CHATS[0], {"role": "assistant", "tool_calls": [{"name": "lookup", "args": {"word": "a"}}]}],
     "the call to 'lookup' has no 'arguments' but 'args'"),
    ([CHATS[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "lookup_code", "arguments": {}}}]}],
     "message 2: a call to 'lookup_code', which the row's tools do not define \\(they define lookup\\)"),
    ([CHATS[0], CHATS[2], CHATS[3]], "message 2: a tool result that answers no call \\(it follows a user message"),
    ([CHATS[0], CHATS[1], {**CHATS[2], "tool_call_id": "zzzzzzzzz"}, CHATS[3]],
     "message 3: a tool result for tool_call_id 'zzzzzzzzz', which no call of the assistant turn before it has"),
    ([CHATS[0], {"role": "assistant", "content": "", "tool_calls": []}, CHATS[2], CHATS[3]],
     "message 2: an assistant turn with no text and no tool calls"),  # calls stripped: a bare end of turn trained
])
def test_a_tool_conversation_that_cannot_be_meant_is_refused_naming_the_message(messages, says):
    """TRL trains each of these (audit 52): a misspelt arguments key as empty arguments, calls of tools never shown,
    results that answer nothing, a turn whose calls were stripped as the model's stopping at once."""
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    with pytest.raises(LLMTrainError, match=says):
        encode_example({"messages": messages, "tools": TOOLS}, tok, CHAT)


def test_calls_written_as_text_and_calls_without_arguments_still_train():
    """A turn whose call is text in its content (Hermes' rows) is answered by the tool message after it, and a call
    of a tool with no arguments is {"name"} alone (with a call's own keys beside it where it is the function's
    object alone: its id and type, null where a dataset filled them); an empty id is no id."""
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    assert encode_example({"messages": HERMES, "tools": TOOLS}, tok, CHAT)["trained"] > 0
    for call in ({"name": "lookup"}, {"id": "abcdefghi", "type": "function", "name": "lookup", "index": 0},
                 {"id": None, "name": "lookup", "arguments": None}):
        bare = [CHATS[0], {"role": "assistant", "tool_calls": [call]}, {**CHATS[2], "tool_call_id": ""}, CHATS[3]]
        runs = trained_runs(tok, encode_example({"messages": bare, "tools": TOOLS}, tok, CHAT))
        assert '"arguments": {}' in runs[0], call


def test_preference_pairs_and_kto_rows_show_the_rows_tools_and_may_reject_a_call_of_another_tool():
    """DPO and reward-model pairs had dropped a row's tools (TRL passes them) and refused an answer that only calls a
    tool as empty; each answer now encodes as the SFT row {prompt, completion: answer, tools} does. A rejected (or
    undesirable) answer that calls a tool the row does not define is what such data teach against; a chosen one is
    refused as SFT refuses it."""
    from llmtrain.config import DataConfig
    from llmtrain.data.pairs import encode_pair, pair_problem, split_pair
    from llmtrain.data.unpaired import encode_unpaired

    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    pc = DataConfig(path="unused.jsonl", format="prompt_completion", max_seq_len=4096)
    prefs = DataConfig(path="unused.jsonl", format="preference", max_seq_len=4096)
    call = {"role": "assistant", "content": None, "tool_calls": [CALL]}  # OpenAI's content of a call-only turn
    wrong = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
    row = {"prompt": CHATS[:1], "chosen": [call], "rejected": [wrong], "tools": TOOLS}
    assert pair_problem(row, prefs) is None
    pair = encode_pair(row, tok, prefs)
    for side, answer in (("chosen", call), ("rejected", wrong)):
        sft = encode_example({"prompt": CHATS[:1], "completion": [answer], "tools": TOOLS}, tok, pc, rejected=True)
        assert (pair[f"{side}_ids"], pair[f"{side}_labels"]) == (sft["input_ids"], sft["labels"])
    assert "Look up a word's code." in untrained_text(tok, {"input_ids": pair["chosen_ids"],
                                                            "labels": pair["chosen_labels"]})
    with pytest.raises(LLMTrainError, match="a call to 'search', which the row's tools do not define"):
        encode_pair({**row, "chosen": [wrong], "rejected": [call]}, tok, prefs)
    # whole conversations: two call-only turns that call other tools are where the answers part, not a shared prompt
    result, reply = CHATS[2], CHATS[3]
    wrong_id = {**wrong, "content": None, "tool_calls": [{"id": "zzzzzzzzz", "function": {"name": "search",
                                                                                         "arguments": {}}}]}
    whole = {"chosen": [CHATS[0], call, result, reply], "tools": TOOLS,
             "rejected": [CHATS[0], wrong_id, {**result, "tool_call_id": "zzzzzzzzz"}, reply]}
    assert split_pair(whole, prefs) == (CHATS[:1], whole["chosen"][1:], whole["rejected"][1:])
    assert encode_pair(whole, tok, prefs)["drop"] == ""
    kto = DataConfig(path="unused.jsonl", format="unpaired", max_seq_len=4096, fields={"tools": "functions"})
    unpaired = {"prompt": CHATS[:1], "completion": [wrong], "functions": TOOLS}
    assert encode_unpaired({**unpaired, "label": False}, tok, kto)["label"] is False
    with pytest.raises(LLMTrainError, match="a call to 'search'"):
        encode_unpaired({**unpaired, "label": True}, tok, kto)


def test_an_rl_prompts_earlier_calls_are_shown_as_a_training_rows_are():
    """A call's arguments as a JSON string (OpenAI's) had been shown twice encoded in an RL prompt, and a call given
    as the function's object alone refused by the template, where SFT rows normalise both."""
    from llmtrain.config import DataConfig
    from llmtrain.data.formats import encode_prompt

    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    cfg = DataConfig(path="unused.jsonl", format="prompt", max_seq_len=4096)
    as_string = {**CALL, "function": {"name": "lookup", "arguments": json.dumps({"word": "apple"})}}
    alone = {"id": "abcdefghi", "name": "lookup", "arguments": {"word": "apple"}}
    shown = [encode_prompt({"prompt": [CHATS[0], {"role": "assistant", "content": None, "tool_calls": [c]},
                                       CHATS[2]]}, tok, cfg, tools=TOOLS)["input_ids"]
             for c in (CALL, as_string, alone)]
    assert shown[0] == shown[1] == shown[2]
    assert '"arguments": {"word": "apple"}' in tok.decode(shown[1])
