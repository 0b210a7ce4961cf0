"""Preference pairs as data (data.format: preference): read a row in any of the shapes people have, render each
answer exactly as supervised fine-tuning renders a prompt/completion row, and refuse what cannot train.

Shapes (column names mappable through data.fields):
- plain strings: prompt, chosen, rejected. Rendered through the chat template as a user turn and an assistant
  reply when data.chat_template is set, else as text plus EOS (as prompt_completion rows);
- conversational (HuggingFaceH4/ultrafeedback_binarized): prompt a list of messages, chosen and rejected each a
  message or a list of messages;
- implicit prompt (Anthropic HH): chosen and rejected are whole conversations, and the messages they share at
  the start are the prompt (a prompt column beside them, as in ultrafeedback_binarized, repeats it; one that does
  not is the prompt's start, the shared messages after it).

Each answer is encoded as the SFT row {prompt, completion=answer} would be (formats.encode_example): the inference
prompt with add_generation_prompt, then the reply as the template renders it; only the answer's tokens, up to and
including the end of turn, are trained (their log-probabilities are what the preference loss compares).
"""

from __future__ import annotations

from typing import Any

from llmtrain.config import DataConfig
from llmtrain.data.formats import IGNORE, _no_reply_problem, encode_example, not_text, prompt_length
from llmtrain.data.tools import calls_only

PAIR_COLUMNS = ["chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels", "length"]
MARGIN = "margin"  # TRL's optional column: how much the chosen answer is better (reward models subtract it)


def _get(example: dict, cfg: DataConfig, field: str) -> Any:
    return example.get(cfg.fields.get(field, field))


def _as_messages(value: Any) -> list | None:
    """An answer given as one message becomes a list of one; a list stays; text is not messages (None)."""
    if isinstance(value, dict):
        return [value]
    return value if isinstance(value, list) else None


def _same(a: dict, b: dict, cfg: DataConfig) -> bool:
    """The same message: role and content, and the calls it makes or answers (two call-only turns with no content
    that call different tools are different answers, not a shared prompt)."""
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    return all(a.get(k) == b.get(k) for k in (rk, ck, "tool_calls", "tool_call_id"))


def split_pair(example: dict, cfg: DataConfig) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row: text, or lists of messages (an implicit prompt split off)."""
    prompt, chosen, rejected = (_as_messages(v) if isinstance(v, dict) else v
                                for v in (_get(example, cfg, f) for f in ("prompt", "chosen", "rejected")))
    if isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and _same(chosen[n], rejected[n], cfg):
            n += 1
        # The shared first messages join the prompt: they are it where there is no prompt column (implicit prompt),
        # or where the answers repeat the column (HuggingFaceH4/ultrafeedback_binarized: prompt is the user's text,
        # chosen the whole conversation); else they follow it (they had replaced it: the question was lost)
        if prompt is None or n and _repeats(prompt, chosen[:n], cfg):
            prompt = chosen[:n]
        elif n:
            ck, rk = cfg.fields.get("content", "content"), cfg.fields.get("role", "role")
            prompt = (prompt if isinstance(prompt, list) else [{rk: "user", ck: prompt}]) + chosen[:n]
        chosen, rejected = chosen[n:], rejected[n:]
    return prompt, chosen, rejected


def _repeats(prompt: Any, shared: list, cfg: DataConfig) -> bool:
    """Whether the answers' shared first messages repeat the prompt column: its messages at their start, or its text
    as one of theirs."""
    if isinstance(prompt, list):
        return len(prompt) <= len(shared) and all(_same(a, b, cfg) for a, b in zip(prompt, shared))
    ck = cfg.fields.get("content", "content")
    return any(isinstance(m, dict) and str(m.get(ck, "")).strip() == str(prompt).strip() for m in shared)


def pair_problem(example: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one raw preference row, in words; None when it can be encoded."""
    names = {f: f"'{cfg.fields.get(f, f)}' ({f})" for f in ("prompt", "chosen", "rejected")}
    for f in ("chosen", "rejected"):
        value = _get(example, cfg, f)
        if value is None:
            held = [repr(k) for k, v in example.items() if v is not None]  # (a file's other rows add their keys)
            return f"{names[f]} is missing (no such key, or null); the row has {', '.join(held) or 'no values'}"
        if value in ("", [], {}):
            return f"{names[f]} is empty"
    for f in ("prompt", "chosen", "rejected"):  # a number (a CSV's `4`) had been a traceback, or trained as text
        if (value := _get(example, cfg, f)) is not None and not isinstance(value, (str, list, dict)):
            return not_text(names[f], value)

    prompt, chosen, rejected = split_pair(example, cfg)
    if prompt is None:
        return (f"{names['prompt']} is missing, and chosen and rejected are not both conversations whose shared "
                "first messages could be the prompt")
    if isinstance(prompt, list) and not prompt:
        return "chosen and rejected share no first message, so there is no prompt (implicit-prompt rows)"
    margin = _get(example, cfg, MARGIN)
    if margin is not None and (isinstance(margin, (bool, str)) or not isinstance(margin, (int, float))
                               or margin != margin or abs(margin) == float("inf")):
        return f"'{cfg.fields.get(MARGIN, MARGIN)}' (margin) is {margin!r}, not a finite number"
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    for f, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, list) and not all(isinstance(m, dict) and isinstance(m.get(rk), str) and (
                isinstance(m.get(ck), str) or calls_only(m, ck)) for m in value):
            return (f"the {f} messages are not all {{{rk}, {ck}}} objects with text (map the keys with "
                    "data.fields.role / data.fields.content)")
    if isinstance(chosen, str) != isinstance(rejected, str):  # one rendered as text, one as a chat: two prompts
        return (f"{names['chosen']} and {names['rejected']} are one text and one message list: give both as text or "
                "both as messages, so that both answers follow the same prompt")
    for f, answer in (("chosen", chosen), ("rejected", rejected)):
        text = answer if isinstance(answer, str) else " ".join(str(m.get(ck) or "") for m in answer
                                                               if isinstance(m, dict))
        if not text.strip() and not any(calls_only(m, ck) for m in answer):
            return f"the {f} answer is empty"
        # (an answer of user or unmapped roles had been a traceback, or the pair dropped as "the same")
        if isinstance(answer, list) and (problem := _no_reply_problem(answer, cfg, f"the {f} answer")):
            return problem
    return None


def encode_pair(example: dict, tokenizer, cfg: DataConfig, *, template: str | None = None) -> dict:
    """Both answers of a row tokenised and masked as SFT would encode {prompt, completion=answer}, fitted into
    data.max_seq_len the way a pair can still be compared, or dropped (`drop` says why; `trained` 0).

    Too long: the prompt is cut from the left (after BOS) until the longer answer fits, but keeps at least its last
    max_seq_len / 4 tokens; what still does not fit is cut from the answers' ends, as SFT truncates. Both answers
    see the same cut prompt, so the policy and the reference compare them on the same context. Dropped: chosen
    equal to rejected, and answers that are equal once cut (the pair would teach nothing). TRL's optional margin
    column, where the data have one, is kept as `margin` (0 where a row leaves it empty)."""
    if cfg.fields.get(MARGIN, MARGIN) in example:  # a margin column: kept beside the tokens, in every row
        margin = float(_get(example, cfg, MARGIN) or 0.0)
        return {**_encode_pair(example, tokenizer, cfg, template=template), MARGIN: margin}
    return _encode_pair(example, tokenizer, cfg, template=template)


def _encode_pair(example: dict, tokenizer, cfg: DataConfig, *, template: str | None) -> dict:
    prompt, chosen, rejected = split_pair(example, cfg)
    if chosen == rejected:
        return _dropped("same")
    whole = cfg.model_copy(update={"format": "prompt_completion", "max_seq_len": 2**31 - 1,
                                   "fields": {k: v for k, v in cfg.fields.items() if k in ("role", "content")}})
    tools = _get(example, cfg, "tools")  # the row's tools, shown before both answers as SFT shows them (TRL's)
    sides = [encode_example({"prompt": prompt, "completion": answer, "tools": tools}, tokenizer, whole,
                            template=template, rejected=answer is rejected) for answer in (chosen, rejected)]
    limit = cfg.max_seq_len
    ids = [s["input_ids"] for s in sides]
    labels = [s["labels"] for s in sides]
    # The prompt: what comes before either answer's first trained token (with train_on_prompt, the shared start).
    shared = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    starts = [prompt_length(lab_) for lab_ in labels]
    prompt_len = shared if cfg.train_on_prompt else min(min(starts), shared)
    bos = 1 if ids[0] and ids[0][0] == tokenizer.bos_token_id else 0
    keep = min(prompt_len - bos, max(limit // 4, 1))  # prompt tokens after BOS that are never cut
    cut = max(0, min(max(map(len, ids)) - limit, prompt_len - bos - keep))
    out: dict = {"truncated": False, "trained": 0, "length": 0, "drop": ""}
    for name, i, lab in zip(("chosen", "rejected"), ids, labels):
        kept_ids, kept_labels = (i[:bos] + i[bos + cut:])[:limit], (lab[:bos] + lab[bos + cut:])[:limit]
        trained = sum(1 for x in kept_labels[1:] if x != IGNORE)  # the first token is never a target
        if not trained:
            return _dropped("no_room")
        out[f"{name}_ids"], out[f"{name}_labels"] = kept_ids, kept_labels
        out["truncated"] |= len(kept_ids) < len(i)
        out["trained"] += trained
        out["length"] += len(kept_ids)
    if out["chosen_ids"] == out["rejected_ids"]:
        return _dropped("same_cut")
    return out


DROPS = {  # why a pair is dropped, as the data report says it
    "same": "chosen equal to rejected",
    "same_cut": "with chosen and rejected the same within data.max_seq_len",
    "no_room": "with no answer token within data.max_seq_len",
}


def _dropped(why: str) -> dict:
    return {"chosen_ids": [], "chosen_labels": [], "rejected_ids": [], "rejected_labels": [], "truncated": False,
            "trained": 0, "length": 0, "drop": why}
