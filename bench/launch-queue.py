# The CUDA launch queue (issue 11, the rank-group hangs): how many launches (eager kernels, graph launches) can
# wait behind a blocked stream before the host's launch call blocks, and whether streams share that queue.
# A stream is blocked by a kernel spinning on a flag in mapped host memory, released from a host thread after
# 2 s; a launch call that takes > 0.2 s is one that waited for queue space. Needs CuPy and a GPU.
# Usage: python3 bench/launch-queue.py   (CUDA_SCALE_LAUNCH_QUEUES=4x to see the driver's knob). Results:
# bench/GPU-RESULTS.md.
import ctypes, threading, time, sys, os
import numpy as np
import cupy as cp
rt = cp.cuda.runtime
src = r'''
extern "C" __global__ void spin(volatile int* flag, long long max_cycles) {
    long long t0 = clock64();
    while (*flag == 0 && clock64() - t0 < max_cycles) {}
}
extern "C" __global__ void tiny(int* x) { x[threadIdx.x] += 1; }
'''
mod = cp.RawModule(code=src)
spin, tiny = mod.get_function("spin"), mod.get_function("tiny")
hp = rt.hostAlloc(4, 2)  # cudaHostAllocMapped
dp = hp  # mapped page-locked memory: with unified addressing the host pointer is the device pointer
flag = (ctypes.c_int * 1).from_address(hp)
buf = cp.zeros(32, dtype=cp.int32)
A, B, G = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
LIMIT = 400000
def block(stream):
    flag[0] = 0
    with stream:
        spin((1,), (1,), (cp.uint64(dp), cp.int64(20 * 10**9)))
def release_after(s):
    def f():
        time.sleep(s); flag[0] = 1
    t = threading.Thread(target=f); t.start(); return t
def fill(stream, n, launch, release=2.0):
    """Launches until a call blocks (> 0.2 s) or n; returns count before the first blocking call."""
    t = release_after(release)
    count = None
    for i in range(n):
        t0 = time.perf_counter()
        launch(stream)
        if time.perf_counter() - t0 > 0.2:
            count = i
            break
    t.join(); cp.cuda.Device().synchronize()
    return count
def k(stream):
    with stream:
        tiny((1,), (32,), (buf,))
# warm
k(A); cp.cuda.Device().synchronize()
block(A); n1 = fill(A, LIMIT, k)
print(f"eager kernels pending on one blocked stream before a launch blocks: {n1}")
# shared? fill A to n1 - 64 (no block), then launch on B
if n1:
    block(A)
    t = release_after(3.0)
    for i in range(n1 - 64):
        k(A)
    t0 = time.perf_counter(); blocked_at = None
    for i in range(2000):
        s0 = time.perf_counter(); k(B)
        if time.perf_counter() - s0 > 0.2:
            blocked_at = i; break
    t.join(); cp.cuda.Device().synchronize()
    print(f"with stream A holding {n1-64} pending: launches on stream B before one blocks: {blocked_at} (None = never blocked in 2000)")
for nodes in (1, 10, 100, 400):
    with G:
        G.begin_capture()
        for i in range(nodes):
            tiny((1,), (32,), (buf,))
        g = G.end_capture()
    if hasattr(g, 'upload'):
        g.upload(A)
    cp.cuda.Device().synchronize()
    block(A)
    c = fill(A, 100000 if nodes < 100 else 20000, lambda s: g.launch(s))
    print(f"graph of {nodes} kernel nodes: launches pending before one blocks: {c}" + (f" (~{n1/c:.1f} per graph if eager cap is {n1})" if c and n1 else ""))
# memset + kernel graph
with G:
    G.begin_capture()
    for i in range(50):
        tiny((1,), (32,), (buf,))
        rt.memsetAsync(buf.data.ptr, 0, 4, G.ptr)
    g = G.end_capture()
cp.cuda.Device().synchronize(); block(A)
c = fill(A, 20000, lambda s: g.launch(s))
print(f"graph of 50 kernels + 50 memsets: launches pending before one blocks: {c}")
# kernel + stream-ordered alloc / free graph (alloc and free nodes)
try:
    with G:
        G.begin_capture()
        for i in range(50):
            tiny((1,), (32,), (buf,))
            p = rt.mallocAsync(256, G.ptr)
            rt.freeAsync(p, G.ptr)
        g = G.end_capture()
    cp.cuda.Device().synchronize(); block(A)
    c = fill(A, 20000, lambda s: g.launch(s))
    print(f"graph of 50 kernels + 50 allocs + 50 frees: launches pending before one blocks: {c}")
except Exception as ex:
    print(f"graph with alloc / free nodes: not measured ({ex})")
print("CUDA_SCALE_LAUNCH_QUEUES =", os.environ.get("CUDA_SCALE_LAUNCH_QUEUES"))
