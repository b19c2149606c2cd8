"""Fixtures for the engine tests: engines on the session's tiny model (tests/conftest.py), always shut down."""

import os

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine


@pytest.fixture
def make_engine(tiny_model):
    """make_engine(**EngineConfig fields) -> a started Engine on the tiny model, shut down after the test."""
    engines = []

    def make(**overrides):
        fields = dict(model=str(tiny_model), num_blocks=256, block_size=16)
        fields.update(overrides)
        engine = Engine(EngineConfig(**fields))
        engines.append(engine)
        # Under Triton's interpreter (test_paged_interpreter.py) the point is the kernels: every engine must use them.
        assert os.environ.get("TRITON_INTERPRET") != "1" or engine.runner.paged
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
