#!/usr/bin/env python3
"""The peer of the causal prefill attention (issue 27): torch.nn.functional.scaled_dot_product_attention on the
shapes of kdtree's `cuda_bench_layers::mla_prefill` (MLA's expanded form on a K2.6 TP8 rank: 8 heads, keys
192 = nope 128 + rope 64, values 128, bf16, causal, one sequence of T rows from position 0), each backend that
takes them (flash, cuDNN, memory-efficient; the math one only as a fallback), timed with CUDA events after
warm-up on random data. Prints one `SDPA` line per (T, backend) and the best backend per T, with TFLOP/s counted
as kdtree's bench counts them (2 (192 + 128) multiply-adds a visible (row, key) pair and head).

Usage (on the GPU machine): python3 bench/sdpa.py [T ...] (default 4096 16384). Exit 0 when some backend ran
every T, 1 when none did, 2 on bad usage.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, QK, V = 8, 192, 128
BACKENDS = [
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ("math", SDPBackend.MATH),
]


def time_ms(f, warm=2, iters=5):
    for _ in range(warm):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv):
    try:
        lens = [int(a) for a in argv] or [4096, 16384]
    except ValueError:
        print("usage: bench/sdpa.py [T ...]", file=sys.stderr)
        return 2
    if any(t <= 0 for t in lens):
        print("usage: bench/sdpa.py [T ...] (positive lengths)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"sdpa: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {HEADS} heads, qk {QK}, v {V}, bf16")
    ok = True
    for t in lens:
        g = torch.Generator(device=dev).manual_seed(t)
        q = torch.randn(1, HEADS, t, QK, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, HEADS, t, QK, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, HEADS, t, V, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 2.0 * (t * (t + 1) / 2) * (QK + V) * HEADS
        best = None
        for name, be in BACKENDS:
            if name == "math" and best is not None:
                continue  # only when no fused backend takes the shapes
            try:
                with sdpa_kernel([be]):
                    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=QK**-0.5))
            except (RuntimeError, torch.OutOfMemoryError) as e:
                print(f"SDPA t={t} backend={name} unavailable: {str(e).splitlines()[0][:160]}")
                torch.cuda.empty_cache()
                continue
            tf = flops / (ms * 1e-3) / 1e12
            print(f"SDPA t={t} backend={name} ms={ms:.4f} tflops={tf:.1f}")
            if best is None or ms < best[1]:
                best = (name, ms, tf)
        if best is None:
            print(f"SDPA t={t}: no backend ran")
            ok = False
        else:
            print(f"SDPA best t={t} backend={best[0]} ms={best[1]:.4f} tflops={best[2]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
