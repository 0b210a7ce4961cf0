"""Reading a data source: local files (jsonl, json, parquet, csv), a dataset folder, or a hub dataset."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmtrain.errors import LLMTrainError

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def files(path: str | list[str]) -> list[str]:
    return [path] if isinstance(path, str) else list(path)


def is_local(paths: list[str]) -> bool:
    return any(Path(p).exists() or Path(p).suffix in _LOADERS for p in paths)


def is_split_name(value: Any) -> bool:
    """data.eval_split names a split ('test', 'validation[:500]') rather than a file: one word, no data-file
    extension, and no such file."""
    return (isinstance(value, str) and Path(value).suffix not in _LOADERS and not Path(value).is_file()
            and re.fullmatch(r"[\w.-]+(\[[^\]]*\])?", value) is not None)


def _no_rows(path: str, kind: str) -> bool:
    """Whether a text data file (json, jsonl, csv) holds nothing but white space: the datasets library's errors for
    it are empty or its own ("Instruction 'train' corresponds to no data!"). Read a block at a time."""
    if kind not in ("json", "csv"):
        return False
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if block.strip():
                return False
    return True


def first_row(path: str | list[str] | None, *, split: str = "train") -> dict | None:
    """The first row of local data (the first of several files; a dataset folder's `split`), without loading the
    rest: a JSON-lines file's first line, another file's or a folder's first row streamed by datasets (it had been
    JSON lines alone, so a parquet file of the same rows read as another form of data). None for a hub dataset or
    what cannot be read so."""
    import json

    first = files(path)[0] if path else None
    if first is None or not Path(first).exists():
        return None
    if Path(first).suffix == ".jsonl" and Path(first).is_file():
        try:
            with open(first, encoding="utf-8") as f:
                line = next((ln for ln in f if ln.strip()), None)
            row = json.loads(line) if line is not None else None
        except (OSError, ValueError):
            return None
        return row if isinstance(row, dict) else None
    try:
        import datasets

        kind = _LOADERS.get(Path(first).suffix)
        rows = (datasets.load_dataset(kind, data_files=[first], split="train", streaming=True) if kind else
                datasets.load_dataset(first, split=split, streaming=True) if Path(first).is_dir() else None)
        row = next(iter(rows), None) if rows is not None else None
    except Exception:  # datasets raises many types for what it cannot read: the data's own checks say why
        return None
    return row if isinstance(row, dict) else None


def load_raw(path: str | list[str], *, name: str | None = None, split: str = "train", key: str = "data.path"):
    """Load local files (jsonl, json, parquet, csv), a dataset folder (its files named by split, as on the hub)
    or a hub dataset into a `datasets.Dataset`. `key`: the recipe key that names it, for the refusals."""
    import datasets

    paths = files(path)
    folder = len(paths) == 1 and Path(paths[0]).is_dir()
    if is_local(paths) and not folder:
        for p in paths:
            if Path(p).is_dir():  # (it had been said not to exist)
                raise LLMTrainError(f"'{p}' ({key}) is a folder among several paths: a list names files, and a "
                                    f"dataset folder is {key} alone. Give its files, or the folder by itself")
            if not Path(p).is_file():
                raise LLMTrainError(f"data file '{p}' does not exist ({key}). Check the path.")
        kinds = {_LOADERS.get(Path(p).suffix) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise LLMTrainError(
                f"data files {paths} must all be one of {sorted(_LOADERS)}; mixed or unknown extensions."
            )
        kind = kinds.pop()
        if empty := [p for p in paths if _no_rows(p, kind)]:
            raise LLMTrainError(f"data file '{empty[0]}' ({key}) holds no rows: it is empty or blank. Check the "
                                "path, or write its rows (one JSON object a line for .jsonl).")
        if kind in ("json", "csv") and (problem := next(filter(None, (not_utf8(p, key) for p in paths)), None)):
            raise LLMTrainError(problem)
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own log line of the failure: ours says it
        try:
            loaded = datasets.load_dataset(kind, data_files=paths, split="train")
        except Exception as e:  # datasets raises many types for malformed files
            where = next(filter(None, map(bad_json_line, paths)), None) if kind == "json" else None
            raise LLMTrainError(where or _columns_differ(paths, key) or
                                f"could not read data file(s) {paths} ({key}): {_innermost(e)}") from None
        finally:
            datasets.logging.set_verbosity(verbosity)
        return as_written(loaded, paths) if kind == "json" else loaded
    missing = _missing_local(paths[0])
    if missing:
        raise LLMTrainError(missing)
    try:
        return datasets.load_dataset(paths[0], name, split=split)
    except Exception as e:
        where = "dataset folder" if folder else "hub dataset"
        raise LLMTrainError(
            f"could not load split '{split}' of {where} '{paths[0]}' (data.path, data.name={name}, data.split or "
            f"data.eval_split): {e}. Without network access, download it first or point data.path at local "
            ".jsonl/.json/.parquet/.csv files."
        ) from None


def as_written(ds, paths: list[str]):
    """`ds` with each column that datasets read as JSON values (a column whose rows hold values of several types: a
    plain prompt beside a conversation, an answer 5 beside "7") holding the values as the files write them. datasets
    5 keeps such a column's strings unquoted and parses every one back on reading, so the text "true" came back as
    True, "1e3" as 1000.0, "null" as None (audit 50: reward functions got them, a KTO label "false" trained as
    false). Those columns are read again from the files, each value stored as its JSON text (a string quoted)."""
    mixed = [c for c, f in ds.features.items() if holds_json(f)]
    if not mixed:
        return ds
    try:
        rows = [row for p in paths for row in _json_rows(p)]
    except (OSError, ValueError):  # what datasets read and Python's json does not: left as datasets read it
        return ds
    if len(rows) != len(ds) or not all(isinstance(r, dict) for r in rows):  # not rows datasets read one a line
        return ds
    order = ds.column_names
    for column in mixed:
        ds = with_json_column(ds, column, [row.get(column) for row in rows])
    return ds.select_columns(order)


def holds_json(feature) -> bool:
    """Whether a datasets feature is, or holds at any depth, datasets' Json (a column of values of several types)."""
    return "Json(" in repr(feature)


def with_json_column(ds, column: str, values: list):
    """`ds` with `column` replaced by `values` stored as their JSON text in a Json column, so each reads back as
    written (datasets' own encoding keeps a string unquoted and parses it back). Added beside the old column first:
    a table of that column alone would be left with no rows."""
    import datasets

    written = f"__llmtrain_as_written_{column}"
    ds = ds.add_column(written, [None if v is None else json.dumps(v) for v in values], feature=datasets.Json())
    return ds.remove_columns(column).rename_column(written, column)


def _json_rows(path: str) -> list:
    """A .json/.jsonl file's rows as Python reads them: a JSON array's items, or one object a non-blank line."""
    text = Path(path).read_text(encoding="utf-8-sig")
    try:
        whole = json.loads(text)
    except ValueError:
        # split on "\n" alone (str.splitlines also splits inside a string at U+2028 and the like; JSON Lines do not)
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    return whole if isinstance(whole, list) else [whole]


def _innermost(e: BaseException) -> str:
    """What datasets' "An error occurred while generating the dataset" was caused by (a CSV line of 3 fields where
    2 were expected, a cast between files' columns), said with it: the outer message alone named nothing."""
    inner = e
    while (nxt := inner.__cause__ or inner.__context__) is not None and nxt is not inner:
        inner = nxt
    return str(e) if inner is e else f"{e} ({type(inner).__name__}: {str(inner).strip().splitlines()[0][:300]})"


def _columns_differ(paths: list[str], key: str) -> str | None:
    """Several files whose rows have different columns (datasets refuses to join them): which file has which."""
    if len(paths) < 2:
        return None
    columns = {p: sorted(row) for p in paths if (row := first_row(p)) is not None}
    if len({tuple(c) for c in columns.values()}) < 2:
        return None
    listed = "; ".join(f"'{p}' has {c}" for p, c in columns.items())
    return (f"the data files of {key} have different columns ({listed}), and they are read as one table: give "
            "files of the same columns, or each file its own entry of data.sources (a mixture: docs/data.md)")


def not_utf8(path: str, key: str = "data.path") -> str | None:
    """Where a text data file is not UTF-8 (a Latin-1 or Windows-1252 export): the file, the line and the byte, in
    one paragraph; None if it decodes. Read a block at a time (datasets had loaded it and the row checks then ended
    in a UnicodeDecodeError traceback naming no file)."""
    import codecs

    decoder, line, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = max(e.start - len(e.object) + len(block), 0)  # (the decoder's buffer holds a split character)
                line += block[:at].count(b"\n")
                byte = block[at] if at < len(block) else 0
                return (f"data file '{path}' ({key}) line {line:,}: byte 0x{byte:02x} at byte offset "
                        f"{offset + at:,} of the file is not UTF-8: the file is in another encoding (Latin-1 or "
                        "Windows-1252?). Re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW) and point "
                        f"{key} at that.")
            if not block:
                return None
            line, offset = line + block.count(b"\n"), offset + len(block)


def bad_json_line(path: str) -> str | None:
    """Where a .jsonl file (one object a line) or a .json file is not valid JSON: the file, its first bad line
    (counted from 1, as an editor counts) and what is wrong there, in one paragraph; None if it parses."""
    import json

    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if path.endswith(".json"):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return (f"data file '{path}' line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}). Fix the file, "
                    "or give one JSON object a line as a .jsonl file.")
        return None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (f"data file '{path}' line {number}: not valid JSON ({e.msg}, column {e.colno}): "
                    f"{line[:80]!r}{'...' if len(line) > 80 else ''}. Fix or remove that line (a .jsonl file holds "
                    "one JSON object a line).")
        if not isinstance(row, dict):
            return (f"data file '{path}' line {number}: a JSON {type(row).__name__}, not an object "
                    "({\"prompt\": ..., ...}). Each line of a .jsonl file must be one JSON object, a row of the data.")
    return None


def _missing_local(value: str) -> str | None:
    """What to say when `value` is a local path (hub.is_local_path: ../shared/data/gsm8kk) and nothing is there;
    None for a hub id."""
    import difflib

    from llmtrain.hub import is_local_path

    path = Path(value).expanduser()
    if path.exists() or not is_local_path(value):
        return None
    parent = path
    while not parent.parent.is_dir() and parent.parent != parent:
        parent = parent.parent
    here = parent.parent
    near = difflib.get_close_matches(parent.name, [p.name for p in here.iterdir()], n=1, cutoff=0.6)
    hint = f"; the nearest name there is '{near[0]}'" if near else ""
    return (f"data path '{value}' does not exist: there is no file or folder '{parent.name}' in {here}{hint}. "
            "Fix data.path (or data.eval_split).")
