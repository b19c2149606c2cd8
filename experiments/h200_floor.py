"""The transfer floor on this host, measured beside a run: pinned host -> device copies of 4 GiB, 5 times (median
GB/s), as run 12's probe did for the arena.

    python3 experiments/h200_floor.py
"""

import statistics
import time

import torch

host = torch.empty(4 << 30, dtype=torch.uint8).pin_memory()
device = torch.empty_like(host, device="cuda")
times = []
for _ in range(6):
    torch.cuda.synchronize()
    started = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - started)
rate = host.numel() / statistics.median(times[1:]) / 1e9
print(f"h2d {rate:.1f} GB/s (4 GiB pinned, median of 5); floor for 128k tokens: bf16 (32 GiB) "
      f"{(32 << 30) / rate / 1e9:.3f} s, fp8 {(16 << 30) / rate / 1e9:.3f} s")
