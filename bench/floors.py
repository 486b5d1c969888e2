"""Machine floors the benchmarks compare against, measured with torch's current threads."""
import statistics
import time

import torch


@torch.inference_mode()
def read_floor():
    """Memory read bandwidth in bytes/s: summing 1 GiB of f32, far beyond the caches
    (median of 5)."""
    x = torch.ones(2**28)
    x.sum()
    reads = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        reads.append(x.numel() * 4 / (time.perf_counter() - t0))
    return statistics.median(reads)
