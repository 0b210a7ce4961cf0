"""Chats as text: render a conversation through its chat template exactly as inference will, and find the
character spans of what the model must generate there (each trained reply). formats.py tokenises that text
and turns the spans into the loss mask (encode_messages).
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

from llmtrain.config import DataConfig
from llmtrain.errors import LLMTrainError


def _mark(i: int) -> str:
    return f"\ue000{i}\ue001"  # private-use characters: never in real text, never merged with template markup


def _apply(tokenizer, messages: list[dict], template: str | None, *, generation_prompt: bool,
           tools: list[dict] | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt, tools=tools)
    except Exception as e:  # jinja's TemplateError, or the template's own raise_exception
        advice = ""
        if "system" in str(e).lower() and any(m.get("role") == "system" for m in messages):  # Gemma 1 and 2
            advice = (" This template has no system role: drop data.system_prompt (or the rows' system messages), or "
                      "put that text at the start of the first user message.")
        raise LLMTrainError(f"the chat template refused the conversation: {e}.{advice}") from None


def _not_shown(messages: list[dict], k: int) -> LLMTrainError:
    """Message k (0-based here, counted from 1 in what is said, as rows are) is not in the rendered text."""
    m = messages[k]
    if m["role"] == "assistant":
        fix = ("This template leaves that reply out (some show only the last assistant turn), so it cannot be trained. "
               "Give a template that renders every reply (data.chat_template: path/to/template.jinja), or keep only "
               "the last reply in the row.")
    else:
        fix = ("Move its text into a message the template shows (e.g. the first user message), or give a template "
               "that shows it (data.chat_template: path/to/template.jinja).")
    return LLMTrainError(
        f"message {k + 1} ({m['role']}: {m['content'][:40]!r}) does not appear in the text the chat template renders, "
        f"so the model would never see it. {fix}"
    )


def _marked_history(tokenizer, history: list[dict], template: str | None) -> str:
    """The inference prompt of `history` with each content replaced by its marker. It depends on the chat's shape
    (roles and count), not on its text, so it is rendered once per shape and tokenizer, not once per row."""
    marked = [{**m, "content": _mark(i)} for i, m in enumerate(history)]
    key = (template, json.dumps(marked, sort_keys=True, default=str))
    renders = _MARKED.setdefault(tokenizer, {})
    if key not in renders:
        if len(renders) >= 256:  # rows of many shapes: keep the memory bounded
            renders.clear()
        renders[key] = _apply(tokenizer, marked, template, generation_prompt=True)
    return renders[key]


# tokenizer -> {(template, shape): marked prompt, ("end of turn", template, its own template): end_of_turn}
_MARKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fill(pieces: list[str], text: str, messages: list[dict]) -> tuple[dict[int, tuple[int, int]], int] | None:
    """Match a marked rendering, split at its markers (`pieces`: [P0, "k0", P1, "k1", P2, ...]), against the start
    of `text`: the template pieces exactly, each marker as its message's content as given or trimmed (templates
    may `|trim` it). Returns (each message's content span, where the match ends), or None where `text` does not
    start that way (a marker shown twice included)."""
    order = [int(k) for k in pieces[1::2]]
    if len(set(order)) != len(order) or not text.startswith(pieces[0]):
        return None
    spans, pos = {}, len(pieces[0])
    for k, after in zip(order, pieces[2::2]):
        content = messages[k]["content"]
        shown = next((c for c in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip()))
                      if text.startswith(c + after, pos)), None)
        if shown is None:
            return None
        spans[k] = (pos, pos + len(shown))
        pos += len(shown) + len(after)
    return spans, pos


def _prompt_in(before: str, marked: str, history: list[dict]) -> str | None:
    """The inference prompt of `history` read off `before` (the same history rendered with the reply after it),
    when the marked prompt, its markers replaced by the contents as `before` shows them (as given, or trimmed),
    is where `before` starts: one template render per row saved. None where it is not (a template that renders the
    history otherwise once a reply follows, Mistral v0.3 with a system prompt, or that rewrites a content): then
    the prompt is rendered."""
    found = _fill(re.split("\ue000(\\d+)\ue001", marked), before, history)
    return None if found is None else before[:found[1]]


def _locate(marked: str, text: str, messages: list[dict]) -> dict[int, tuple[int, int]]:
    """Character span of each message's content in `text`, which the template rendered from `messages` as it
    rendered `marked` from the same messages with each content replaced by its marker.

    The markers' positions are exact, so a short reply ("ant") is never matched inside template markup
    (`<|assistant|>`) or an earlier turn. Templates may trim the content (Mistral's and Llama 3's do:
    `content|trim`), so each one is matched as given or stripped, between the exact template pieces around its
    marker. Only where a template rewrites content in another way are the contents searched for in turn.
    """
    pieces = re.split("\ue000(\\d+)\ue001", marked)  # [P0, "k0", P1, "k1", P2, ...]: markers in text order
    order = [int(k) for k in pieces[1::2]]
    for k in range(len(messages)):
        if k not in order and messages[k]["content"].strip():
            raise _not_shown(messages, k)
    found = _fill(pieces, text, messages)
    if found is not None and found[1] == len(text):
        return found[0]
    spans, cursor = {}, 0
    for k in order:
        for content in _shown_forms(messages[k]["content"]):
            if (start := text.find(content, cursor)) >= 0:
                break
        else:
            raise _not_shown(messages, k)
        spans[k], cursor = (start, start + len(content)), start + len(content)
    return spans


def _shown_forms(content: str) -> list[str]:
    """What a template may show of a message's content, in the order searched: trimmed, then (a reply with its
    reasoning, "<think>...</think>answer") the answer alone, as Qwen3 shows an earlier reply in the history (a
    multi-turn row of a reasoning dataset had been refused as a reply the template leaves out)."""
    forms = [content.strip()]
    if THINK_END in content and (answer := content.rsplit(THINK_END, 1)[1].strip()):
        forms.append(answer)
    return forms


THINK_END = "</think>"  # the end of a reply's reasoning block (Qwen3, DeepSeek-R1's distills)


def _reply_parts(messages: list[dict], last: int, tokenizer,
                 template: str | None) -> tuple[str, str, str, str | None]:
    """How the template renders the reply `messages[last]` after the inference prompt: (what it puts between
    the generation prompt and the content, the content as shown, what closes the turn, and the inference prompt
    of the history where it was rendered on the way: None where not, so render_chat renders it once, not twice)."""
    history, reply = messages[:last], messages[last]

    def around(hist: list[dict]) -> list[str]:  # the template's text before and after the reply's content
        parts = _apply(tokenizer, [*hist, {**reply, "content": _mark(last)}], template,
                       generation_prompt=False).split(_mark(last))
        if len(parts) != 2:
            raise _not_shown(messages, last) if len(parts) == 1 else LLMTrainError(
                f"the chat template shows message {last + 1} (assistant) {len(parts) - 1} times, so it is not clear "
                "which one to train. Give a template that shows it once (data.chat_template: path/to/template.jinja).")
        return parts

    before, after = around(history)
    full = _apply(tokenizer, messages[: last + 1], template, generation_prompt=False)
    if not (full.startswith(before) and full.endswith(after) and len(full) >= len(before) + len(after)):
        # The template parses the content itself (Qwen3 moves a "<think>...</think>" block of the last reply into its
        # own reasoning block): what it renders between the inference prompt and the end of the turn is the reply.
        prompt = _apply(tokenizer, history, template, generation_prompt=True)
        rendered = full[len(prompt):len(full) - len(after)]
        last_word = (reply["content"].rsplit(THINK_END, 1)[-1].split() or [""])[-1]  # "</think>4": 4
        if full.startswith(prompt) and full.endswith(after) and last_word in rendered:
            return "", rendered, after, prompt
        raise LLMTrainError(f"the chat template rewrites the text around message {last + 1} (assistant), so the reply "
                            "cannot be placed in the text. Give a template that renders it as written "
                            "(data.chat_template: path/to/template.jinja).")
    shown = full[len(before):len(full) - len(after)]
    if reply["content"].strip() and not shown.strip():
        raise _not_shown(messages, last)
    # The text before the reply is normally the inference prompt plus a separator (Mistral: " " after
    # [/INST]). Templates that move the system prompt to the last user turn (Mistral-7B-Instruct-v0.3) render
    # the history differently once a reply follows: then the separator is read off the same chat without it.
    without_system = [history[1:]] if history and history[0]["role"] == "system" else []
    for hist in [history, *without_system]:
        hist_before = before if hist is history else around(hist)[0]
        prompt = (hist is history and _prompt_in(before, _marked_history(tokenizer, history, template), history)
                  or _apply(tokenizer, hist, template, generation_prompt=True))
        if hist_before.startswith(prompt):
            return hist_before[len(prompt):], shown, after, prompt if hist is history else None
    raise LLMTrainError(f"the chat template renders the conversation before message {last + 1} (assistant) in a way "
                        "that does not continue its own generation prompt (add_generation_prompt=True), so the "
                        "reply cannot be placed after it as at inference. Give a template that does "
                        "(data.chat_template: path/to/template.jinja).")


def render_chat(messages: list[dict], tokenizer, *, template: str | None = None,
                first: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The training text of a chat, and the character spans the model must generate (each trained reply).

    The text is exactly what inference renders as the prompt of the last reply (the history with
    `add_generation_prompt=True`), followed by that reply as the template renders it. So the system prompt is
    where inference puts it, even with templates that show it only on the last user turn (Mistral v0.3), and
    every token the model generates after the generation prompt is trained: a separator the template puts
    before the content (Mistral's " " after [/INST], its own token before a digit), the content, and the end of
    the turn. Earlier replies are trained where they stand in that history (from `first` on: messages before
    it are the prompt). Messages after the last reply would carry no loss and are left out.
    """
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    sep, shown, after, prompt = _reply_parts(messages, last, tokenizer, template)
    history = messages[:last]
    if prompt is None:
        prompt = _apply(tokenizer, history, template, generation_prompt=True)
    spans = _locate(_marked_history(tokenizer, history, template), prompt, history)
    # An earlier reply stands in the history as a reply of its text alone: where the last one carries more (GPT-OSS's
    # `thinking`, rendered in its analysis channel for the last reply only), the separator of its text alone
    reply = messages[last]
    earlier = sep if set(reply) <= {"role", "content"} else _reply_parts(
        [*history, {"role": reply["role"], "content": reply["content"]}], last, tokenizer, template)[0]
    trained = []
    for k in sorted((k for k in spans if history[k]["role"] == "assistant" and k >= first), key=spans.get):
        a, b = spans[k]
        trained.append((a - len(earlier) if earlier and prompt.endswith(earlier, 0, a) else a, b))
    trained.append((len(prompt), len(prompt) + len(sep) + len(shown)))
    return prompt + sep + shown + after, trained


def template_source(tokenizer, template: str | None) -> str:
    """The Jinja text that renders the chats: `template`, or the tokenizer's (its default where it keeps several)."""
    source = template or tokenizer.chat_template or ""
    return source.get("default", "") if isinstance(source, dict) else source


def render_tool_chat(messages: list[dict], tokenizer, *, template: str | None = None, tools: list[dict] | None = None,
                     first: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """render_chat for a tool-use conversation (data/tools.py): the chat through its last assistant turn rendered
    with `tools`, and each assistant turn's span from the end of its generation prompt (the history before it
    rendered with add_generation_prompt=True) to its end of turn: its content and its tool calls as the template
    writes them, trained; the tools' schemas, the user's text and the tools' results (`tool` messages), not. The
    template must read the tools and the tool calls (transformers passes them; a template that never looks at them
    would drop them silently), show every message's text, and render each turn's history as its own generation
    prompt renders it."""
    source = template_source(tokenizer, template)
    calls = any(m.get("tool_calls") for m in messages)
    missing = [what for what, needed in (("tools", tools), ("tool_calls", calls)) if needed and what not in source]
    if missing:
        raise LLMTrainError(f"the chat template never reads {' or '.join(repr(m) for m in missing)}, so it cannot show "
                            "this conversation's tools or tool calls to the model (they would be dropped silently). "
                            "Use a model whose template renders tool calls (Llama 3.1, Qwen2.5, Qwen3, "
                            "Mistral-7B-Instruct-v0.3), or give one with data.chat_template: path/to/template.jinja.")
    if calls:
        _check_results_untrained(tokenizer, template)
    text, spans = _tool_spans(messages, tokenizer, template, tools, first)
    _check_shown(messages, text, spans, first)
    return text, spans


def _tool_spans(messages: list[dict], tokenizer, template: str | None, tools: list[dict] | None,
                first: int) -> tuple[str, list[tuple[int, int]]]:
    """render_tool_chat's text and trained spans. A turn with tool calls ends where the template ends it when the
    conversation stops there (GPT-OSS's `<|call|>`, Gemma 4's `<|tool_response>`), where that is a prefix of the whole
    text and comes before the template's plain end of turn (which, for those two, is the final reply's: their spans had
    run on over the tools' results)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    text = _apply(tokenizer, messages[: last + 1], template, generation_prompt=False, tools=tools)
    eot = end_of_turn(tokenizer, template)
    if not eot:
        raise LLMTrainError("the chat template renders nothing after an assistant turn, so where a turn with tool "
                            "calls ends cannot be read off the text. Give a template that closes each turn "
                            "(data.chat_template: path/to/template.jinja).")
    spans = []
    for k in range(first, last + 1):
        if messages[k]["role"] != "assistant":
            continue
        prompt = _apply(tokenizer, messages[:k], template, generation_prompt=True, tools=tools)
        end = text.find(eot, len(prompt))
        if not text.startswith(prompt) or end < 0:
            raise LLMTrainError(
                f"the chat template renders the conversation before message {k + 1} (assistant) differently once "
                "more messages follow (Mistral's puts the tools before the last user message only), so that turn "
                "cannot be trained after the prompt inference would give it. Split the conversation into rows that "
                "end at each assistant turn, or give a template that renders the history as it goes "
                "(data.chat_template: path/to/template.jinja).")
        if messages[k].get("tool_calls") and k < last:
            turn = _apply(tokenizer, messages[: k + 1], template, generation_prompt=False, tools=tools).rstrip()
            if len(prompt) < len(turn) < end and text.startswith(turn):
                end = len(turn)
        shown = text[len(prompt):end]
        for call in messages[k].get("tool_calls", []):
            if call["function"]["name"] not in shown:
                raise LLMTrainError(f"the chat template does not show the call to '{call['function']['name']}' in "
                                    f"message {k + 1} (assistant), so it cannot be trained. Give a template that "
                                    "renders tool calls (data.chat_template: path/to/template.jinja).")
        spans.append((len(prompt), end))
    return text, spans


def _check_shown(messages: list[dict], text: str, spans: list[tuple[int, int]], first: int) -> None:
    """Every message's text is in the rendered chat (an assistant turn's in its own trained span), as render_chat
    asks: Llama 3.1's and Mistral's templates write a turn with tool calls as the calls alone, dropping text beside
    them, and a template may leave a tool's result out (the model would learn to answer without it)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    turns = dict(zip([k for k in range(first, last + 1) if messages[k]["role"] == "assistant"], spans))
    for k, m in enumerate(messages[: last + 1]):
        content = m.get("content")
        if k in turns:
            where = text[slice(*turns[k])]
        else:  # between the trained turns around it (a result's "XK-42" is not found in the reply quoting it)
            start = max((b for j, (_, b) in turns.items() if j < k), default=0)
            where = text[start:min((a for j, (a, _) in turns.items() if j > k), default=len(text))]
        if not isinstance(content, str) or not content.strip():
            continue
        if any(form in where for form in [*_shown_forms(content), json.dumps(content)[1:-1].strip()]):
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            raise LLMTrainError(
                f"message {k + 1} (assistant: {content[:40]!r}) has text beside its tool calls, and the chat template "
                "writes that turn as its calls alone (Llama 3.1's and Mistral's do), so the text would not be "
                "trained. Leave the text out of the row (content: \"\"), or give a template that renders both "
                "(data.chat_template: path/to/template.jinja).")
        if m["role"] == "tool":
            raise LLMTrainError(
                f"message {k + 1} (tool: {content[:40]!r}) is a tool's result that the chat template does not show, "
                "so the model would learn to answer without seeing it. Give a template that renders tool messages' "
                "content (data.chat_template: path/to/template.jinja).")
        raise _not_shown(messages, k)


TOOL_RESULT_PROBE = "probe result 7f3a9c"
PROBE_IDS = ("abcdefghi", "bcdefghij")  # probe calls' ids (data/tools.py's too): Mistral's template wants 9 characters


def _check_results_untrained(tokenizer, template: str | None) -> None:
    """Refuse a template whose trained spans would take in a tool's result (the model taught to write the results
    itself): a probe chat (a call, its result, a reply) rendered once per tokenizer and template."""
    key = ("tool results", template, json.dumps(tokenizer.chat_template, sort_keys=True, default=str))
    renders = _MARKED.setdefault(tokenizer, {})
    if key in renders:
        return
    schema = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.", "parameters": {
        "type": "object", "properties": {}}}}
    probe = [{"role": "user", "content": "Call the probe."},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "id": PROBE_IDS[0], "function": {"name": "probe_tool", "arguments": {}}}]},
             {"role": "tool", "name": "probe_tool", "tool_call_id": PROBE_IDS[0], "content": TOOL_RESULT_PROBE},
             {"role": "assistant", "content": "Done."}]
    try:
        text, spans = _tool_spans(probe, tokenizer, template, [schema], 0)
    except LLMTrainError:  # a template that cannot render the probe: the row's own render says why, if it fails
        renders[key] = True
        return
    if any(TOOL_RESULT_PROBE in text[a:b] for a, b in spans):
        raise LLMTrainError(
            "the chat template writes a tool's result inside the assistant turn that called it, and where that turn "
            "ends cannot be told from the text, so the model would be trained to write the tools' results itself. "
            "Give a template that ends a turn with tool calls before the result "
            "(data.chat_template: path/to/template.jinja).")
    renders[key] = True


def closing(text: str, spans: list[tuple[int, int]], specials: tuple[str, ...] = ()) -> str:
    """What a rendered chat (render_chat's text and spans) shows after its final reply, without the whitespace
    after it: what training ends the final reply with ('' for a template that renders nothing there). With
    `specials` (their texts), up to its first special token: the end of the turn, where generation stops
    (end_of_turn). What follows that token ends the conversation, not the turn: Phi-3's <|endoftext|> after <|end|>,
    trained after the last reply as TRL trains it, had been called an end of turn of several tokens, a stop string
    a server needs."""
    after = text[spans[-1][1]:].rstrip()
    found = [(after.find(s), -len(s), s) for s in specials if s and s in after]
    if found:
        at, _, first = min(found)
        after = after[:at + len(first)]
    return after


def special_tokens(tokenizer) -> tuple[frozenset[int], tuple[str, ...]]:
    """The tokenizer's special tokens, ids and texts: the named ones (bos, eos, pad, additional_special_tokens) and
    every added token marked special. Llama 3's <|eot_id|> and Gemma's <end_of_turn> close a turn whether or not the
    tokenizer's config lists them as additional special tokens. Read once per tokenizer (and again when its vocabulary
    or special tokens change), not once per row: `added_tokens_decoder` is rebuilt on every access, a fifth of the
    data preparation for Mistral's ~770 control tokens when it was read per row."""
    key = (len(tokenizer), tuple(tokenizer.all_special_ids))
    known = _SPECIAL.get(tokenizer)
    if known is None or known[0] != key:
        added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                 if getattr(t, "special", False)}
        texts = tuple(dict.fromkeys([*tokenizer.all_special_tokens, *added.values()]))
        known = _SPECIAL[tokenizer] = (key, (frozenset(tokenizer.all_special_ids) | set(added), texts))
    return known[1]


_SPECIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its key, (ids, texts))


def end_of_turn(tokenizer, template: str | None = None) -> str:
    """The template's end of turn (`closing`), read off a two-message chat: rendered once per tokenizer and
    template (render_tool_chat asks for it for every row)."""
    key = ("end of turn", template, json.dumps(tokenizer.chat_template, sort_keys=True, default=str))
    renders = _MARKED.setdefault(tokenizer, {})
    if key not in renders:
        text, spans = render_chat([{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}],
                                  tokenizer, template=template)
        renders[key] = closing(text, spans, special_tokens(tokenizer)[1])
    return renders[key]


def template_file(cfg: DataConfig) -> str | None:
    """The Jinja text of data.chat_template when it names a file (what final/'s tokenizer is given, so it renders as
    training did); None for the tokenizer's own."""
    if not isinstance(cfg.chat_template, str):
        return None
    path = Path(cfg.chat_template)
    if not path.is_file():
        raise LLMTrainError(f"data.chat_template '{path}' is not a file. Give the path of a Jinja chat template, "
                            "or true for the tokenizer's own.")
    return path.read_text()


def data_tokenizer(tokenizer, cfg: DataConfig):
    """`tokenizer` (the model's) as a recipe's data is prepared with it: given data.chat_template's file as its
    template when it names one (final/'s tokenizer then renders as training did; data.chat_template_kwargs are not
    baked into it: a server passes its own). finetune, inspect-data, doctor and estimate-memory read the same rows
    from the same cache entry through it (the entry's key holds the tokenizer's template: inspect-data's had been
    another's, and a large dataset was tokenised twice; audit 39)."""
    if (template := template_file(cfg)) is not None:
        tokenizer.chat_template = template
    return tokenizer


def read_template(cfg: DataConfig, tokenizer=None) -> str | None:
    """The Jinja text of data.chat_template when it names a file; None for the tokenizer's own. With
    data.chat_template_kwargs, the template (the file's, or `tokenizer`'s own) with those variables set at its top
    (with_variables), so every render of it reads them as apply_chat_template's keyword arguments would be read."""
    text = template_file(cfg)
    if not cfg.chat_template_kwargs:
        return text
    if text is None:
        own = getattr(tokenizer, "chat_template", None)
        text = own.get("default") if isinstance(own, dict) else own
        if not isinstance(text, str):
            raise LLMTrainError("data.chat_template_kwargs sets variables of the chat template, and this tokenizer has "
                                "no (default) template: give one with data.chat_template: path/to/template.jinja")
    return with_variables(text, cfg.chat_template_kwargs)


def with_variables(template: str, variables: dict) -> str:
    """`template` with each of `variables` set before its first line, as a Jinja literal (Python's repr: strings,
    numbers, True/False/None, lists and dicts of them are Jinja's too). A template reads a variable set so exactly
    as one passed to apply_chat_template (Qwen3's `enable_thinking is defined and enable_thinking is false`); the
    tags strip nothing after them (transformers' trim_blocks drops a newline right after one, as after any tag)."""
    return "".join(f"{{%- set {name} = {value!r} %}}" for name, value in variables.items()) + template


# where a text end of turn is tokenized as a template puts it: after these, its first piece may merge with them
_BEFORE = ("a", "Z", "4", ".", "!", "?", ")", "]", "}", "\"", "'", "`", ":", ";", ",", " ", "\n", "\u4e2d", "=")


def text_turn(tokenizer, end_of_turn: str | None) -> str:
    """`end_of_turn` stripped where the tokenizer splits it into several tokens (text to it); "" where it is one token,
    or none."""
    turn = (end_of_turn or "").strip()
    return turn if turn and len(tokenizer(turn, add_special_tokens=False)["input_ids"]) > 1 else ""


def turn_tokens(tokenizer, end_of_turn: str | None) -> tuple[tuple[int, ...], ...]:
    """The token runs a reply ending with `end_of_turn` (closing: the template's end of turn) ends with, where the
    tokenizer splits it into several tokens (`<|im_end|>` in a template for a tokenizer that does not know it: 7 pieces
    of Mistral's); none where it is one token. Its first piece can merge with the reply's last character (`.<` is one
    token of Mistral's, `▁###` one after a space), so it is tokenized after each of `_BEFORE`: the run common to all of
    them where that is most of it (all its characters but two; a shorter one, `>`, would end a reply that only
    contains it), else each distinct run that spells it alone."""
    if not (turn := text_turn(tokenizer, end_of_turn)):
        return ()
    runs = []
    for before in _BEFORE:
        ids = tokenizer(before + turn, add_special_tokens=False)["input_ids"]
        alone = tokenizer(before, add_special_tokens=False)["input_ids"]
        runs.append(tuple(ids[len(alone):]) if ids[:len(alone)] == alone else tuple(ids))
    common: list[int] = []
    for column in zip(*(reversed(r) for r in runs)):
        if len(set(column)) > 1:
            break
        common.insert(0, column[0])
    text = tokenizer.decode(common, skip_special_tokens=False).strip()
    if len(common) >= 2 and turn.endswith(text) and len(text) >= max(len(turn) - 2, 2):
        return (tuple(common),)
    return tuple(dict.fromkeys(r for r in runs if tokenizer.decode(r, skip_special_tokens=False).strip() == turn))
