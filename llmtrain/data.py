"""Data: read the source, format each example, tokenise it and build its loss mask, cache the result.

Every example becomes `input_ids` and `labels` of equal length, with -100 in `labels` where no loss
falls. Labels are aligned with the inputs (not shifted); the collator shifts them per example so that
packing can never make the last token of one example predict the first token of the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmtrain.chat import read_template, render_chat
from llmtrain.config import DataConfig
from llmtrain.errors import LLMTrainError
from llmtrain.pairs import PAIR_COLUMNS, encode_pair, pair_problem
from llmtrain.sources import files as _files
from llmtrain.sources import is_local as _is_local
from llmtrain.sources import is_split_name, load_raw

IGNORE = -100
CACHE_VERSION = 4  # bump when tokenisation or masking changes, so old caches are not reused

# The columns each format reads, by their canonical names; `data.fields` maps them to dataset columns.
FORMAT_FIELDS = {
    "alpaca": ("instruction", "input", "output"),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
}
OPTIONAL_FIELDS = {"alpaca": {"input"}, "preference": {"prompt"}}  # preference: implicit-prompt rows have none
CHAT_FORMATS = ("messages", "prompt_completion", "preference")  # formats whose rows may be chats (role/content)

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{ctx}. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)

# --------------------------------------------------------------------------- formatting and masking


def _column(example: dict, cfg: DataConfig, field: str) -> Any:
    return example.get(cfg.fields.get(field, field))


def check_columns(columns: list[str], cfg: DataConfig, source: str) -> None:
    known = set(FORMAT_FIELDS[cfg.format]) | ({"role", "content"} if cfg.format in CHAT_FORMATS else set())
    unknown = sorted(set(cfg.fields) - known)
    if unknown:
        raise LLMTrainError(f"data.fields maps {unknown}, which data.format '{cfg.format}' does not read; it reads "
                            f"{sorted(known)}. Fix the names in data.fields.")
    missing = [
        f"{f} (column '{cfg.fields.get(f, f)}')"
        for f in FORMAT_FIELDS[cfg.format]
        if f not in OPTIONAL_FIELDS.get(cfg.format, ()) and cfg.fields.get(f, f) not in columns
    ]
    if missing:
        raise LLMTrainError(
            f"data.format '{cfg.format}' needs {', '.join(missing)} but {source} has columns {columns}. "
            f"Map them with data.fields, e.g. data.fields.{FORMAT_FIELDS[cfg.format][0]}=<column>."
        )


def _message(m: Any, cfg: DataConfig) -> Any:
    """One message with the template's names: data.fields' role/content keys and data.roles' role names."""
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    if not isinstance(m, dict) or (rk, ck) == ("role", "content") and not cfg.roles:
        return m
    out = {k: v for k, v in m.items() if k not in (rk, ck)}
    role = m.get(rk)
    return {**out, "role": cfg.roles.get(role, role) if isinstance(role, str) else role, "content": m.get(ck)}


def _messages_problem(messages: Any, cfg: DataConfig, what: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{what} is not a non-empty list of {{role, content}} objects"
    rk, ck = cfg.fields.get("role", "role"), cfg.fields.get("content", "content")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get(rk), str):
            return f"message {k + 1} of {what} has no '{rk}' (its role; map the key with data.fields.role)"
        got = m.get(ck)
        if not isinstance(got, str):
            return (f"message {k + 1} ({m[rk]}) of {what} has no '{ck}' (its text; map the key with "
                    "data.fields.content)"
                    if got is None else
                    f"message {k + 1} ({m[rk]}) of {what} has content {got!r} ({type(got).__name__}), not a string")
    return None


def _no_reply_problem(messages: list, cfg: DataConfig, what: str) -> str | None:
    if any(_message(m, cfg)["role"] == "assistant" for m in messages):
        return None
    seen = sorted({m[cfg.fields.get("role", "role")] for m in messages})
    return (f"{what} has no assistant message, so nothing would be trained (roles {seen}; map yours to the "
            "template's with data.roles, e.g. {human: user, gpt: assistant})")


def row_problem(example: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one raw row for data.format, in words; None when it can be formatted."""
    if cfg.format == "preference":
        return pair_problem(example, cfg)
    if cfg.format == "messages":
        messages = _column(example, cfg, "messages")
        return (_messages_problem(messages, cfg, f"'{cfg.fields.get('messages', 'messages')}'")
                or _no_reply_problem(messages, cfg, "the conversation"))
    for field in FORMAT_FIELDS[cfg.format]:
        value = _column(example, cfg, field)
        name = f"'{cfg.fields.get(field, field)}' ({field})"
        if value is None and field not in OPTIONAL_FIELDS.get(cfg.format, ()):
            return f"{name} is empty"
        if isinstance(value, list) and cfg.format == "prompt_completion":  # TRL's conversational rows
            problem = _messages_problem(value, cfg, name) or (
                _no_reply_problem(value, cfg, name) if field == "completion" else None)
            if problem:
                return problem
        elif isinstance(value, (dict, list)):
            return f"{name} is a {type(value).__name__}, not text"
    return None


def check_rows(raw, cfg: DataConfig, source: str) -> None:
    """Refuse a dataset with a row the formatter cannot use, naming the file, the row and the problem (instead
    of a traceback from inside the tokeniser, or a row silently counted as dropped)."""
    for i, example in enumerate(raw):
        problem = row_problem(example, cfg)
        if problem:
            raise LLMTrainError(
                f"{source}, row {i + 1}: {problem} (data.format={cfg.format}). Fix or remove that row, or set "
                "data.format / data.fields / data.roles to match the file."
            )


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


def prompt_and_completion(example: dict, cfg: DataConfig) -> tuple[str, str]:
    if cfg.format == "alpaca":
        inp = _column(example, cfg, "input") or ""
        prompt = ALPACA_PROMPT.format(
            ctx=", paired with an input that provides further context" if inp else "",
            instruction=_column(example, cfg, "instruction"),
            input=f"### Input:\n{inp}\n\n" if inp else "",
        )
        return prompt, str(_column(example, cfg, "output"))
    return str(_column(example, cfg, "prompt")), str(_column(example, cfg, "completion"))


def encode_prompt_completion(prompt: str, completion: str, tokenizer, *, train_on_prompt: bool) -> tuple[list, list]:
    # Tokenised separately so the prompt/completion boundary is exact; BOS comes from the tokenizer's
    # own special-token rule, and EOS is appended so the model learns to stop.
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + c, (p if train_on_prompt else [IGNORE] * len(p)) + c


def encode_text(text: str, tokenizer) -> tuple[list, list]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return ids, list(ids)


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: the named ones (bos, eos, pad, additional_special_tokens) and every added token
    marked special. Llama 3's <|eot_id|> and Gemma's <end_of_turn> close a turn whether or not the tokenizer's config
    lists them as additional special tokens."""
    added = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return set(tokenizer.all_special_ids) | added


def encode_messages(messages: list[dict], tokenizer, *, train_on_prompt: bool, template: str | None = None,
                    first: int = 0) -> tuple[list, list]:
    """Render a chat with its template (the tokenizer's, or `template`) and train the assistant replies.

    The mask comes from character offsets (see `render_chat`): every token that overlaps what the model must
    generate after a generation prompt is trained, up to and including the template's end-of-turn special token
    that follows (`</s>` for Mistral, `<|eot_id|>` for Llama 3), with any whitespace before it.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise LLMTrainError("data.format 'messages' expects a list of {role, content} objects per example.")
    if template is None and tokenizer.chat_template is None:
        raise LLMTrainError(
            "rendering a chat needs a chat template, and this tokenizer (model.tokenizer) has none. Give a Jinja "
            "template file with data.chat_template: path/to/template.jinja, or use format prompt_completion "
            "without data.chat_template."
        )
    text, spans = render_chat(messages, tokenizer, template=template, first=first)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = special_ids(tokenizer)
    labels = [IGNORE] * len(ids)
    closed = True
    for start, end in spans:
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        j = inside[-1] + 1 if inside else next((i for i, (a, _) in enumerate(offsets) if a >= end), len(ids))
        k = j  # the end of the turn: the next special token, past whitespace the template puts before it
        while k < len(ids) and ids[k] not in special and not text[offsets[k][0]:offsets[k][1]].strip():
            k += 1
        closed = k < len(ids) and ids[k] in special
        for i in inside + (list(range(j, k + 1)) if closed else []):
            labels[i] = ids[i]
    if not closed:  # the template does not end the final assistant turn with a stop token: append EOS
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    if train_on_prompt:
        labels = list(ids)
    return ids, labels


def encode_example(example: dict, tokenizer, cfg: DataConfig, *, template: str | None = None) -> dict:
    """Format, tokenise and mask one example; truncate it to data.max_seq_len. `template`: read_template(cfg)."""
    chat = chat_of(example, cfg)
    if chat is not None:
        if template is None and isinstance(cfg.chat_template, str):
            template = read_template(cfg)
        ids, labels = encode_messages(chat[0], tokenizer, train_on_prompt=cfg.train_on_prompt, template=template,
                                      first=chat[1])
    elif cfg.format == "text":
        ids, labels = encode_text(str(_column(example, cfg, "text")), tokenizer)
    else:
        ids, labels = encode_prompt_completion(*prompt_and_completion(example, cfg), tokenizer,
                                               train_on_prompt=cfg.train_on_prompt)
    truncated = len(ids) > cfg.max_seq_len
    ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
    # The first token is never a target (nothing predicts it), so it does not count as trained.
    trained = sum(1 for lab in labels[1:] if lab != IGNORE)
    return {"input_ids": ids, "labels": labels, "length": len(ids), "trained": trained, "truncated": truncated}


# --------------------------------------------------------------------------- statistics


@dataclass
class DataStats:
    examples: int
    dropped: int
    truncated: int
    tokens: int
    trained_tokens: int
    length_p50: int
    length_p90: int
    length_p99: int
    length_max: int

    @property
    def trained_fraction(self) -> float:
        return self.trained_tokens / max(self.tokens, 1)


def compute_stats(lengths: list[int], trained: list[int], truncated: list[bool], dropped: int) -> DataStats:
    srt = sorted(lengths) or [0]

    def pct(q: float) -> int:
        return srt[min(len(srt) - 1, int(round(q * (len(srt) - 1))))]

    return DataStats(
        examples=len(lengths), dropped=dropped, truncated=sum(truncated), tokens=sum(lengths),
        trained_tokens=sum(trained), length_p50=pct(0.5), length_p90=pct(0.9), length_p99=pct(0.99),
        length_max=srt[-1],
    )


# --------------------------------------------------------------------------- the cached pipeline


def _fingerprint(paths: list[str], tokenizer, cfg: DataConfig, extra: str) -> str:
    h = hashlib.sha256()
    for p in paths:  # a dataset folder counts by the files in it
        for f in sorted(q for q in Path(p).rglob("*") if q.is_file()) if Path(p).is_dir() else [Path(p)]:
            st = f.stat() if f.exists() else None
            h.update(f"{f.resolve() if st else f}|{st.st_size if st else ''}|{st.st_mtime_ns if st else ''}".encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update(str(tokenizer.chat_template).encode())
    h.update(str(read_template(cfg)).encode())
    # The special tokens come from tokenizer_config.json, not tokenizer.json: EOS ends every example.
    h.update(str([tokenizer.bos_token, tokenizer.eos_token]).encode())
    keys = cfg.model_dump(exclude={"path", "packing", "cache_dir", "num_proc"})  # everything that changes a row
    h.update(json.dumps([keys, CACHE_VERSION, extra], sort_keys=True).encode())
    return h.hexdigest()[:16]


def tokenize_dataset(raw, tokenizer, cfg: DataConfig, source: str):
    """Tokenise a raw dataset; drop examples with no trained token left. Returns (dataset, stats)."""
    check_columns(raw.column_names, cfg, source)
    check_rows(raw, cfg, source)
    template = read_template(cfg)

    encoder = encode_pair if cfg.format == "preference" else encode_example

    def encode(example: dict, i: int) -> dict:
        try:
            return encoder(example, tokenizer, cfg, template=template)
        except LLMTrainError as e:  # a row the template cannot render: name it
            raise LLMTrainError(f"{source}, row {i + 1}: {e}") from None

    enc = raw.map(encode, with_indices=True, remove_columns=raw.column_names,
                  num_proc=cfg.num_proc if cfg.num_proc > 1 else None, desc=f"tokenising {source}",
                  load_from_cache_file=False)
    trained = enc["trained"]
    keep = [i for i, t in enumerate(trained) if t > 0]
    kept = enc.select(keep)
    stats = compute_stats(kept["length"], kept["trained"], kept["truncated"], dropped=len(enc) - len(keep))
    columns = PAIR_COLUMNS if cfg.format == "preference" else ["input_ids", "labels", "length"]
    return kept.select_columns(columns), stats  # length: token budgets bin by it (a pair: both sequences)


def load_eval(cfg: DataConfig, raw, *, seed: int):
    """Split off or load the eval rows as data.eval_split says, capped to data.eval_max_examples.

    Returns (train rows, eval rows or None, where the eval rows come from, in words)."""
    paths, split = _files(cfg.path), cfg.eval_split
    if split is None:
        return raw, None, ""
    if isinstance(split, float):
        parts = raw.train_test_split(test_size=split, seed=seed, shuffle=True)
        raw, evald, where = parts["train"], parts["test"], f"the data.eval_split={split} part of {', '.join(paths)}"
    elif is_split_name(split):
        if _is_local(paths) and not (len(paths) == 1 and Path(paths[0]).is_dir()):
            raise LLMTrainError(f"data.eval_split '{split}' is read as a split name, but data.path {paths} is files, "
                                "which have no splits. Give eval file(s) (with their extension), a fraction such "
                                "as 0.05, or a hub dataset / dataset folder as data.path.")
        evald, where = load_raw(cfg.path, name=cfg.name, split=split), f"split '{split}' of {paths[0]}"
    else:
        evald, where = load_raw(split), ", ".join(_files(split))
    if cfg.eval_max_examples is not None and len(evald) > cfg.eval_max_examples:
        # The first N of a seeded shuffle: the same rows on every run and every process, and no bias from how
        # the file is sorted.
        evald = evald.shuffle(seed=seed).select(range(cfg.eval_max_examples))
        where = f"{cfg.eval_max_examples} rows of {where}"
    return raw, evald, where


def prepare_datasets(cfg: DataConfig, tokenizer, *, seed: int):
    """Return (train, eval or None, {"train": DataStats, "eval": DataStats}, cache_hit).

    Results are cached under data.cache_dir keyed by the files, the tokenizer, the formatting options
    and the seed of the eval split. Call it on the main process first (`main_process_first`): the other
    processes then read the cache instead of tokenising again.
    """
    import datasets

    paths = _files(cfg.path)
    eval_paths = _files(cfg.eval_split) if isinstance(cfg.eval_split, (str, list)) and not is_split_name(
        cfg.eval_split) else []
    key = _fingerprint(paths + eval_paths, tokenizer, cfg, str(seed))
    cache = Path(cfg.cache_dir) / key
    if (cache / "stats.json").is_file():
        stats = {k: DataStats(**v) for k, v in json.loads((cache / "stats.json").read_text()).items()}
        train = datasets.load_from_disk(str(cache / "train"))
        evald = datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").exists() else None
        return train, evald, stats, True

    raw, raw_eval, where = load_eval(cfg, load_raw(cfg.path, name=cfg.name, split=cfg.split), seed=seed)
    train, train_stats = tokenize_dataset(raw, tokenizer, cfg, source=", ".join(paths))
    if len(train) == 0:
        raise LLMTrainError(f"no training example in {paths} has a trained token left after truncation to "
                            f"data.max_seq_len={cfg.max_seq_len}. Raise max_seq_len or check data.format/fields.")
    stats = {"train": train_stats}
    evald = None
    if raw_eval is not None:
        evald, stats["eval"] = tokenize_dataset(raw_eval, tokenizer, cfg, source=where)

    # Write under a temporary name and rename, so a crash never leaves a half-written cache behind.
    tmp = cache.with_name(f".{key}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train.save_to_disk(str(tmp / "train"))
    if evald is not None:
        evald.save_to_disk(str(tmp / "eval"))
    (tmp / "stats.json").write_text(json.dumps({k: asdict(v) for k, v in stats.items()}))
    try:
        tmp.rename(cache)
    except OSError:  # another run wrote the same cache first; use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return (datasets.load_from_disk(str(cache / "train")),
            datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").exists() else None, stats, False)
