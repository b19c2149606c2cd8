"""Rich tables for `kvshare pool stats`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvshare.pool.stats import PoolStats
from kvshare.units import format_size


def print_stats(stats: PoolStats) -> None:
    console = Console()
    table = Table(title="kvshare pool", show_header=False)
    used = stats.pages_used / max(stats.num_pages, 1)
    rows = [
        ("capacity",
         f"{format_size(stats.capacity_bytes)} ({stats.num_pages} pages of {format_size(stats.page_size)})"),
        ("prepared", f"{stats.pages_prepared}/{stats.num_pages} pages" + (" (ready)" if stats.ready else "")),
        ("used", f"{stats.pages_used} pages ({used:.1%}): {stats.pages_committed} committed, "
                 f"{stats.pages_reserved} reserved; {stats.pages_free} free"),
        ("chunks", f"{stats.chunks} ({format_size(stats.bytes_stored)}) in {stats.namespaces} namespace(s)"),
        ("hits / misses", f"{stats.hit_chunks} / {stats.miss_chunks} chunks, {stats.hit_tokens} / "
                          f"{stats.miss_tokens} tokens; {stats.verify_failures} token-verification failures"),
        ("evictions", f"{stats.evictions} chunks ({format_size(stats.evicted_bytes)})"),
        ("leases", f"{stats.read_leases} read, {stats.write_leases} write; {stats.expired_leases} expired"),
        ("no space", str(stats.no_space)),
        ("lease limit", f"{stats.max_leased_pages_per_client or 'none'} pages per client; {stats.lease_limited} "
                        f"refused or shortened; now {stats.leased_pages_by_client or '{}'}"),
        ("committed", format_size(stats.bytes_committed_total)),
        ("L2 written", f"{stats.l2_writes} chunks; {stats.l2_write_drops} dropped, {stats.l2_errors} Redis errors"),
        ("L2 read", f"{stats.l2_hits} hits, {stats.l2_promotions} promoted, {stats.l2_rejected} rejected"),
        ("clients", str(stats.clients)),
        ("uptime", f"{stats.uptime_s:.0f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    requests = Table(title="requests")
    for column in ("type", "count", "errors", "p50 ms", "p99 ms"):
        requests.add_column(column, justify="right" if column != "type" else "left")
    for kind, r in stats.requests.items():
        requests.add_row(kind, str(r.count), str(r.errors), f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}")
    console.print(requests)
