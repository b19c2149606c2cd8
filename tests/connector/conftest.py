"""The connector tests' engines: real reference engines of the session's tiny model, in this process."""

from __future__ import annotations

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine


@pytest.fixture
def engines(tiny_model):
    """Three engines: a cache-OFF reference and two whose connectors are attached per test (a module may define its
    own)."""
    made = [Engine(EngineConfig(model=str(tiny_model), max_model_len=512, num_blocks=128)) for _ in range(3)]
    yield made
    for engine in made:
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


