"""Shared fixtures: the tiny checkpoint (made once per session) and config writers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (8 query / 2 KV heads), written once per test session."""
    from pipeline.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture
def write_config(tmp_path: Path, tiny_checkpoint: Path):
    """Write a release config (YAML text, ``{ckpt}`` replaced) and return its path."""

    def write(text: str, name: str = "release.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip().replace("{ckpt}", str(tiny_checkpoint)))
        return path

    return write
