"""Shared fixtures: one tiny generated model per test session, and engines that are always shut down."""

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
from kvshare.engine.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def make_engine(tiny_model):
    """make_engine(**EngineConfig fields) -> a started Engine on the tiny model, shut down after the test."""
    engines = []

    def make(**overrides):
        fields = dict(model=str(tiny_model), num_blocks=256, block_size=16)
        fields.update(overrides)
        engine = Engine(EngineConfig(**fields))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
