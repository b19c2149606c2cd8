"""Fixtures for the bench tests: a tiny model folder (generated once per session)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from kvshare.engine.make_model import make_model

    return Path(make_model("tiny", tmp_path_factory.mktemp("models") / "tiny"))
