"""KV transfer: `KVLayout` and the CPU/CUDA paths that pack engine KV blocks into pool pages and back."""

from kvshare.transfer.jobs import SKIP, LoadJob, StoreJob, TransferHandle
from kvshare.transfer.kinds import KINDS, KVKind, PackedKV, SplitKV, VllmHND, VllmNHD
from kvshare.transfer.layout import KVLayout, LayoutMismatch
from kvshare.transfer.transfer import Transfer, TransferOptions, arena_pages, make_transfer

__all__ = [
    "KINDS", "SKIP", "TransferHandle", "KVKind", "KVLayout", "LayoutMismatch", "LoadJob", "PackedKV", "SplitKV",
    "StoreJob", "Transfer", "TransferOptions", "VllmHND", "VllmNHD", "arena_pages", "make_transfer",
]
