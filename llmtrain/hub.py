"""Whether the Hugging Face hub can be reached, asked once per process, and offline mode when it cannot.

Without a network, huggingface_hub retries every file of a hub id with backoff before it looks in the local cache:
about 50 s for a recipe's model, tokenizer and data, in "Retrying" lines. One connection to the endpoint, of at
most HUB_PROBE_S, tells the same at once; when it fails, the process runs as with HF_HUB_OFFLINE=1, so each hub id
is read from the local cache only and a missing one fails at once. huggingface_hub, transformers and datasets read
HF_HUB_OFFLINE when they are imported, so the commands (doctor, estimate-memory, finetune) ask before they import
them. Under `accelerate launch` each process asks once for itself (its own environment); the command prints the
line once (cli.prints_error_here).

May import: the standard library only.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

HUB_PROBE_S = 3.0  # how long the hub has to answer before hub ids are read from the local cache only
DATA_FILES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow")  # a data file's name, even a missing one
_answers: dict[tuple[str, int], str | None] = {}  # (host, port) -> why it cannot be reached, None when it answers


def is_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")


def is_local_path(name: str) -> bool:
    """Whether a model, tokenizer or data name is a local path (there, or not made yet) rather than a hub id: the one
    rule every reader of a name asks. A hub id is owner/name, or a bare legacy name such as gpt2; a name is local
    when it exists here, starts with . / or ~, has more than one slash (runs/tiny-sft/final), ends with a data
    file's extension, or has a slash and its first folder exists here (runs/tiny-sft before that run is trained) or is
    runs/, where llmtrain's runs are (runs/tiny in a fresh clone, before `make demo`: not a hub id to download)."""
    path = Path(name).expanduser()
    return (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
            or name.lower().endswith(DATA_FILES) or ("/" in name and (path.parent.is_dir() or _in_runs(name))))


def _in_runs(name: str) -> bool:
    """runs/NAME: a run's output_dir as every recipe names it (output_dir: runs/NAME), whether runs/ exists yet."""
    return name.split("/")[0] == "runs"


def surely_local(name: str) -> bool:
    """A local path that cannot be a hub id, so that its absence is said without asking the hub: is_local_path, less
    an owner/name whose owner is a folder here that holds no run (./mistralai/ beside a `hf download --local-dir` of
    one model: mistralai/Other-Model is still the hub's). runs/tiny-sfT (runs/ holds runs) is local."""
    if not is_local_path(name):
        return False
    if name.count("/") != 1 or name.startswith((".", "/", "~")) or name.lower().endswith(DATA_FILES) or _in_runs(name):
        return True
    parent = Path(name).expanduser().parent
    return any((p / "recipe.yaml").is_file() for p in parent.iterdir() if p.is_dir())


def missing_local(name: str) -> bool:
    """A local path (surely_local: it cannot be a hub id) that is not there: said at once, the hub never asked."""
    return surely_local(name) and not Path(name).expanduser().exists()


def hub_ids(*names) -> list[str]:
    """The names that may be hub ids (model, tokenizer, dataset), in order, once each: neither here nor surely local
    (surely_local). myorg/other beside a folder myorg/ that holds no run is the hub's, as the loaders read it: it had
    been taken for a local path, so the hub was never asked and the command retried the network for a minute."""
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n and not surely_local(n)
                              and not Path(n).expanduser().exists()))


def recipe_hub_ids(recipe) -> list[str]:
    """What a run of `recipe` may read from the hub: its model, its tokenizer, its data, and its eval tasks' datasets
    (the recipe's eval section: the tasks are checked at start-up, and a built-in one such as gsm8k reads the hub)."""
    tasks = ["eval.tasks' datasets"] if recipe.eval is not None and recipe.eval.tasks and not local_tasks(
        [str(p) for p in recipe.eval.include_path or []], list(recipe.eval.tasks)) else []
    return hub_ids(recipe.model.name_or_path, recipe.model.tokenizer, recipe.data.path,
                   *(s.path for s in recipe.data.sources or ())) + tasks


PACKAGED = {"json", "csv", "parquet", "text", "arrow"}  # datasets' builders of local files (no hub repository)


def local_tasks(include_path: list[str], names: list[str]) -> bool:
    """Whether every task named is a plain task of an --include-path folder whose data are local files (a packaged
    builder such as json with data_files here, or a folder here): such tasks read nothing from the hub, so the hub
    is not asked about their data and no line says it cannot be reached. Read from the YAML files before the harness
    is imported (it reads HF_HUB_OFFLINE then); any doubt (an include:, a data file on the hub or the web) is False."""
    found = {}
    for folder in include_path:
        for file in sorted(Path(folder).glob("**/*.yaml")) if Path(folder).is_dir() else ():
            conf = task_yaml(file)
            if isinstance(conf, dict) and isinstance(conf.get("task"), str):
                found[conf["task"]] = conf
    return bool(names) and all(n in found and local_task(found[n]) for n in names)


def task_yaml(file) -> dict | None:
    """A harness task's YAML file as a dict (its !function tags read as None); None where it cannot be read."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # the harness's !function tags
    try:
        conf = yaml.load(Path(file).read_text(), Loader=Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return conf if isinstance(conf, dict) else None


def local_task(conf: dict) -> bool:
    """Whether a task's YAML (task_yaml) reads local files only: a packaged builder (json, ...) with data_files here,
    or a folder here, and no include: of another file."""
    path, kwargs = conf.get("dataset_path"), conf.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    values = list(files.values()) if isinstance(files, dict) else [files]
    paths = [v for value in values for v in (value if isinstance(value, list) else [value]) if v is not None]
    here = all(isinstance(v, str) and "://" not in v for v in paths)
    return "include" not in conf and isinstance(path, str) and here and (
        (path in PACKAGED and bool(paths)) or Path(path).expanduser().is_dir())


def endpoint() -> tuple[str, int]:
    """(host, port) that a request to HF_ENDPOINT (https://huggingface.co without it) connects to first: the proxy
    of its scheme where one is set (HTTPS_PROXY, ... and NO_PROXY, as requests reads them), since a cluster that
    reaches the hub only through a proxy cannot connect to the hub itself."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        host = url.hostname or host
    return host, url.port or (443 if url.scheme == "https" else 80)


def unreachable() -> str | None:
    """Why the hub's endpoint cannot be reached (None when it answers): one connection of at most HUB_PROBE_S, made
    once per process and endpoint."""
    where = endpoint()
    if where not in _answers:
        try:
            socket.create_connection(where, timeout=HUB_PROBE_S).close()
            _answers[where] = None
        except OSError as e:
            _answers[where] = e.strerror or str(e) or type(e).__name__
    return _answers[where]


def go_offline() -> None:
    """HF_HUB_OFFLINE=1 for this process (and the processes it starts)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub, transformers and datasets are imported
    if "huggingface_hub.constants" in sys.modules:  # and by huggingface_hub's is_offline_mode, if it already is
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True


def check(ids: list[str], *, fallback: str = "") -> tuple[str, str] | None:
    """Before `ids` (hub ids) are read: None when there are none or HF_HUB_OFFLINE is already set (nothing to ask);
    else ("pass", detail) when the hub answers, or ("warn", line) once this process is in offline mode, the line
    saying so (and `fallback`: what else the command reads instead)."""
    if not ids or is_offline():
        return None
    host, port = endpoint()
    why = unreachable()
    if why is None:
        return "pass", f"{host} reachable ({', '.join(ids)})"
    go_offline()
    return "warn", (f"{host}:{port} cannot be reached ({why}): {', '.join(ids)} read from the local Hugging Face "
                    f"cache only{fallback} (as with HF_HUB_OFFLINE=1)")


def fall_back(ids: list[str], *, fallback: str = "") -> str | None:
    """check() for a command: the line to print when it has put this process in offline mode, else None."""
    row = check(ids, fallback=fallback)
    return row[1] if row and row[0] == "warn" else None
