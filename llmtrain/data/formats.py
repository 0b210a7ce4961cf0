"""Formats: one raw row to text, then to tokens and a loss mask (alpaca, messages, prompt_completion, text).

Every example becomes `input_ids` and `labels` of equal length, with -100 in `labels` where no loss
falls. Labels are aligned with the inputs (not shifted); the collator shifts them per example so that
packing can never make the last token of one example predict the first token of the next.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from llmtrain.config import DataConfig
from llmtrain.data.chat import _apply, closing, read_template, render_chat, render_tool_chat, special_tokens
from llmtrain.data.tools import calls_only, is_tool_chat, tool_messages, tool_schemas
from llmtrain.errors import LLMTrainError

IGNORE = -100

# The columns each format reads, by their canonical names; `data.fields` maps them to dataset columns.
FORMAT_FIELDS = {
    "alpaca": ("instruction", "input", "output"),
    "messages": ("messages", "tools"),  # tools: a tool-use conversation's functions (data/tools.py)
    "prompt_completion": ("prompt", "completion", "tools"),  # tools: as messages', for conversational rows
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected", "tools"),  # tools: shown in the prompt of both answers (TRL's)
    "unpaired": ("prompt", "completion", "label", "tools"),  # KTO: a boolean label, true for a desirable completion
    "prompt": ("prompt",),  # online RL: the completions are sampled; the other columns go to the reward functions
}
# preference: implicit-prompt rows have none; the chat formats: tools only in tool-use rows
OPTIONAL_FIELDS = {"alpaca": {"input"}, "preference": {"prompt", "tools"}, "messages": {"tools"},
                   "prompt_completion": {"tools"}, "unpaired": {"tools"}}
CHAT_FORMATS = ("messages", "prompt_completion", "preference", "unpaired", "prompt")  # formats whose rows may be chats
# Prepared prompt rows (online RL) keep the user's columns under this prefix, apart from the ones preparation adds
# (input_ids, labels, length, row, prompt): a user column named `labels` or `row` reaches the reward functions as it
# is in the file.
USER = "user/"

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{ctx}. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)

# --------------------------------------------------------------------------- formatting and masking


def _column(example: dict, cfg: DataConfig, field: str) -> Any:
    return example.get(cfg.fields.get(field, field))


def absent_fields(columns: list[str], cfg: DataConfig) -> list[str]:
    """The fields data.format needs (its optional ones left out) whose columns (data.fields maps them) `columns`
    lack."""
    return [f for f in FORMAT_FIELDS[cfg.format]
            if f not in OPTIONAL_FIELDS.get(cfg.format, ()) and cfg.fields.get(f, f) not in columns]


def check_columns(columns: list[str], cfg: DataConfig, source: str) -> None:
    known = set(FORMAT_FIELDS[cfg.format]) | ({"role", "content"} if cfg.format in CHAT_FORMATS else set())
    unknown = sorted(set(cfg.fields) - known)
    if unknown:
        raise LLMTrainError(f"data.fields maps {unknown}, which data.format '{cfg.format}' does not read; it reads "
                            f"{sorted(known)}. Fix the names in data.fields.")
    if absent := absent_fields(columns, cfg):
        missing = [f"{f} (column '{cfg.fields.get(f, f)}')" for f in absent]
        shown = [c for c in columns if not c.startswith("__llmtrain")]  # (the row-number column is llmtrain's own)
        chats = (" Its rows hold a 'messages' column: data.format=messages reads them as chats."
                 if "messages" in shown and cfg.format != "messages" else "")
        raise LLMTrainError(
            f"data.format '{cfg.format}' needs {', '.join(missing)} but {source} has columns {shown}.{chats} "
            f"Map them with data.fields, e.g. data.fields.{absent[0]}=<column>."  # a field that is missing
            + (pairs_note(columns) if cfg.format == "prompt" else "")
            + (unpaired_note(columns) if cfg.format == "preference" else "")
            + (paired_note(columns) if cfg.format == "unpaired" else "")
            + (sft_pairs_note(columns) if cfg.format in ("prompt_completion", "alpaca", "messages", "text") else "")
        )


def check_feedback_labels(raw, cfg: DataConfig, source: str) -> None:
    """Refuse unpaired feedback (a completion per row and a boolean `label`, TRL's KTO format) given to supervised
    fine-tuning: SFT would train on every completion, the ones labelled undesirable as well, without a word."""
    feature = raw.features.get("label") if cfg.format not in ("preference", "unpaired", "prompt") else None
    if feature is None or type(feature).__name__ == "ClassLabel":  # (a hub dataset's classes: named, not feedback)
        return
    if getattr(feature, "dtype", None) != "bool":  # 0/1 or "true"/"false" (a CSV's, a parquet's int column) too
        if not {"completion", "messages"} & set(raw.column_names):
            return
        values = set(raw.unique("label")) if getattr(feature, "dtype", None) else {
            json.dumps(v) for v in raw["label"]}  # (a column of several types: JSON values, unhashable ones too)
        said = {str(v).strip().lower().strip('"') for v in values}
        if not values or not said <= {"0", "1", "true", "false"} or len(said) < 2:
            return
    raise LLMTrainError(
        f"{source} has a 'label' column of true and false (or 1 and 0): its rows look like unpaired feedback (a "
        "completion each, marked "
        "desirable (true) or undesirable (false): KTO's format), and supervised fine-tuning would train on every "
        "completion, the label: false ones too. To learn from both, use KTO: data.format: unpaired with a kto: "
        "section (docs/preference.md). To fine-tune on the desirable completions only, keep the label: true rows in "
        "a file of their own; if the column means something else, rename it.")


def unpaired_note(columns) -> str:
    """For preference pairs (DPO) given unpaired feedback rows: no data.fields mapping can make them pairs."""
    if "label" not in columns or not {"completion", "messages"} & set(columns):
        return ""
    return (" These rows look like unpaired feedback (one completion each and a 'label': KTO's format), not pairs: "
            "DPO needs a chosen and a rejected completion of the same prompt in one row, which no data.fields mapping "
            "can make of them. Train them with KTO instead: data.format: unpaired and a kto: section (docs/preference.md).")


def paired_note(columns) -> str:
    """For KTO (data.format: unpaired) given preference pairs: what the data are, and what trains on them."""
    if not {"chosen", "rejected"} <= set(columns):
        return ""
    return (" These data look like preference pairs (prompt, chosen, rejected), not unpaired feedback: train them "
            "with a preference: section and data.format: preference instead (DPO, docs/preference.md), or write each "
            "pair as two rows, {prompt, completion: chosen, label: true} and {prompt, completion: rejected, label: "
            "false}.")


def sft_pairs_note(columns) -> str:
    """For supervised fine-tuning given preference pairs: the mapping it advises (completion=chosen) trains on the
    chosen replies alone, without a word about the rejected ones (it had been the only advice; audit 11)."""
    if not {"chosen", "rejected"} <= set(columns):
        return ""
    return (" These data look like preference pairs (prompt, chosen, rejected): to learn from both replies, train "
            "them with a preference: section and data.format: preference (DPO, docs/preference.md) or a reward "
            "model (reward_model:); data.fields.completion=chosen fine-tunes on the chosen replies alone.")


def pairs_note(columns) -> str:
    """For online RL (data.format: prompt) given preference pairs: what the data are, and what trains on them."""
    if not {"chosen", "rejected"} <= set(columns):
        return ""
    return (" These data look like preference pairs (chosen, rejected): online RL (rl:) samples its own completions "
            "of prompts and scores them, so it needs prompts and what a reward compares them with. To learn from "
            "the pairs, use a preference: section with data.format: preference instead (recipes/mistral7b-dpo.yaml).")


def _message(m: Any, cfg: DataConfig) -> Any:
    """One message with the template's names: data.fields' role/content keys and data.roles' role names."""
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    if not isinstance(m, dict) or (rk, ck) == ("role", "content") and not cfg.roles:
        return m
    out = {k: v for k, v in m.items() if k not in (rk, ck)}
    role = m.get(rk)
    return {**out, "role": cfg.roles.get(role, role) if isinstance(role, str) else role, "content": m.get(ck)}


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # the chat roles templates read
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant", "ai": "assistant",
                "chatbot": "assistant"}  # ShareGPT's, Gemma's own name for the reply (its template maps assistant)


def _meant_role(role: str) -> str | None:
    """The chat role an unknown role name most likely means (a case, a space, a typo, another dataset's name for it:
    templates match roles exactly, so "Assistant" renders a reply that is never trained); None for a role of its own
    (a custom template's), or one of ROLES."""
    import difflib

    if role in ROLES:
        return None
    plain = role.strip().lower()
    return ROLE_ALIASES.get(plain) or next(iter(difflib.get_close_matches(plain, ROLES, n=1, cutoff=0.8)), None)


def _messages_problem(messages: Any, cfg: DataConfig, what: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{what} is not a non-empty list of {{role, content}} objects"
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get(rk), str):
            return f"message {k + 1} of {what} has no '{rk}' (its role; map the key with data.fields.role)"
        got = m.get(ck)
        if calls_only(m, ck):
            continue
        if not isinstance(got, str):
            return (f"message {k + 1} ({m[rk]}) of {what} has no '{ck}' (its text; map the key with "
                    "data.fields.content)"
                    if got is None else
                    f"message {k + 1} ({m[rk]}) of {what} has content {got!r} ({type(got).__name__}), not a string")
    roles = [cfg.roles.get(m[rk], m[rk]) for m in messages]
    if not {"user", "assistant"} <= set(roles):  # another dataset's names throughout: _no_reply_problem lists them
        return None
    for k, role in enumerate(roles):  # a role beside the chat roles that means one of them: a mistake, unless
        if messages[k][rk] not in cfg.roles and (meant := _meant_role(role)) is not None:  # data.roles names it
            return (f"message {k + 1} of {what} has the role {role!r}, which chat templates do not read as "
                    f"{meant!r} (they match roles exactly: a reply under another name is shown, never trained). "
                    f"Write {meant!r}, or map it with data.roles: {{{json.dumps(messages[k][rk])}: {meant}}}")
    return None


def _no_reply_problem(messages: list, cfg: DataConfig, what: str) -> str | None:
    if any(_message(m, cfg)["role"] == "assistant" for m in messages):
        return None
    seen = sorted({m[cfg.fields.get("role", "role")] for m in messages})
    return (f"{what} has no assistant message, so nothing would be trained (roles {seen}; map yours to the "
            "template's with data.roles, e.g. {human: user, gpt: assistant})")


def row_problem(example: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one raw row for data.format, in words; None when it can be formatted (a preference
    row: pairs.pair_problem)."""
    if cfg.format == "messages":
        messages = _column(example, cfg, "messages")
        return (_messages_problem(messages, cfg, f"'{cfg.fields.get('messages', 'messages')}'")
                or _no_reply_problem(messages, cfg, "the conversation"))
    for field in FORMAT_FIELDS[cfg.format]:
        if field == "tools":  # (read by encode_example: tools.tool_schemas says what is wrong with them)
            continue
        value = _column(example, cfg, field)
        name = f"'{cfg.fields.get(field, field)}' ({field})"
        # an empty completion still trains its end of turn ("empty replies" warns); an empty RL prompt is nothing
        empty = value is None or value == "" and cfg.format == "prompt"
        if empty and field not in OPTIONAL_FIELDS.get(cfg.format, ()):
            return f"{name} is missing (no such key, or null)" if value is None else f"{name} is empty"
        if isinstance(value, list) and cfg.format in ("prompt_completion", "prompt"):  # TRL's conversational rows
            problem = _messages_problem(value, cfg, name) or (
                _no_reply_problem(value, cfg, name) if field == "completion" else None)
            if problem:
                return problem
        elif isinstance(value, (dict, list)):
            return f"{name} is a {type(value).__name__}, not text"
        elif value is not None and not isinstance(value, str):  # a number, which a template would print as text
            return not_text(name, value)
    return None


def not_text(name: str, value: Any) -> str:
    """A column's value that is a number (or another non-text scalar) where text is read, in words."""
    kind = type(value).__name__
    return (f"{name} is {value!r}, a{'n' * (kind[0] in 'aeiou')} {kind}, not text (quote it in the file if it is "
            "meant as text; a CSV or parquet column of numbers is read as numbers whatever the quotes: write such "
            "data as JSON lines, the value quoted)")


def conversational_rows(cfg: DataConfig) -> bool:
    """Whether prompt_completion rows are TRL's conversational ones (a prompt or completion that is a list of
    messages), which are rendered through the chat template whatever data.chat_template says (chat_of): read off
    the first row of a local file, for what renders prompts as training did without the data at hand (generate,
    doctor)."""
    from llmtrain.config import source_configs
    from llmtrain.data.sources import first_row

    if cfg.sources is not None:  # a mixture: any source of such rows renders its prompts so
        return any(conversational_rows(part) for part in source_configs(cfg))
    if cfg.format != "prompt_completion" or (row := first_row(cfg.path, split=cfg.split)) is None:
        return False
    return any(isinstance(_column(row, cfg, f), list) for f in ("prompt", "completion"))


def chat_of(example: dict, cfg: DataConfig) -> tuple[list[dict], int] | None:
    """The row as a chat, and the index of its first message whose assistant turns are trained (those before
    it are the prompt); None for a row rendered as plain text."""
    if cfg.format == "messages":
        messages, first = [_message(m, cfg) for m in _column(example, cfg, "messages")], 0
    else:
        prompt, completion = _column(example, cfg, "prompt"), _column(example, cfg, "completion")
        if cfg.format != "prompt_completion" or (cfg.chat_template is False and not isinstance(prompt, list)
                                                 and not isinstance(completion, list)):
            return None
        prompt = [_message(m, cfg) for m in prompt] if isinstance(prompt, list) else [
            {"role": "user", "content": str(prompt)}]
        completion = [_message(m, cfg) for m in completion] if isinstance(completion, list) else [
            {"role": "assistant", "content": str(completion)}]
        messages, first = prompt + completion, len(prompt)
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        # A prompt/completion row's trained part moves one message on; a messages row trains from the start.
        messages, first = [{"role": "system", "content": cfg.system_prompt}, *messages], first + 1 if first else 0
    return messages, first


def alpaca_prompt(instruction, given) -> str:
    """An Alpaca row's prompt: its instruction, and its input where it has one, in ALPACA_PROMPT."""
    return ALPACA_PROMPT.format(ctx=", paired with an input that provides further context" if given else "",
                                instruction=instruction, input=f"### Input:\n{given}\n\n" if given else "")


def prompt_and_completion(example: dict, cfg: DataConfig) -> tuple[str, str]:
    if cfg.format == "alpaca":
        prompt = alpaca_prompt(_column(example, cfg, "instruction"), _column(example, cfg, "input") or "")
        return prompt, str(_column(example, cfg, "output"))
    return str(_column(example, cfg, "prompt")), str(_column(example, cfg, "completion"))


def encode_prompt_completion(prompt: str, completion: str, tokenizer, *, train_on_prompt: bool) -> tuple[list, list]:
    """The prompt's tokens as inference tokenises it alone (BOS by the tokenizer's own rule), then the completion's
    as they follow it: taken from prompt + completion tokenised whole where that begins with the prompt's tokens
    (Mistral's tokenizer marks a word's start with "▁", so "cat" tokenised alone after "Translate: chat\n" had been
    trained as "▁cat", a reply with a stray space; TRL tokenises them together), else tokenised alone (a token that
    would straddle the boundary: the prompt's tokens stay inference's). EOS is appended so the model learns to stop,
    unless the completion already ends with it (it had been doubled)."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    whole = tokenizer(prompt + completion, add_special_tokens=True)["input_ids"]
    c = whole[len(p):] if whole[:len(p)] == p else tokenizer(completion, add_special_tokens=False)["input_ids"]
    c = c if c and c[-1] == tokenizer.eos_token_id else c + [tokenizer.eos_token_id]
    return p + c, (p if train_on_prompt else [IGNORE] * len(p)) + c


def encode_text(text: str, tokenizer) -> tuple[list, list]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return ids, list(ids)


def special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens' ids (chat.special_tokens)."""
    return special_tokens(tokenizer)[0]


def encode_messages(messages: list[dict], tokenizer, *, train_on_prompt: bool, template: str | None = None,
                    first: int = 0, tools: list[dict] | None = None, rejected: bool = False) -> tuple[list, list]:
    """Render a chat with its template (the tokenizer's, or `template`) and train the assistant replies (a tool-use
    chat, with its `tools`: chat.render_tool_chat, each assistant turn with its tool calls). `rejected`: an answer
    the data reject (DPO's rejected, KTO's undesirable), whose calls may name a tool the row does not define.

    The mask comes from character offsets (see `render_chat`): every token that overlaps what the model must
    generate after a generation prompt is trained, up to and including the end of the turn: what the template
    renders after the final reply, without the whitespace after it (`</s>` for Mistral, `<|eot_id|>` for Llama 3,
    `<|im_end|>` for Qwen), whatever the tokenizer makes of it: one special token, or text in several pieces on a
    tokenizer that does not know it. Only a template that renders nothing after the reply gets EOS appended.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise LLMTrainError("data.format 'messages' expects a list of {role, content} objects per example.")
    if template is None and tokenizer.chat_template is None:
        raise LLMTrainError(
            "rendering a chat needs a chat template, and this tokenizer (model.tokenizer) has none. Give a Jinja "
            "template file with data.chat_template: path/to/template.jinja, or use format prompt_completion "
            "without data.chat_template."
        )
    if is_tool_chat(messages, tools):
        text, spans = render_tool_chat(tool_messages(messages, "", None if rejected else tools), tokenizer,
                                       template=template, tools=tools, first=first)
    else:
        text, spans = render_chat(messages, tokenizer, template=template, first=first)
    ids, offsets = _tokens_and_offsets(tokenizer, text)
    special = special_ids(tokenizer)
    bounds = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    starts, ends = bounds[0::2], bounds[1::2]
    shown = ends > starts  # tokens with text (an empty span overlaps nothing)
    ordered = bool((starts[1:] >= starts[:-1]).all() and (ends[1:] >= ends[:-1]).all())
    trained = np.zeros(len(ids), dtype=bool)
    closed = True
    end_of_turn = closing(text, spans)  # what the template renders after the final reply (Phi-3's EOS after its
    # end of turn too, trained as TRL's phi3_training template trains it)
    for start, end in spans:
        as_text = bool(end_of_turn) and text.startswith(end_of_turn, end)  # the reply, then its end of turn
        end += len(end_of_turn) if as_text else 0
        inside = _overlapping(starts, ends, shown, start, end, ordered=ordered)
        trained[inside] = True
        if as_text:
            closed = True
            continue
        if len(inside) and ids[inside[-1]] in special:  # a turn that ends with its own special token (GPT-OSS's
            closed = True  # <|call|> after tool calls: chat._tool_spans)
            continue
        # an earlier reply that the template closes otherwise: up to the next special token, past whitespace
        later = np.flatnonzero(starts >= end) if not len(inside) else inside[-1:] + 1
        j = int(later[0]) if len(later) else len(ids)
        k = j
        while k < len(ids) and ids[k] not in special and not text[offsets[k][0]:offsets[k][1]].strip():
            k += 1
        closed = k < len(ids) and ids[k] in special
        if closed:
            trained[j:k + 1] = True
    labels = np.where(trained, np.asarray(ids, dtype=np.int64), IGNORE).tolist()
    if not closed:  # the template ends the final reply with whitespace alone, or nothing: EOS right after the reply,
        # as TRL appends it to a completion (the whitespace, never trained, had stood between them: the model learnt
        # EOS after a newline it was never taught to write, and so never stopped)
        ids, labels = ids[:j] + [tokenizer.eos_token_id], labels[:j] + [tokenizer.eos_token_id]
    if train_on_prompt:
        labels = list(ids)
    return ids, labels


def _overlapping(starts, ends, shown, start: int, end: int, *, ordered: bool):
    """The tokens with text that overlap the characters [start, end), in order. Offsets in text order (every
    tokenizer's, checked once per row): two bisections, so a chat of many turns is not scanned once per reply (a
    900-turn chat of 174K tokens took 5.8 s so, in Python); otherwise every token is compared, in numpy."""
    if not ordered:
        return np.flatnonzero((starts < end) & (ends > start) & shown)
    lo, hi = int(np.searchsorted(ends, start, "right")), int(np.searchsorted(starts, end, "left"))
    return lo + np.flatnonzero(shown[lo:hi]) if hi > lo else np.empty(0, dtype=np.int64)


def _tokens_and_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, no special tokens added: the fast tokenizer's Rust backend called
    directly (what transformers calls, without its per-call Python wrapping: a fifth of the data preparation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def encode_prompt(example: dict, tokenizer, cfg: DataConfig, *, template: str | None = None,
                  tools: list[dict] | None = None) -> dict:
    """A prompt for online RL (data.format: prompt), as generation will continue it: a chat (a messages prompt, or
    data.chat_template set) rendered with its generation prompt, else the text with the tokenizer's BOS rule.
    Nothing is trained and nothing is cut: a prompt that leaves no room for the completion is refused
    (checks.check_prompt_room). Every other column of the row is kept for the reward functions. `tools`: rl.tools'
    schemas, rendered into a chat prompt as the template shows tools (TRL's GRPOTrainer passes them the same way)."""
    prompt = _column(example, cfg, "prompt")
    if isinstance(prompt, list) or cfg.chat_template is not False:
        messages = ([_message(m, cfg) for m in prompt] if isinstance(prompt, list)
                    else [{"role": "user", "content": str(prompt)}])
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        if is_tool_chat(messages, tools):  # earlier calls in the templates' shape, as training rows have them (a
            # call's arguments as a JSON string had been shown twice encoded, a call of the function alone refused)
            messages = tool_messages(messages, "", tools)
        if template is None and tokenizer.chat_template is None:
            raise LLMTrainError("rendering a chat prompt needs a chat template, and this tokenizer (model.tokenizer) "
                                "has none. Give a Jinja template file with data.chat_template: path/to/template.jinja")
        # (through chat._apply: a template's own refusal, Mistral's alternation or Gemma's roles, had been jinja's
        # traceback naming no row)
        text = _apply(tokenizer, messages, template, generation_prompt=True, tools=tools or None)
        check_prompt_rendered(tokenizer, messages, template, text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif tools:
        raise LLMTrainError("rl.tools are shown to the model through the chat template, and these prompts are plain "
                            "text rendered without one (data.chat_template: false). Give chat prompts (a list of "
                            "messages) or set data.chat_template: true.")
    else:
        ids = tokenizer(str(prompt), add_special_tokens=True)["input_ids"]
    prompt_column = cfg.fields.get("prompt", "prompt")
    columns = {USER + k: v for k, v in example.items() if k != prompt_column and not k.startswith("__llmtrain")}
    return {**columns, "prompt": prompt, "input_ids": ids, "labels": [IGNORE] * len(ids), "length": len(ids),
            "trained": len(ids), "truncated": False}


def check_prompt_rendered(tokenizer, messages: list[dict], template: str | None, text: str) -> None:
    """Refuse an RL prompt whose rendering the completion cannot follow (audit 30; TRL samples from them silently):
    one that ends with the template's end of turn (a last reply that Mistral's template closes with EOS and opens
    nothing after; a template without a generation prompt), so sampling would start after a finished turn; or a
    message the template leaves out (a system prompt alone, which Gemma's and Mistral's show only beside a user
    turn)."""
    from llmtrain.data.chat import _not_shown, end_of_turn

    eot = end_of_turn(tokenizer, template)
    if eot and text.rstrip().endswith(eot):
        why = ("its last message is a reply, which this template closes without opening another" if messages[-1][
            "role"] == "assistant" else "the template opens no assistant turn for add_generation_prompt")
        raise LLMTrainError(f"the chat template renders this prompt ending with a finished turn ({why}), so the "
                            "completion would be sampled after it. End each prompt with a user message, or give a "
                            "template that opens the assistant's turn (data.chat_template: path/to/template.jinja).")
    for k, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in text:
            raise _not_shown(messages, k)


def user_columns(columns) -> dict[str, str]:
    """{a user's column name: its name in prepared prompt data} (see USER)."""
    return {c[len(USER):]: c for c in columns if c.startswith(USER)}


def encode_example(example: dict, tokenizer, cfg: DataConfig, *, template: str | None = None,
                   keep_cut: bool = False, rejected: bool = False) -> dict:
    """Format, tokenise and mask one example; truncate it to data.max_seq_len. `template`: read_template(cfg).
    `keep_cut`: also what the truncation cut off its end (cut_ids, cut_labels; KTO's KL sequences read them).
    `rejected`: a completion the data reject (encode_messages)."""
    chat, untooled = chat_of(example, cfg), False
    if chat is not None:
        if template is None:  # (None again where the tokenizer's own renders as it is)
            template = read_template(cfg, tokenizer)
        # (TRL's SFTTrainer passes a conversational prompt/completion row's tools too: its calls had been trained
        # with the schemas never shown)
        tools = tool_schemas(_column(example, cfg, "tools"), "a row") if cfg.format in (
            "messages", "prompt_completion") else None
        # calls with no schemas to show: counted (DataStats.untooled), said by checks.check_data
        untooled = not tools and any(isinstance(m, dict) and m.get("tool_calls") for m in chat[0])
        ids, labels = encode_messages(chat[0], tokenizer, train_on_prompt=cfg.train_on_prompt, template=template,
                                      first=chat[1], tools=tools, rejected=rejected)
    elif cfg.format == "text":
        ids, labels = encode_text(str(_column(example, cfg, "text")), tokenizer)
    else:
        ids, labels = encode_prompt_completion(*prompt_and_completion(example, cfg), tokenizer,
                                               train_on_prompt=cfg.train_on_prompt)
    truncated = len(ids) > cfg.max_seq_len
    cut = {"cut_ids": ids[cfg.max_seq_len:], "cut_labels": labels[cfg.max_seq_len:]} if keep_cut else {}
    ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
    # The first token is never a target (nothing predicts it), so it does not count as trained.
    trained = len(labels) - labels.count(IGNORE) - (bool(labels) and labels[0] != IGNORE)
    return {"input_ids": ids, "labels": labels, "length": len(ids), "trained": trained, "truncated": truncated,
            "untooled": untooled, **cut}


def prompt_length(labels) -> int:
    """A tokenised row's prompt, as every mode splits it: the tokens before its first trained label (all of them
    when nothing is trained)."""
    return next((k for k, label in enumerate(labels) if label != IGNORE), len(labels))
