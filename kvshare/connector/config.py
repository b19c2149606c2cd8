"""ConnectorConfig: where the pool is and how the connector uses it (one field per option of kvshare serve or of vLLM's
kv_connector_extra_config)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvshare.units import parse_size


@dataclass(frozen=True)
class ConnectorConfig:
    address: str  # pool socket path, "unix:PATH" or "tcp://HOST:PORT"
    chunk_tokens: int = 256
    timeout: float = 5.0  # per pool call
    verify_checksums: bool = True  # hash each loaded chunk's bytes and compare with the writer's checksum (I1)
    checksums_on: str = "device"  # CUDA replicas: "device" hashes staging on the GPU; "host" hashes the arena on
    # host threads (the design before issue 17, kept to compare its cost); CPU replicas always hash on the host
    retry_interval: float = 2.0  # after a connection failure, leave the pool alone this long before reconnecting
    l2_promotion: str = "decide"  # a pool with L2: "decide" promotes a prefix from L2 only where the cost model says
    # it beats recompute (kvshare.connector.promotion); "always" lets every LOOKUP promote (the decision off)
    register_piece: int = 16 << 30  # CUDA replicas register the arena for DMA in pieces of at most this many bytes,
    register_threads: int = 4  # on this many background threads (a transfer waits only for its own pieces),
    register_ahead: bool = True  # all pieces from the start; False: only pieces a transfer touches (hostmem.py)
    stream_priority: str = "normal"  # CUDA replicas: "high" runs the transfer's side streams (gathers, scatters,
    # DMA, hashes) at the device's highest stream priority, so a store overlapping a long prefill is not starved by
    # its kernels (TransferOptions.stream_priority; on the H200 stores kept up at "normal" too, so it is the default)
    load_waves: int = 1  # a hit loads in this many layer waves, the forward reading each layer once that layer has
    # landed (kvshare.transfer.waves); 1: the whole load before the forward. 1 for vLLM: inside vLLM 0.26 on an H100
    # two waves made B's 128k hit slower, 0.902 s against 0.825 s (the load at 49.2 GB/s instead of 53.0, and the
    # forward they could hide is short; docs/results/h200-vllm/gpu/session19-h100). `kvshare serve` defaults to 2,
    # measured on its engine (H200 runs 28-29; docs/architecture.md)
    unsafe_skip_state_load: bool = False  # TESTS ONLY, the negative control of hybrid sharing: load a hit's attention
    # K/V but not its linear-attention state (the bug that garbled ~40% of answers elsewhere); no flag sets it


# kv_connector_extra_config key -> (ConnectorConfig field, how its value is read). "model_id" is the namespace's.
_EXTRA: dict[str, tuple[str, Any]] = {
    "pool": ("address", str),
    "chunk_tokens": ("chunk_tokens", int),
    "timeout": ("timeout", float),
    "verify_checksums": ("verify_checksums", bool),
    "checksums_on": ("checksums_on", str),
    "l2_promotion": ("l2_promotion", str),
    "register_piece": ("register_piece", parse_size),  # "16GiB" or a number of bytes
    "register_threads": ("register_threads", int),
    "register_ahead": ("register_ahead", bool),
    "load_waves": ("load_waves", int),
    "stream_priority": ("stream_priority", str),
}
EXTRA_KEYS = frozenset(_EXTRA) | {"model_id"}
_KIND = {str: "a string", int: "an integer", float: "a number", bool: "true or false", parse_size: "a size (\"16GiB\")"}


def from_extra_config(extra: Mapping[str, Any]) -> ConnectorConfig:
    """The ConnectorConfig of vLLM's `kv_connector_extra_config` (a JSON object): "pool" is required, every other key
    has ConnectorConfig's default; an unknown key, a value of the wrong type or out of range is a ValueError that
    names it (vLLM shows it at start-up, before any request)."""
    unknown = set(extra) - EXTRA_KEYS
    if unknown or "pool" not in extra:
        raise ValueError(f"KVShareConnector: kv_connector_extra_config needs \"pool\" (the socket of `kvshare pool "
                         f"serve`) and accepts {sorted(EXTRA_KEYS)}; got {sorted(extra)}")
    values = {}
    for key, (field, read) in _EXTRA.items():
        if key not in extra:
            continue
        value = extra[key]
        if read is bool and not isinstance(value, bool) or read is not bool and isinstance(value, bool):
            raise ValueError(f"KVShareConnector: kv_connector_extra_config \"{key}\" must be {_KIND[read]}, got "
                             f"{value!r}")
        try:
            values[field] = read(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"KVShareConnector: kv_connector_extra_config \"{key}\": {error}") from None
    config = ConnectorConfig(**values)
    _check(config)
    return config


def _check(config: ConnectorConfig) -> None:
    if config.chunk_tokens <= 0 or config.timeout <= 0:
        raise ValueError("KVShareConnector: \"chunk_tokens\" and \"timeout\" must be positive")
    if config.checksums_on not in ("device", "host"):
        raise ValueError(f"KVShareConnector: \"checksums_on\" must be \"device\" or \"host\", got "
                         f"{config.checksums_on!r}")
    if config.stream_priority not in ("normal", "high"):
        raise ValueError(f"KVShareConnector: \"stream_priority\" must be \"normal\" or \"high\", got "
                         f"{config.stream_priority!r}")
    if config.l2_promotion not in ("decide", "always"):
        raise ValueError(f"KVShareConnector: \"l2_promotion\" must be \"decide\" or \"always\", got "
                         f"{config.l2_promotion!r}")
    if config.register_piece <= 0 or config.register_threads < 1:
        raise ValueError("KVShareConnector: \"register_piece\" must be positive and \"register_threads\" >= 1")
    if config.load_waves < 1:
        raise ValueError("KVShareConnector: \"load_waves\" must be >= 1 (1 loads a hit whole before the forward)")


assert {f.name for f in fields(ConnectorConfig)} >= {field for field, _ in _EXTRA.values()}
