"""Shared fixtures: the tiny model and task built locally (never downloaded), and paths to ../shared."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MISTRAL = SHARED / "models" / "mistral-7b-instruct-v0.3"
GSM8K = SHARED / "data" / "gsm8k"


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} is not available")
