"""vLLM's kv_connector_extra_config read into a ConnectorConfig without vLLM: every option of `kvshare serve` that the
connector has (the arena's registration in pieces among them) is a key, and a bad key or value is one clear error."""

from __future__ import annotations

import pytest

from kvshare.connector import ConnectorConfig
from kvshare.connector.config import EXTRA_KEYS, from_extra_config


def test_every_key_reaches_its_field():
    config = from_extra_config({"pool": "/run/kvshare/pool.sock", "chunk_tokens": 128, "timeout": 2,
                                "verify_checksums": False, "checksums_on": "host", "l2_promotion": "always",
                                "register_piece": "4GiB", "register_threads": 2, "register_ahead": False,
                                "load_waves": 1, "stream_priority": "high", "model_id": "rev-abc"})
    assert config == ConnectorConfig(address="/run/kvshare/pool.sock", chunk_tokens=128, timeout=2.0,
                                     verify_checksums=False, checksums_on="host", l2_promotion="always",
                                     register_piece=4 << 30, register_threads=2, register_ahead=False, load_waves=1,
                                     stream_priority="high")


def test_defaults_are_the_serve_defaults():
    assert from_extra_config({"pool": "p.sock"}) == ConnectorConfig(address="p.sock")
    assert "model_id" in EXTRA_KEYS and "register_piece" in EXTRA_KEYS


@pytest.mark.parametrize("extra, names", [
    ({}, "needs \"pool\""),
    ({"pool": "p", "chunk_size": 256}, "accepts"),
    ({"pool": "p", "verify_checksums": "false"}, "\"verify_checksums\" must be true or false"),
    ({"pool": "p", "chunk_tokens": True}, "\"chunk_tokens\" must be an integer"),
    ({"pool": "p", "chunk_tokens": "lots"}, "\"chunk_tokens\""),
    ({"pool": "p", "register_piece": "16 parsecs"}, "\"register_piece\""),
    ({"pool": "p", "register_piece": 0}, "\"register_piece\" must be positive"),
    ({"pool": "p", "checksums_on": "gpu"}, "\"checksums_on\" must be"),
    ({"pool": "p", "l2_promotion": "never"}, "\"l2_promotion\" must be"),
    ({"pool": "p", "timeout": -1}, "must be positive"),
    ({"pool": "p", "load_waves": 0}, "\"load_waves\" must be >= 1"),
    ({"pool": "p", "stream_priority": "urgent"}, "\"stream_priority\" must be"),
])
def test_a_bad_key_or_value_is_one_clear_error(extra, names):
    with pytest.raises(ValueError, match="KVShareConnector") as error:
        from_extra_config(extra)
    assert names in str(error.value)
