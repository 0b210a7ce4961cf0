"""Data: read the source, format each example, tokenise it and build its loss mask, cache the result.

Every example becomes `input_ids` and `labels` of equal length, with -100 in `labels` where no loss
falls. Labels are aligned with the inputs (not shifted); the collator shifts them per example so that
packing can never make the last token of one example predict the first token of the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmtrain.config import DataConfig
from llmtrain.errors import LLMTrainError

IGNORE = -100
CACHE_VERSION = 3  # bump when tokenisation or masking changes, so old caches are not reused

# The columns each format reads, by their canonical names; `data.fields` maps them to dataset columns.
FORMAT_FIELDS = {
    "alpaca": ("instruction", "input", "output"),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
OPTIONAL_FIELDS = {"input"}

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{ctx}. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# --------------------------------------------------------------------------- reading


def _files(path: str | list[str]) -> list[str]:
    return [path] if isinstance(path, str) else list(path)


def _is_local(paths: list[str]) -> bool:
    return any(Path(p).exists() or Path(p).suffix in _LOADERS for p in paths)


def load_raw(path: str | list[str], *, name: str | None = None, split: str = "train"):
    """Load local files (jsonl, json, parquet, csv) or a hub dataset into a `datasets.Dataset`."""
    import datasets

    paths = _files(path)
    if _is_local(paths):
        for p in paths:
            if not Path(p).is_file():
                raise LLMTrainError(f"data file '{p}' does not exist (data.path or data.eval_split). Check the path.")
        kinds = {_LOADERS.get(Path(p).suffix) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise LLMTrainError(
                f"data files {paths} must all be one of {sorted(_LOADERS)}; mixed or unknown extensions."
            )
        try:
            return datasets.load_dataset(kinds.pop(), data_files=paths, split="train")
        except Exception as e:  # datasets raises many types for malformed files
            raise LLMTrainError(f"could not read data file(s) {paths}: {e}") from None
    try:
        return datasets.load_dataset(paths[0], name, split=split)
    except Exception as e:
        raise LLMTrainError(
            f"could not load hub dataset '{paths[0]}' (data.path): {e}. Without network access, download it first "
            "or point data.path at local .jsonl/.json/.parquet/.csv files."
        ) from None


# --------------------------------------------------------------------------- formatting and masking


def _column(example: dict, cfg: DataConfig, field: str) -> Any:
    return example.get(cfg.fields.get(field, field))


def check_columns(columns: list[str], cfg: DataConfig, source: str) -> None:
    missing = [
        f"{f} (column '{cfg.fields.get(f, f)}')"
        for f in FORMAT_FIELDS[cfg.format]
        if f not in OPTIONAL_FIELDS and cfg.fields.get(f, f) not in columns
    ]
    if missing:
        raise LLMTrainError(
            f"data.format '{cfg.format}' needs {', '.join(missing)} but {source} has columns {columns}. "
            f"Map them with data.fields, e.g. data.fields.{FORMAT_FIELDS[cfg.format][0]}=<column>."
        )


def row_problem(example: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one raw row for data.format, in words; None when it can be formatted."""
    if cfg.format == "messages":
        messages = _column(example, cfg, "messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' is not a non-empty list of {role, content} objects"
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"message {k} has no 'role'"
            if not isinstance(m.get("content"), str):
                got = m.get("content")
                return (f"message {k} ({m['role']}) has no 'content'" if got is None else
                        f"message {k} ({m['role']}) has content {got!r} ({type(got).__name__}), not a string")
        if not any(m["role"] == "assistant" for m in messages):
            return "the conversation has no assistant message, so nothing would be trained"
        return None
    for field in FORMAT_FIELDS[cfg.format]:
        value = _column(example, cfg, field)
        if value is None and field not in OPTIONAL_FIELDS:
            return f"'{cfg.fields.get(field, field)}' ({field}) is empty"
        if isinstance(value, (dict, list)):
            return f"'{cfg.fields.get(field, field)}' ({field}) is a {type(value).__name__}, not text"
    return None


def check_rows(raw, cfg: DataConfig, source: str) -> None:
    """Refuse a dataset with a row the formatter cannot use, naming the file, the row and the problem (instead
    of a traceback from inside the tokeniser, or a row silently counted as dropped)."""
    for i, example in enumerate(raw):
        problem = row_problem(example, cfg)
        if problem:
            raise LLMTrainError(
                f"{source}, row {i + 1}: {problem} (data.format={cfg.format}). Fix or remove that row, or set "
                "data.format / data.fields to match the file."
            )


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


def _assistant_spans(messages: list[dict], text: str, tokenizer) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in the rendered conversation `text`.

    The conversation is rendered a second time with each assistant content replaced by a unique
    private-use marker, so the markers' positions are exact: a short reply ("ant") can never be matched
    inside template markup (`<|assistant|>`) or an earlier user turn. Templates may trim the content
    (Mistral's and Llama 3's do: `content|trim`), so each reply is matched as given or stripped,
    between the exact template pieces around its marker. Only if the template rewrites content in
    another way does this fall back to searching for each content in order.
    """
    contents = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
    marks = iter(f"\ue000{i}\ue001" for i in range(len(contents)))
    marked = [{**m, "content": next(marks)} if m["role"] == "assistant" else m for m in messages]
    pieces = re.split("\ue000(\\d+)\ue001", tokenizer.apply_chat_template(marked, tokenize=False))
    # pieces = [P0, "0", P1, "1", P2, ...]: the template text between the markers, each marker once, in order.
    spans, pos = [], len(pieces[0])
    if pieces[1::2] == [str(i) for i in range(len(contents))] and text.startswith(pieces[0]):
        for content, after in zip(contents, pieces[2::2]):
            shown = next((c for c in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip()))
                          if text.startswith(c + after, pos)), None)
            if shown is None:
                break
            spans.append((pos, pos + len(shown)))
            pos += len(shown) + len(after)
        if len(spans) == len(contents) and pos == len(text):
            return [(a, b) for a, b in spans if b > a]
    spans, cursor = [], 0
    for content in contents:
        start = text.find(content, cursor) if content else cursor
        if start < 0:
            raise LLMTrainError("an assistant message does not appear verbatim in the chat template's output, "
                                "so its loss mask cannot be built. Use format prompt_completion instead.")
        if content:
            spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_messages(messages: list[dict], tokenizer, *, train_on_prompt: bool) -> tuple[list, list]:
    """Render with the tokenizer's own chat template and train only the assistant turns.

    The mask comes from character offsets: each assistant message's content is located in the rendered
    text, and every token overlapping it is trained, plus the template's end-of-turn special token that
    follows it (`</s>` for Mistral, `<|eot_id|>` for Llama 3). This holds for templates that move the
    system prompt around or merge turns, where rendering prefixes one turn at a time would not.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise LLMTrainError("data.format 'messages' expects a list of {role, content} objects per example.")
    if tokenizer.chat_template is None:
        raise LLMTrainError(
            "data.format 'messages' needs a tokenizer with a chat template, and this one has none. "
            "Use format prompt_completion, or a tokenizer (model.tokenizer) that ships a chat_template."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_spans(messages, text, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = set(tokenizer.all_special_ids)
    labels = [IGNORE] * len(ids)
    closed = True
    for start, end in spans:
        last = None
        for i, (a, b) in enumerate(offsets):
            if a < end and b > start and b > a:
                labels[i], last = ids[i], i
        # Train the stop token that closes the turn, skipping whitespace the template puts before it.
        j = (last + 1) if last is not None else len(ids)
        while j < len(ids) and ids[j] not in special and not text[offsets[j][0]:offsets[j][1]].strip():
            j += 1
        closed = j < len(ids) and ids[j] in special
        if closed:
            labels[j] = ids[j]
    if not closed:  # the template does not end the final assistant turn with a stop token: append EOS
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    if train_on_prompt:
        labels = list(ids)
    return ids, labels


def encode_example(example: dict, tokenizer, cfg: DataConfig) -> dict:
    """Format, tokenise and mask one example; truncate it to data.max_seq_len."""
    if cfg.format == "messages":
        ids, labels = encode_messages(_column(example, cfg, "messages"), tokenizer, train_on_prompt=cfg.train_on_prompt)
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
    for p in paths:
        st = Path(p).stat() if Path(p).exists() else None
        h.update(f"{Path(p).resolve() if st else p}|{st.st_size if st else ''}|{st.st_mtime_ns if st else ''}".encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update(str(tokenizer.chat_template).encode())
    # The special tokens come from tokenizer_config.json, not tokenizer.json: EOS ends every example.
    h.update(str([tokenizer.bos_token, tokenizer.eos_token]).encode())
    keys = cfg.model_dump(include={"name", "split", "format", "fields", "max_seq_len", "train_on_prompt"})
    h.update(json.dumps([keys, CACHE_VERSION, extra], sort_keys=True).encode())
    return h.hexdigest()[:16]


def tokenize_dataset(raw, tokenizer, cfg: DataConfig, source: str):
    """Tokenise a raw dataset; drop examples with no trained token left. Returns (dataset, stats)."""
    check_columns(raw.column_names, cfg, source)
    check_rows(raw, cfg, source)
    enc = raw.map(lambda ex: encode_example(ex, tokenizer, cfg), remove_columns=raw.column_names,
                  num_proc=cfg.num_proc if cfg.num_proc > 1 else None, desc=f"tokenising {source}",
                  load_from_cache_file=False)
    trained = enc["trained"]
    keep = [i for i, t in enumerate(trained) if t > 0]
    kept = enc.select(keep)
    stats = compute_stats(kept["length"], kept["trained"], kept["truncated"], dropped=len(enc) - len(keep))
    return kept.select_columns(["input_ids", "labels", "length"]), stats  # length: token budgets bin by it


def prepare_datasets(cfg: DataConfig, tokenizer, *, seed: int):
    """Return (train, eval or None, {"train": DataStats, "eval": DataStats}, cache_hit).

    Results are cached under data.cache_dir keyed by the files, the tokenizer, the formatting options
    and the seed of the eval split. Call it on the main process first (`main_process_first`): the other
    processes then read the cache instead of tokenising again.
    """
    import datasets

    paths = _files(cfg.path)
    eval_paths = [] if cfg.eval_split is None or isinstance(cfg.eval_split, float) else _files(cfg.eval_split)
    key = _fingerprint(paths + eval_paths, tokenizer, cfg, f"{cfg.eval_split}|{seed}")
    cache = Path(cfg.cache_dir) / key
    if (cache / "stats.json").is_file():
        stats = {k: DataStats(**v) for k, v in json.loads((cache / "stats.json").read_text()).items()}
        train = datasets.load_from_disk(str(cache / "train"))
        evald = datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").exists() else None
        return train, evald, stats, True

    raw = load_raw(cfg.path, name=cfg.name, split=cfg.split)
    raw_eval = None
    if isinstance(cfg.eval_split, float):
        parts = raw.train_test_split(test_size=cfg.eval_split, seed=seed, shuffle=True)
        raw, raw_eval = parts["train"], parts["test"]
    elif eval_paths:
        raw_eval = load_raw(eval_paths, name=cfg.name, split=cfg.split)
    train, train_stats = tokenize_dataset(raw, tokenizer, cfg, source=", ".join(paths))
    if len(train) == 0:
        raise LLMTrainError(f"no training example in {paths} has a trained token left after truncation to "
                            f"data.max_seq_len={cfg.max_seq_len}. Raise max_seq_len or check data.format/fields.")
    stats = {"train": train_stats}
    evald = None
    if raw_eval is not None:
        where = ", ".join(eval_paths) if eval_paths else f"the data.eval_split={cfg.eval_split} part of {', '.join(paths)}"
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
