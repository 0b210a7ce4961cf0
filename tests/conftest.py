"""Shared fixtures: the tiny model and task built locally (never downloaded), and paths to ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import open_port

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MISTRAL = SHARED / "models" / "mistral-7b-instruct-v0.3"
GSM8K = SHARED / "data" / "gsm8k"


def pytest_report_header(config):
    """The CPU kernels torch picked (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): `make test-portable` runs the tests
    marked `precision` under each."""
    import torch

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "the CPU's")
    return f"torch {torch.__version__}: ATen CPU kernels {torch.backends.cpu.get_cpu_capability()}, oneDNN ISA {isa}"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: each worker runs whole
    files, so a module's shared runs are made once) the files marked `long(seconds)` (a module's pytestmark: its
    main-tier tests' time on 2 cores, measured) are handed out first, longest first, and the many short ones fill in
    after them, so neither worker is left alone with a long file at the end. A plain run keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        def seconds(item) -> float:
            marker = item.get_closest_marker("long")
            return marker.args[0] if marker else 0.0

        items.sort(key=lambda item: -seconds(item))  # stable: a file's tests stay together, in their order


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """assets/tiny as `llmtrain prepare-tiny` writes it: model/, data/train.jsonl, data/eval.jsonl, ..."""
    from llmtrain.tiny import prepare_tiny

    out = tmp_path_factory.mktemp("tiny")
    prepare_tiny(out)
    return out


@pytest.fixture(scope="module")
def mistral():
    """The real Mistral-7B-Instruct-v0.3 tokenizer and chat template (tests using it are marked needs(MISTRAL))."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MISTRAL)


@pytest.fixture(scope="module")
def tiny_tok(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets / "model")


@pytest.fixture
def free_port() -> int:
    """A port the OS says is free (never a fixed one: parallel runs would collide)."""
    return open_port()


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} is not available")
