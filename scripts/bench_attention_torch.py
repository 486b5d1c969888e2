"""PyTorch's F.scaled_dot_product_attention on the shapes of crates/mha/benches/attention.rs.

    /tmp/ref/bin/python scripts/bench_attention_torch.py [threads]

Prints the median time of each shape; run it right before or after the criterion bench, on
an idle machine, with the same number of threads (RAYON_NUM_THREADS for ours).
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)


def median_time(call, runs):
    """Median seconds of `runs` calls after 5 to warm up."""
    for _ in range(5):
        call()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


shapes = [
    ("b1_t512", 1, 512, 512, False),
    ("b8_t128", 8, 128, 128, False),
    ("b1_t1024_causal", 1, 1024, 1024, True),
    ("decode_1_vs_1024", 1, 1, 1024, False),  # one query sees every cached key
]
with torch.inference_mode():
    for name, b, tq, tk, causal in shapes:
        q = torch.randn(b, 12, tq, 64)
        k = torch.randn(b, 12, tk, 64)
        v = torch.randn(b, 12, tk, 64)
        t = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 30)
        print(f"torch sdpa {name:18} median {t * 1e3:8.3f} ms  (threads {threads})")

# Decoding one token over a long cache with grouped-query heads (the `decode` group of the
# criterion bench): (name, heads, key/value heads, head width, cached positions), f32.
with torch.inference_mode():
    for name, h, h_kv, d, tk in [
        ("gqa_9_3_d64_t1024", 9, 3, 64, 1024),
        ("gqa_9_3_d64_t4096", 9, 3, 64, 4096),
        ("gqa_32_8_d128_t2048", 32, 8, 128, 2048),
    ]:
        q = torch.randn(1, h, 1, d)
        k = torch.randn(1, h_kv, tk, d)
        v = torch.randn(1, h_kv, tk, d)
        t = median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 50)
        print(f"torch sdpa {name:22} median {t * 1e6:8.1f} us  (threads {threads})")
