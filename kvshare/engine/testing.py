"""Helpers for tests across the project: a tiny generated model folder, made once per process and reused."""

from __future__ import annotations

import threading
from pathlib import Path

_made: dict[tuple[str, str, int], Path] = {}
_lock = threading.Lock()  # tests may build engines from several threads


def make_tiny_model(directory: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """`directory`/`preset` holding a generated model (config, random fp32 weights, tokenizer); made on first call
    for this (directory, preset, seed) and returned as is afterwards. Pass a session-scoped tmp dir."""
    from kvshare.engine.make_model import make_model

    key = (str(directory), preset, seed)
    with _lock:
        if key not in _made:
            _made[key] = make_model(preset, Path(directory) / f"{preset}-seed{seed}", seed=seed)
        return _made[key]
