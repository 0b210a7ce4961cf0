"""Data preparation: tokenise a whole source with its row checks, count it, and cache the result.

`prepare_datasets` is what `finetune`, `doctor` and `inspect-data` call: the rows are read (sources.py),
checked and encoded one by one (formats.py for examples, pairs.py for preference pairs), examples left with no
trained token are dropped and counted, and the result is cached under data.cache_dir.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from llmtrain.config import DataConfig, source_configs
from llmtrain.data.chat import read_template
from llmtrain.data.formats import (
    USER,
    absent_fields,
    check_columns,
    check_feedback_labels,
    encode_example,
    encode_prompt,
    row_problem,
)
from llmtrain.data.pairs import DROPS, MARGIN, PAIR_COLUMNS, encode_pair, pair_problem
from llmtrain.data.sources import files as _files
from llmtrain.data.sources import holds_json, is_split_name, load_raw, with_json_column
from llmtrain.data.sources import is_local as _is_local
from llmtrain.data.unpaired import UNPAIRED_COLUMNS, encode_unpaired, one_kind_problem, unpaired_problem
from llmtrain.errors import LLMTrainError

CACHE_VERSION = 17  # bump when tokenisation or masking changes, so old caches are not reused (15: the values of a
# column of several types as the file writes them, sources.as_written; 16: tool chats that cannot be meant refused;
# 17: the stats count the rows that call tools with no schemas, DataStats.untooled)
SOURCE = "source"  # a mixture's rows: which of data.sources a row comes from (its index)
ROW = "__llmtrain_row"  # a row's number in its file, kept through a shuffled eval split (0-based)
SHOWN_ROWS = 5  # dropped rows named in the report
KEEP_AT_LEAST = 0.1  # a source that keeps fewer of its rows stops the run: its recipe does not fit its data
NO_TRAINED = "with no trained token within data.max_seq_len"  # why an SFT example is dropped
BATCH_ROWS = 256  # rows encoded a batch at a time, and handed to datasets together
BATCH_BYTES = 4 << 20  # ...but no more raw data than this a batch: a batch of 128K-token rows is held at once


def _row_dicts(batch: dict) -> list[dict]:
    """A batch of columns ({column: values}) as its rows ({column: value} each)."""
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def _rows(raw):
    """The rows as dicts, read a thousand at a time (datasets' row-by-row iteration formats each row alone)."""
    for batch in raw.iter(batch_size=1000):
        yield from _row_dicts(batch)


def _batch_size(raw) -> int:
    """BATCH_ROWS rows a batch, fewer where the rows are long (64 chats of 120K tokens took 231 MiB more at the peak
    in one batch of 64, 96 MiB in batches of 8)."""
    per_row = raw.data.nbytes / max(raw.data.num_rows, 1)
    return max(1, min(BATCH_ROWS, int(BATCH_BYTES // max(per_row, 1))))


def as_arrays(out: dict) -> dict:
    """An encoded example with its token columns as numpy arrays, of the types datasets gives the lists (input_ids
    int32, labels int64): datasets writes an array at once, where it inspects a list element by element (a fifth of
    the preparation of 100K-token examples), and a batch of long rows held as arrays is a sixth of it as lists."""
    for column, dtype in (("input_ids", np.int32), ("labels", np.int64), ("cut_ids", np.int32),
                          ("cut_labels", np.int64)):  # (cut_: KTO's, typed even when empty, as every batch's must be)
        if isinstance(out.get(column), list):
            out[column] = np.asarray(out[column], dtype=dtype)
    return out


def check_rows(raw, cfg: DataConfig, source: str) -> None:
    """Refuse a dataset with a row the formatter cannot use, naming the file, the first such row in the file (an
    eval split shuffles the rest: its first would be any row), its problem, and how many others have one (instead
    of a traceback from inside the tokeniser, or a row silently counted as dropped)."""
    first, count = None, 0
    for i, example in enumerate(_rows(raw)):
        problem = {"preference": pair_problem, "unpaired": unpaired_problem}.get(cfg.format, row_problem)(example, cfg)
        if problem:
            count += 1
            here = (example.get(ROW, i) + 1, problem)
            first = here if first is None or here[0] < first[0] else first
    if first is not None:
        every = " (every row: a setting, not the data?)" if count == len(raw) else ""
        others = (f" {count - 1:,} other row{'s' if count > 2 else ''} of it {'have' if count > 2 else 'has'} a "
                  f"problem too{every}." if count > 1 else "")
        raise LLMTrainError(
            f"{source}, row {first[0]}: {first[1]} (data.format={cfg.format}).{others} Fix or remove that row, or set "
            "data.format / data.fields / data.roles to match the file."
        )


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
    drops: dict[str, int] = field(default_factory=dict)  # why rows were dropped (in words): how many
    one_token: int = 0  # rows that train one token alone (an empty reply: its stop token), over every row
    untooled: int = 0  # rows whose chat calls tools and gives no `tools` (schemas) to show the model
    # the first few dropped rows' numbers (1-based); a mixture's named with their file ('qa.jsonl:202')
    dropped_rows: list[int | str] = field(default_factory=list)

    @property
    def trained_fraction(self) -> float:
        return self.trained_tokens / max(self.tokens, 1)

    def dropped_text(self, unit: str = "examples") -> str:
        """'3 of 300 pairs dropped: 2 chosen equal to rejected, 1 no answer token within data.max_seq_len (rows 4,
        17, 42)': the report said once, at start-up and by doctor."""
        why = ", ".join(f"{n:,} {reason}" for reason, n in self.drops.items())
        more = ", ..." if self.dropped > len(self.dropped_rows) else ""
        rows = (f" (row{'s' if self.dropped > 1 else ''} {', '.join(map(str, self.dropped_rows))}{more})"
                if self.dropped_rows else "")
        return f"{self.dropped:,} of {self.examples + self.dropped:,} {unit} dropped{': ' + why if why else ''}{rows}"


def compute_stats(lengths: list[int], trained: list[int], truncated: list[bool], dropped: int, *,
                  drops: dict[str, int] | None = None, dropped_rows: list[int] | None = None,
                  untooled: int = 0) -> DataStats:
    srt = sorted(lengths) or [0]

    def pct(q: float) -> int:
        return srt[min(len(srt) - 1, int(round(q * (len(srt) - 1))))]

    return DataStats(
        examples=len(lengths), dropped=dropped, truncated=sum(truncated), tokens=sum(lengths),
        trained_tokens=sum(trained), length_p50=pct(0.5), length_p90=pct(0.9), length_p99=pct(0.99),
        length_max=srt[-1], drops=drops or {}, dropped_rows=dropped_rows or [], one_token=sum(t == 1 for t in trained),
        untooled=untooled,
    )


# --------------------------------------------------------------------------- the cached pipeline


_HOST = socket.gethostname().replace("-", "_")


def _remove_stale(folder: Path, key: str) -> None:
    """Temporary cache folders (.KEY.tmp-HOST-PID) of this host's processes that are gone (a kill while one was
    written): each the size of a tokenised dataset, they had piled up. Another host's (a cache folder on a shared
    disk) are left to it."""
    for tmp in folder.glob(f".{key}.tmp-{_HOST}-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                pass


def _unwritable(folder: Path) -> str | None:
    """Why the cache folder cannot be made or written (its nearest existing folder a file or read-only), or None."""
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                return f"'{above}' is a file, not a folder"
            return None if os.access(above, os.W_OK | os.X_OK) else f"the folder '{above}' is not writable"
    return None


def _fingerprint(paths: list[str], tokenizer, cfg: DataConfig, extra: str) -> str:
    h = hashlib.sha256()
    cache = Path(cfg.cache_dir).resolve()  # a dataset folder counts by the files in it, not a cache kept inside it
    # (data.cache_dir's default, .cache/..., under a folder run from: every run had written a new entry)
    for p in paths:
        for f in sorted(q for q in Path(p).rglob("*") if q.is_file() and cache not in q.resolve().parents) \
                if Path(p).is_dir() else [Path(p)]:
            st = f.stat() if f.exists() else None
            h.update(f"{f.resolve() if st else f}|{st.st_size if st else ''}|{st.st_mtime_ns if st else ''}".encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update(str(tokenizer.chat_template).encode())
    h.update(str(read_template(cfg, tokenizer)).encode())
    # The special tokens come from tokenizer_config.json, not tokenizer.json: EOS ends every example.
    h.update(str([tokenizer.bos_token, tokenizer.eos_token]).encode())
    keys = cfg.model_dump(exclude={"path", "packing", "cache_dir", "num_proc"})  # everything that changes a row
    h.update(json.dumps([keys, CACHE_VERSION, extra], sort_keys=True).encode())
    return h.hexdigest()[:16]


def tokenize_dataset(raw, tokenizer, cfg: DataConfig, source: str, *, tools: list[dict] | None = None):
    """Tokenise a raw dataset; drop examples with no trained token left. Returns (dataset, stats). `tools`: the
    schemas online RL's prompts are rendered with (rl.tools: data.tools.prompt_tools)."""
    check_columns(raw.column_names, cfg, source)
    check_feedback_labels(raw, cfg, source)
    check_rows(raw, cfg, source)
    template = read_template(cfg, tokenizer)

    encoder = {"preference": encode_pair, "unpaired": encode_unpaired,
               "prompt": functools.partial(encode_prompt, tools=tools)}.get(cfg.format, encode_example)

    # online RL's columns of values of several types (sources.as_written) go to the rewards as the file writes them:
    # written as JSON text here and read back as JSON (datasets would store their strings unquoted again)
    import datasets

    json_columns = [c for c, f in raw.features.items() if holds_json(f)] if cfg.format == "prompt" else []
    prompt_column = cfg.fields.get("prompt", "prompt")  # (the prepared rows' "prompt", whatever the file calls it)
    mixed = [("prompt" if c == prompt_column else USER + c) for c in json_columns]

    def encode(example: dict, i: int) -> dict:
        row = example.get(ROW, i)
        try:
            out = encoder(example, tokenizer, cfg, template=template)
        except LLMTrainError as e:  # a row the template cannot render: name it
            raise LLMTrainError(f"{source}, row {row + 1}: {e}") from None
        why = out.pop("drop", "") or ("" if out["trained"] else NO_TRAINED)
        out |= {c: None if out[c] is None else json.dumps(out[c]) for c in mixed if c in out}
        return {**out, "drop": DROPS.get(why, why), "row": row}

    def encode_batch(batch: dict, indices: list[int]) -> dict:  # rows in, rows out: datasets writes them at once
        outs = [as_arrays(encode(row, i)) for row, i in zip(_row_dicts(batch), indices)]
        return {k: [o[k] for o in outs] for k in outs[0]} if outs else {}

    # new_fingerprint: datasets would otherwise hash `encode` with the tokenizer inside it (a second per source);
    # its own cache is not used (load_from_cache_file=False: the result is cached under data.cache_dir).
    enc = raw.map(encode_batch, batched=True, batch_size=_batch_size(raw), with_indices=True,
                  remove_columns=raw.column_names, num_proc=cfg.num_proc if cfg.num_proc > 1 else None, desc=f"tokenising {source}",
                  load_from_cache_file=False,
                  new_fingerprint=hashlib.sha256(f"{raw._fingerprint}|{source}|{CACHE_VERSION}".encode()).hexdigest())
    for column in (c for c in mixed if c in enc.column_names):
        enc = enc.cast_column(column, datasets.Json())
    trained = enc["trained"]
    keep = [i for i, t in enumerate(trained) if t > 0]
    kept = enc.select(keep)
    dropped = [i for i, t in enumerate(trained) if t == 0]
    reasons = enc.select(dropped)["drop"] if dropped else []
    stats = compute_stats(kept["length"], kept["trained"], kept["truncated"], dropped=len(dropped),
                          drops=dict(Counter(reasons)),
                          dropped_rows=[r + 1 for r in enc.select(dropped[:SHOWN_ROWS])["row"]],
                          untooled=sum(kept["untooled"]) if "untooled" in kept.column_names else 0)
    if cfg.format == "prompt":  # the prompt as given, its tokens, its row; every other column for the rewards
        return kept.remove_columns(["trained", "truncated", "drop"]), stats
    # row: an example's number in its file (on-policy distillation seeds its completion with it)
    columns = {"preference": PAIR_COLUMNS + ([MARGIN] if MARGIN in kept.column_names else []),
               "unpaired": UNPAIRED_COLUMNS}.get(cfg.format, ["input_ids", "labels", "length", "row"])
    return kept.select_columns(columns), stats  # length: token budgets bin by it (a pair: both sequences)


def sources(cfg: DataConfig) -> tuple[str, str | None]:
    """Where the train rows and the eval rows come from, in words (for the errors that name a row): the files of
    data.path, and the eval part or file(s) (None without data.eval_split); a mixture's sources' together."""
    if cfg.sources is not None:
        parts = [sources(part) for part in source_configs(cfg)]
        return ", ".join(t for t, _ in parts), ", ".join(e for _, e in parts if e) or None
    paths, split = _files(cfg.path), cfg.eval_split
    if split is None:
        where = None
    elif isinstance(split, float):
        where = f"the data.eval_split={split} part of {', '.join(paths)}"
    elif is_split_name(split):
        where = f"split '{split}' of {paths[0]}"
    else:
        where = ", ".join(_files(split))
    if where is not None and cfg.eval_max_examples is not None:
        where = f"{where} (at most {cfg.eval_max_examples} rows of it)"
    return ", ".join(paths), where


def load_eval(cfg: DataConfig, raw, *, seed: int, key: str = "data.path"):
    """Split off or load the eval rows as data.eval_split says, capped to data.eval_max_examples. `key`: the recipe
    key that names the train rows' path.

    Returns (train rows, eval rows or None, where the eval rows come from, in words)."""
    paths, split = _files(cfg.path), cfg.eval_split
    if split is None:
        return raw, None, ""
    where = sources(cfg)[1]
    if isinstance(split, float):  # numbered first: a row of either part is named by its place in the file
        if (held := math.ceil(split * len(raw))) >= len(raw):  # the datasets library's count of eval rows
            raise LLMTrainError(f"data.eval_split={split:g} holds out {held:,} of the {len(raw):,} rows of {key}, "
                                "leaving none to train on. Set "
                                + ("data.eval_split" if key == "data.path" else key.replace(".path", ".eval_split"))
                                + " to a smaller fraction (e.g. 0.05) or give eval file(s)"
                                + (", or add rows." if len(raw) < 20 else "."))
        parts = raw.add_column(ROW, list(range(len(raw)))).train_test_split(test_size=split, seed=seed, shuffle=True)
        raw, evald = parts["train"], parts["test"]
    elif is_split_name(split):
        if _is_local(paths) and not (len(paths) == 1 and Path(paths[0]).is_dir()):
            raise LLMTrainError(f"data.eval_split '{split}' is read as a split name, but data.path {paths} is files, "
                                "which have no splits. Give eval file(s) (with their extension), a fraction such "
                                "as 0.05, or a hub dataset / dataset folder as data.path.")
        evald = load_raw(cfg.path, name=cfg.name, split=split)
    else:
        evald = load_raw(split, key="data.eval_split")
    if cfg.eval_max_examples is not None and len(evald) > cfg.eval_max_examples:
        # The first N of a seeded shuffle: the same rows on every run and every process, and no bias from how
        # the file is sorted. Numbered first, so that a row is still named by its place in the file.
        if ROW not in evald.column_names:
            evald = evald.add_column(ROW, list(range(len(evald))))
        evald = evald.shuffle(seed=seed).select(range(cfg.eval_max_examples))
    return raw, evald, where


def prepare_datasets(cfg: DataConfig, tokenizer, *, seed: int, tools: list[dict] | None = None):
    """Return (train, eval or None, {"train": DataStats, "eval": DataStats}, cache_hit).

    Results are cached under data.cache_dir keyed by the files, the tokenizer, the formatting options
    and the seed of the eval split (and online RL's tools, which its prompts are rendered with). Call it on the
    main process first (collectives.main_first): the other processes then read the cache instead of tokenising
    again. A mixture (data.sources) is each source prepared as data.path would be, concatenated in the recipe's
    order with a `source` column (its index); its stats add "source0", "source1", ... beside the totals.
    """
    import datasets

    parts = source_configs(cfg)
    paths = [f for part in parts for f in _files(part.path)]
    eval_paths = [f for part in parts if isinstance(part.eval_split, (str, list)) and not is_split_name(
        part.eval_split) for f in _files(part.eval_split)]
    tooled = json.dumps(tools, sort_keys=True) if tools else ""  # no tools: the key of before
    key = _fingerprint(paths + eval_paths, tokenizer, cfg, str(seed) + tooled)
    cache = Path(cfg.cache_dir) / key
    if (cache / "stats.json").is_file() and _empty_eval(cache):
        shutil.rmtree(cache, ignore_errors=True)
    if (cache / "stats.json").is_file():
        stats = {k: DataStats(**v) for k, v in json.loads((cache / "stats.json").read_text()).items()}
        train = datasets.load_from_disk(str(cache / "train"))
        evald = datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").exists() else None
        return train, evald, stats, True

    if problem := _unwritable(Path(cfg.cache_dir).absolute()):  # said before any row is tokenised (a traceback once
        # they all were; the default cache_dir is under the folder a run starts from: audit 46)
        raise LLMTrainError(f"data.cache_dir '{cfg.cache_dir}' cannot take the tokenised data: {problem}. The run "
                            "reads its data from there (every process, and a precomputed reference beside it): set "
                            "data.cache_dir to a folder you can write.")
    trains, evals, stats = [], [], {}
    for i, part in enumerate(parts):
        train, evald, part_stats = _prepare_source(part, tokenizer, seed=seed, tools=tools,
                                                   key=f"data.sources[{i}].path" if cfg.sources else "data.path")
        if cfg.sources is not None:
            train = train.add_column(SOURCE, [i] * len(train))
            evald = evald.add_column(SOURCE, [i] * len(evald)) if evald is not None else None
            stats.update({f"{SOURCE}{i}": part_stats["train"]}
                         | ({f"{SOURCE}{i}_eval": part_stats["eval"]} if "eval" in part_stats else {}))
        trains.append(train)
        evals += [evald] if evald is not None else []
    if cfg.sources is None:
        stats = part_stats
    else:
        train = _concatenate(trains, parts, "train")
        evald = _concatenate(evals, [p for p in parts if p.eval_split is not None], "eval") if evals else None
        names = [Path(p.path).name for p in parts]
        stats["train"] = merge_stats([stats[f"{SOURCE}{i}"] for i in range(len(parts))], train["length"], names)
        if evals:
            held = [i for i in range(len(parts)) if f"{SOURCE}{i}_eval" in stats]
            stats["eval"] = merge_stats([stats[f"{SOURCE}{i}_eval"] for i in held], evald["length"],
                                        [names[i] for i in held])

    # Write under a temporary name and rename, so a crash never leaves a half-written cache behind.
    tmp = cache.with_name(f".{key}.tmp-{_HOST}-{os.getpid()}")
    _remove_stale(cache.parent, key)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        train.save_to_disk(str(tmp / "train"))
        if evald is not None:
            evald.save_to_disk(str(tmp / "eval"))
        (tmp / "stats.json").write_text(json.dumps({k: asdict(v) for k, v in stats.items()}))
    except OSError as e:  # a full disk, a folder that became read-only: one paragraph, nothing half-written left
        shutil.rmtree(tmp, ignore_errors=True)
        raise LLMTrainError(f"the tokenised data could not be written to data.cache_dir '{cfg.cache_dir}' "
                            f"({e.strerror or e}); the run reads it from there (every process, and a precomputed "
                            "reference beside it). Free space there, or set data.cache_dir to a writable folder; "
                            "nothing else was written.") from None
    try:
        tmp.rename(cache)
    except OSError:  # another run wrote the same cache first; use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return (datasets.load_from_disk(str(cache / "train")),
            datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").exists() else None, stats, False)


def _empty_eval(cache: Path) -> bool:
    """Whether a cache entry holds an eval split of no rows, which datasets cannot read back (written before such an
    eval was refused): removed, and the data prepared again (and refused in one paragraph where it still has none)."""
    try:
        return json.loads((cache / "stats.json").read_text()).get("eval", {}).get("examples") == 0
    except (OSError, ValueError, AttributeError):
        return False


def prepare_recipe(recipe, tokenizer):
    """prepare_datasets for a recipe: its data, its seed, and online RL's tools (rendered into its prompts)."""
    from llmtrain.data.tools import prompt_tools

    return prepare_datasets(recipe.data, tokenizer, seed=recipe.train.seed, tools=prompt_tools(recipe))


def _length_hint(raw, tokenizer, cfg: DataConfig, rows: int = 1000) -> str:
    """What data.max_seq_len the examples ask (SFT's formats): '; 512 keeps 96% of the first 1,000 examples whole, the
    longest is 700 tokens': their full lengths read again without the cut, the 95th percentile rounded up to a
    multiple of 64 and the share that keeps (it had said 95% of a length that kept them all); '' for the other
    formats."""
    if cfg.format in ("preference", "unpaired", "prompt"):
        return ""
    whole = cfg.model_copy(update={"max_seq_len": 2**31 - 1})
    template = read_template(cfg, tokenizer)
    sample = raw.select(range(min(rows, len(raw))))
    lengths = sorted(encode_example(row, tokenizer, whole, template=template)["length"] for row in _rows(sample))
    if not lengths:
        return ""
    most = lengths[math.ceil(0.95 * len(lengths)) - 1]
    most = -(-most // 64) * 64  # up to a multiple of 64
    first = f"the first {len(lengths):,} " if len(lengths) < len(raw) else "the "
    kept = sum(n <= most for n in lengths)
    share = f"every one of {first}examples" if kept == len(lengths) else \
        f"{math.floor(100 * kept / len(lengths))}% of {first}examples"
    return f"; {most} keeps {share} whole, the longest is {lengths[-1]:,} tokens"


def _prepare_source(cfg: DataConfig, tokenizer, *, seed: int, tools: list[dict] | None = None,
                    key: str = "data.path"):
    """One dataset's train and eval rows, tokenised and checked: (train, eval or None, its stats). `key`: the recipe
    key that names its path (a mixture's data.sources[N].path: it had been called data.path)."""
    paths = _files(cfg.path)
    raw, raw_eval, where = load_eval(cfg, load_raw(cfg.path, name=cfg.name, split=cfg.split, key=key), seed=seed,
                                     key=key)
    check_columns(raw.column_names, cfg, ", ".join(paths))
    if raw_eval is not None:  # before the train rows are tokenised: eval rows of another dataset stop the run too
        _check_eval_columns(raw_eval.column_names, cfg, where)
    train, train_stats = tokenize_dataset(raw, tokenizer, cfg, source=", ".join(paths), tools=tools)
    rows = train_stats.examples + train_stats.dropped
    unit = "pairs" if cfg.format == "preference" else "examples"  # unpaired (KTO): one completion a row
    if train_stats.examples < KEEP_AT_LEAST * rows:  # nothing, or almost nothing, is left to train on
        cut = any("max_seq_len" in why for why in train_stats.drops)  # dropped for the cut, not for what they hold
        longer = (f"Raise data.max_seq_len (now {cfg.max_seq_len}{_length_hint(raw, tokenizer, cfg)}), or check "
                  if cut else "Check ")
        raise LLMTrainError(f"only {train_stats.examples:,} of the {rows:,} {unit} in {', '.join(paths)} can be "
                            f"trained ({train_stats.dropped_text(unit)}). {longer}data.format / data.fields against "
                            "the file.")
    if cfg.format == "unpaired" and (one_kind := one_kind_problem(train["label"], ", ".join(paths), cfg)):
        raise LLMTrainError(one_kind)
    stats = {"train": train_stats}
    evald = None
    if raw_eval is not None:
        evald, stats["eval"] = tokenize_dataset(raw_eval, tokenizer, cfg, source=where, tools=tools)
        if not stats["eval"].examples:  # (an IndexError of datasets' had followed, and every later run hit it)
            held = stats["eval"].dropped
            cut = any("max_seq_len" in why for why in stats["eval"].drops)
            longer = f"Raise data.max_seq_len (now {cfg.max_seq_len}), or give " if cut else "Give "
            split = key.removesuffix("path") + "eval_split"  # a mixture's source: data.sources[N].eval_split
            raise LLMTrainError(f"none of the {held:,} eval {unit} in {where} ({split}) can be evaluated "
                                f"({stats['eval'].dropped_text(unit)}). {longer}eval rows that keep a trained token, "
                                f"or set {split}=null to train without them.")
    return train, evald, stats


def _check_eval_columns(columns: list[str], cfg: DataConfig, where: str) -> None:
    """The eval rows' columns, once the train rows' fit data.format: eval data of another dataset (the tiny recipe's
    eval file kept under a data.path override) is named as such, not as a data.fields problem."""
    if absent := absent_fields(columns, cfg):
        raise LLMTrainError(
            f"the eval rows ({where}, data.eval_split) have columns {columns}, without "
            f"{[cfg.fields.get(f, f) for f in absent]}, which data.path's rows "
            f"have and data.format '{cfg.format}' reads: they are not the same kind of data. Give data.eval_split "
            "eval rows with the train rows' columns, or a held-out fraction of data.path (data.eval_split=0.05)."
        )


def _concatenate(parts: list, configs: list[DataConfig], what: str):
    """The sources' prepared rows as one dataset, in the recipe's order; they must have the same columns (a mode's
    rows do, but for online RL's prompts, whose other columns go to the reward functions)."""
    import datasets

    columns = [set(p.column_names) for p in parts]
    for cfg, cols in zip(configs[1:], columns[1:]):
        if cols != columns[0]:
            raise LLMTrainError(
                f"the {what} rows of data.sources do not have the same columns: {configs[0].path} has "
                f"{sorted(columns[0] - {SOURCE})}, {cfg.path} has {sorted(cols - {SOURCE})}. A mixture trains "
                "rows of one shape: rename the columns with each source's fields, or give the sources the same "
                "columns (online RL's reward functions read them).")
    # a column some source holds as JSON values (sources.as_written) and another as plain ones: the plain ones
    # written as JSON text first (a cast would parse a string "42" as 42, the way datasets' reader had)
    mixed = {c for p in parts for c, f in p.features.items() if holds_json(f)}
    for i, part in enumerate(parts):
        for column in (c for c in mixed if not holds_json(part.features[c])):
            part = with_json_column(part, column, part[column])
        parts[i] = part
    try:
        return datasets.concatenate_datasets([p.cast(parts[0].features) for p in parts])
    except (ValueError, TypeError) as e:
        raise LLMTrainError(f"the {what} rows of data.sources cannot be put together: {str(e).splitlines()[0]}. "
                            "Give every source's columns the same types.") from None


def merge_stats(parts: list[DataStats], lengths, names: list[str]) -> DataStats:
    """The sources' stats as one dataset's: counts added, percentiles over every kept example's length; the dropped
    rows named with their file (`names`: each source's), each source with drops among them (the first source's
    numbers alone had been shown, as if of one file; audit 41)."""
    drops: Counter = Counter()
    for part in parts:
        drops.update(part.drops)
    named = [[f"{name}:{row}" for row in part.dropped_rows] for part, name in zip(parts, names)]
    shown = [row for rank in itertools.zip_longest(*named) for row in rank if row is not None][:SHOWN_ROWS]
    merged = compute_stats(list(lengths), [], [], dropped=sum(p.dropped for p in parts), drops=dict(drops),
                           dropped_rows=shown)
    return replace(merged, truncated=sum(p.truncated for p in parts),
                   trained_tokens=sum(p.trained_tokens for p in parts),
                   # (a mixture's empty replies had counted none: the sources' rows are not read again here)
                   one_token=sum(p.one_token for p in parts), untooled=sum(p.untooled for p in parts))
