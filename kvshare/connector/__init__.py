"""The connector: chunk keys, pool calls and transfers for any engine (core.py), the contract engines implement
against (contract.py), the pool link (link.py) and the committer thread (committer.py)."""

from kvshare.connector.config import ConnectorConfig
from kvshare.connector.contract import ConnectorStats, KVConnector, StoreHandle
from kvshare.connector.core import ConnectorCore, PoolHit

__all__ = ["ConnectorConfig", "ConnectorCore", "ConnectorStats", "KVConnector", "PoolHit", "StoreHandle"]
