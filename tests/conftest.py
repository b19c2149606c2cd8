"""Fixtures for the whole suite: generated models, each made once per test session and shared by every package."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import pytest

from kvshare.engine.testing import make_tiny_model


@pytest.fixture(scope="session")
def generated_model(tmp_path_factory) -> Callable[..., Path]:
    """generated_model(preset="tiny", seed=0) -> the folder of that generated model, made on first use in this
    session; every later call for the same preset and seed returns the same folder. Read it, never write into it
    (copy it first, as the identity tests do)."""
    return functools.partial(make_tiny_model, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(generated_model) -> Path:
    """The tiny generated model (seed 0) that every test needing a model shares."""
    return generated_model()


@pytest.fixture(scope="session")
def hybrid_model(generated_model) -> Path:
    """The tiny hybrid generated model (Qwen3.5's layout: 3 Gated DeltaNet layers, then 1 gated attention)."""
    return generated_model("tiny-hybrid")
