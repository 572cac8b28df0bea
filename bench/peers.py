#!/usr/bin/env python3
"""PyTorch peers of our W4A16 group-32 GEMM, timed on the GPU in the same way as engine/tests/cuda_bench.rs.

On the K2.6 expert shapes N x K = 4096 x 7168 (gate+up), 7168 x 2048 (down) and their TP8 slices 512 x 7168,
7168 x 256, for M = 1, 2, 4, 8, 16, 32, 64 rows of x:
  torch_int4   torch.ops.aten._weight_int4pack_mm at group 32 (tinygemm), for inner_k_tiles 2, 4 and 8;
               weights prepared by torch.ops.aten._convert_weight_to_int4pack (torch >= 2.5 takes uint8
               [N, K/2], high nibble = even k; older versions take int32 [N, K]: both are tried).
               Dequantisation is w = (q - 8) * scale + zero, scales_and_zeros bf16 [K/32, N, 2].
  cublas_bf16  F.linear(x, w) on bf16 weights w [N, K] (cuBLAS).
  copy         dst.copy_(src) of 1 GiB of random bytes (read + write counted): the bandwidth ceiling.
  read_sum     torch.sum over 1 GiB of random float32 (read only), for reference.
Method: every op's weights are rotated over >= --rotate-gb of separate random copies (far beyond the 60 MB
L2), one warm-up pass over all copies, then CUDA events between back-to-back calls (us_median: median
per-call time, launch gaps included) and a CUDA graph of >= --calls calls cycling through the copies,
replayed --replays times (us_graph: median replay time / calls: the launch-free per-call time). Each op is
first checked against a float64 reference (check_rel = |y - ref| / |ref|; a failed check is named and
the op still timed: its time does not depend on the values). Bytes counted: the weights as the
op stores them (int4 packed + scales_and_zeros, or bf16) plus x read and y written; gbps and pct_copy use
us_graph. Output: one JSON object per line on stdout (a failed part is a line with "error"; its traceback
goes to stderr). bench/gpu-bench.sh runs it and bench/table.py reads it. Exit 0 all ran, 1 a part failed,
2 no CUDA. --dry-run: tiny shapes on the CPU (torch's CPU int4 ops, host timers, no graphs) to exercise
this script where there is no GPU; its lines carry "dry_run": true and are not results.
"""
import argparse
import json
import math
import statistics
import sys
import time
import traceback

GROUP = 32
SHAPES = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256)]
MS = [1, 2, 4, 8, 16, 32, 64]
CHECK_M = 5  # a partial 16-row tile
CHECK_TOL = 2e-2  # bf16 operands and output (METHOD: 1e-3..1e-2); a wrong layout gives ~1
failed = False


def emit(obj):
    try:
        print(json.dumps(obj), flush=True)
    except BrokenPipeError:
        sys.exit(0)


def fail(ctx, e):
    """A part failed: the traceback to stderr, an "error" line to stdout; the run goes on."""
    global failed
    failed = True
    print(f"peers: {ctx.get('op')} {ctx}: {type(e).__name__}: {e}", file=sys.stderr)
    traceback.print_exc(file=sys.stderr)
    emit({**ctx, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})


def log(args, msg):
    if not args.quiet:
        print(f"peers: {msg}", file=sys.stderr, flush=True)


class Cuda:
    """Timing and the int4 op on the GPU."""

    dry = False

    def __init__(self, torch):
        self.t = torch
        self.dev = "cuda"
        self.pack_input = None  # which _convert_weight_to_int4pack input format this torch takes

    def sync(self):
        self.t.cuda.synchronize()

    def eager_us(self, fn, copies, calls):
        t = self.t
        for i in range(copies):  # warm-up: one pass over every weight copy
            fn(i)
        self.sync()
        n = max(calls, copies)
        ev = [t.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            fn(i % copies)
            ev[i + 1].record()
        self.sync()
        return 1e3 * statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(n))

    def graph_us(self, fn, copies, calls, replays):
        t = self.t
        length = copies * math.ceil(calls / copies)
        side = t.cuda.Stream()
        side.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
            for i in range(3):
                fn(i % copies)
        t.cuda.current_stream().wait_stream(side)
        self.sync()
        g = t.cuda.CUDAGraph()
        try:
            # thread_local: as the Rust timings capture (CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            with t.cuda.graph(g, capture_error_mode="thread_local"):
                for i in range(length):
                    fn(i % copies)
        except Exception:
            del g
            self.sync()  # a failed capture must not leave work in flight for the next part
            raise
        g.replay()
        self.sync()
        ts = []
        for _ in range(replays):
            a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / length)
        del g
        return 1e3 * statistics.median(ts), length

    def int4_pack(self, u8, ikt):
        """u8 [N, K/2] uint8 (high nibble = even k) -> the op's packed weight."""
        aten, first = self.t.ops.aten, "not tried"
        if self.pack_input in (None, "uint8[N,K/2]"):
            try:
                p = aten._convert_weight_to_int4pack(u8, ikt)
                self.pack_input = "uint8[N,K/2]"
                return p
            except RuntimeError as e:
                if self.pack_input is not None:
                    raise
                first = e
        try:  # torch < 2.5: int32 [N, K], one value 0..15 per element
            p = aten._convert_weight_to_int4pack(unpack(self.t, u8).contiguous(), ikt)
        except RuntimeError as e:
            raise RuntimeError(f"_convert_weight_to_int4pack takes neither uint8 [N, K/2] ({first}) nor int32 [N, K] ({e})") from e
        self.pack_input = "int32[N,K]"
        return p

    def int4_mm(self, x, packed, sz):
        return self.t.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)


class Cpu(Cuda):
    """--dry-run: the same flow on the CPU (host timers, torch's CPU int4 ops, no graphs). Not results."""

    dry = True

    def __init__(self, torch):
        super().__init__(torch)
        self.dev = "cpu"

    def sync(self):
        pass

    def eager_us(self, fn, copies, calls):
        for i in range(copies):
            fn(i)
        ts = []
        for i in range(max(calls, copies)):
            s = time.perf_counter()
            fn(i % copies)
            ts.append(time.perf_counter() - s)
        return 1e6 * statistics.median(ts)

    def graph_us(self, fn, copies, calls, replays):
        raise NotImplementedError("dry run: no CUDA graph on the CPU")

    def int4_pack(self, u8, ikt):
        self.pack_input = "int32[N,K] (cpu)"
        return self.t._convert_weight_to_int4pack_for_cpu(unpack(self.t, u8).contiguous(), ikt)

    def int4_mm(self, x, packed, sz):
        return self.t._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)


def unpack(torch, u8, swap=False):
    """uint8 [N, K/2] -> int32 [N, K] values 0..15; even k in the high nibble (swap: in the low one)."""
    hi, lo = (u8 >> 4).to(torch.int32), (u8 & 15).to(torch.int32)
    if swap:
        hi, lo = lo, hi
    return torch.stack([hi, lo], dim=-1).reshape(u8.shape[0], u8.shape[1] * 2)


def dequant(torch, u8, sz, swap=False):
    """w [N, K] float64 = (q - 8) * scale + zero, scales_and_zeros sz [K/32, N, 2]."""
    q = unpack(torch, u8, swap).to(torch.float64)
    s = sz[..., 0].to(torch.float64).repeat_interleave(GROUP, 0).T
    z = sz[..., 1].to(torch.float64).repeat_interleave(GROUP, 0).T
    return (q - 8) * s + z


def rel(torch, y, ref):
    return ((y.to(torch.float64) - ref).norm() / ref.norm()).item()


def nbytes(t):
    return t.numel() * t.element_size()


def time_op(args, d, ctx, fn, copies, w_bytes, m, n, k, copy_gbps, extra):
    """Times fn over the rotated copies (eager, then graph) and emits one line."""
    xy = 2 * (m * k + m * n)
    rec = {**ctx, "M": m, "copies": copies, "w_bytes": w_bytes, "xy_bytes": xy, **extra}
    rec["us_median"] = round(d.eager_us(fn, copies, args.calls), 3)
    try:
        us, length = d.graph_us(fn, copies, args.calls, args.replays)
        rec["us_graph"], rec["graph_calls"] = round(us, 3), length
    except Exception as e:  # the eager figure stands; the failure is named
        rec["us_graph"], rec["graph_error"] = None, f"{type(e).__name__}: {e}"[:200]
        if not d.dry:
            global failed
            failed = True
            print(f"peers: graph capture failed for {ctx}: {e}", file=sys.stderr)
    us = rec["us_graph"]
    rec["gbps"] = round((w_bytes + xy) / (us * 1e-6) / 1e9, 1) if us else None
    rec["gbps_eager"] = round((w_bytes + xy) / (rec["us_median"] * 1e-6) / 1e9, 1)
    rec["pct_copy"] = round(100 * rec["gbps"] / copy_gbps, 1) if rec["gbps"] and copy_gbps else None
    if d.dry:
        rec["dry_run"] = True
    emit(rec)


def bench_int4(args, torch, d, n, k, ikt, copy_gbps):
    ctx = {"op": "torch_int4", "N": n, "K": k, "ikt": ikt}
    try:
        per = n * k // 2 + n * k // GROUP * 4
        copies = max(2, math.ceil(args.rotate_gb * 1e9 / per))
        packed, sz, u0 = [], [], None
        for c in range(copies):
            u8 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=d.dev)
            packed.append(d.int4_pack(u8, ikt))
            s = torch.empty(k // GROUP, n, device=d.dev).uniform_(0.002, 0.016)
            s *= torch.randint(0, 2, s.shape, device=d.dev) * 2 - 1
            z = torch.empty(k // GROUP, n, device=d.dev).uniform_(-0.01, 0.01)
            sz.append(torch.stack([s, z], dim=-1).to(torch.bfloat16).contiguous())
            if c == 0:
                u0 = u8
            del u8
        x = torch.randn(CHECK_M, k, device=d.dev).to(torch.bfloat16)
        y = d.int4_mm(x, packed[0], sz[0])
        err = rel(torch, y, x.to(torch.float64) @ dequant(torch, u0, sz[0]).T)
        check = "ok"
        if not err <= CHECK_TOL:  # NaN fails too
            # Timing does not depend on the values: a layout misunderstanding is named, the op still timed.
            alt = rel(torch, y, x.to(torch.float64) @ dequant(torch, u0, sz[0], swap=True).T)
            check = "ok with the nibbles of a byte swapped" if alt <= CHECK_TOL else "FAILED"
            err = min(err, alt)
            if check == "FAILED":
                fail(ctx, RuntimeError(f"check failed: rel {err:.3g} > {CHECK_TOL} at M={CHECK_M} (either nibble order); timed anyway"))
        del u0, y
        w_bytes = nbytes(packed[0]) + nbytes(sz[0])
        log(args, f"torch_int4 N={n} K={k} ikt={ikt}: {copies} copies x {w_bytes} B, check {check} (rel {err:.2e}), packed {tuple(packed[0].shape)} {packed[0].dtype}")
    except Exception as e:
        fail(ctx, e)
        return
    extra = {"check": check, "check_rel": float(f"{err:.3g}"), "pack_input": d.pack_input, "packed_shape": list(packed[0].shape)}
    for m in args.ms:
        try:
            x = torch.randn(m, k, device=d.dev).to(torch.bfloat16)
            time_op(args, d, ctx, lambda i: d.int4_mm(x, packed[i], sz[i]), copies, w_bytes, m, n, k, copy_gbps, extra)
        except Exception as e:
            fail({**ctx, "M": m}, e)


def bench_bf16(args, torch, d, n, k, copy_gbps):
    import torch.nn.functional as F

    ctx = {"op": "cublas_bf16", "N": n, "K": k}
    try:
        copies = max(2, math.ceil(args.rotate_gb * 1e9 / (2 * n * k)))
        ws = [(torch.randn(n, k, device=d.dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(CHECK_M, k, device=d.dev).to(torch.bfloat16)
        err = rel(torch, F.linear(x, ws[0]), x.to(torch.float64) @ ws[0].to(torch.float64).T)
        check = "ok" if err <= CHECK_TOL else "FAILED"
        if check == "FAILED":
            fail(ctx, RuntimeError(f"check failed: rel {err:.3g} > {CHECK_TOL} at M={CHECK_M}; timed anyway"))
        log(args, f"cublas_bf16 N={n} K={k}: {copies} copies, check {check} (rel {err:.2e})")
    except Exception as e:
        fail(ctx, e)
        return
    for m in args.ms:
        try:
            x = torch.randn(m, k, device=d.dev).to(torch.bfloat16)
            time_op(args, d, ctx, lambda i: F.linear(x, ws[i]), copies, 2 * n * k, m, n, k, copy_gbps, {"check": check, "check_rel": float(f"{err:.3g}")})
        except Exception as e:
            fail({**ctx, "M": m}, e)


def bench_copy(args, torch, d):
    """Returns the copy GB/s (read + write), or None when it failed."""
    nb = int(args.copy_gib * (1 << 30))
    gbps = None
    try:
        src = torch.randint(0, 256, (nb,), dtype=torch.uint8, device=d.dev)
        dst = torch.empty_like(src)
        us = d.eager_us(lambda i: dst.copy_(src), 1, args.calls)
        if not torch.equal(dst[: 1 << 20], src[: 1 << 20]):
            raise RuntimeError("copy check failed: dst != src")
        gbps = 2 * nb / (us * 1e-6) / 1e9
        emit({"op": "copy", "bytes": 2 * nb, "us_median": round(us, 3), "gbps": round(gbps, 1), **({"dry_run": True} if d.dry else {})})
        del src, dst
    except Exception as e:
        fail({"op": "copy"}, e)
    try:
        f = torch.rand(nb // 4, device=d.dev)
        out = torch.empty((), device=d.dev)
        us = d.eager_us(lambda i: torch.sum(f, dim=0, out=out), 1, args.calls)
        g = nb / (us * 1e-6) / 1e9
        emit({"op": "read_sum", "bytes": nb, "us_median": round(us, 3), "gbps": round(g, 1), **({"dry_run": True} if d.dry else {})})
        del f
    except Exception as e:
        fail({"op": "read_sum"}, e)
    return gbps


def parse_shape(s):
    n, k = s.lower().split("x")
    n, k = int(n), int(k)
    if n <= 0 or k <= 0 or n % 8 or k % 128:
        raise argparse.ArgumentTypeError(f"shape {s}: N must be a multiple of 8 and K of 128")
    return n, k


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=lambda v: [parse_shape(s) for s in v.split(",")], default=None, help="NxK,... (default: the four K2.6 shapes)")
    p.add_argument("--ms", type=lambda v: [int(m) for m in v.split(",")], default=MS, help="rows of x (default 1,2,4,8,16,32,64)")
    p.add_argument("--ikt", type=lambda v: [int(i) for i in v.split(",")], default=[2, 4, 8], help="inner_k_tiles of the int4 packing")
    p.add_argument("--rotate-gb", type=float, default=None, help="weight copies per op, in GB (default 1.0)")
    p.add_argument("--copy-gib", type=float, default=None, help="size of the copy / sum buffers (default 1)")
    p.add_argument("--calls", type=int, default=64, help="timed calls per measurement (>= 50 in a graph)")
    p.add_argument("--replays", type=int, default=20, help="graph replays per measurement")
    p.add_argument("--skip", default="", help="comma list of parts to skip: int4,bf16,copy")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; exercises the script, measures nothing")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if any(m <= 0 for m in a.ms) or any(i not in (2, 4, 8) for i in a.ikt) or a.calls < 1 or a.replays < 1:
        p.error("--ms must be positive, --ikt in 2,4,8, --calls and --replays >= 1")
    a.shapes = a.shapes or ([(64, 256), (256, 512)] if a.dry_run else SHAPES)
    a.rotate_gb = a.rotate_gb if a.rotate_gb is not None else (0.002 if a.dry_run else 1.0)
    a.copy_gib = a.copy_gib if a.copy_gib is not None else (1 / 256 if a.dry_run else 1.0)
    if a.dry_run:
        a.ms = [m for m in a.ms if m <= 16] or [1]
        a.calls = min(a.calls, 8)
    return a


def main(argv):
    args = parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    try:
        import torch
    except Exception as e:
        fail({"op": "env"}, e)
        return 2
    if args.dry_run:
        d = Cpu(torch)
        gpu = "cpu (dry run)"
    else:
        if not torch.cuda.is_available():
            fail({"op": "env"}, RuntimeError("torch sees no CUDA device (use --dry-run on a machine without one)"))
            return 2
        d = Cuda(torch)
        gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    emit({"op": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu, "group": GROUP, "rotate_gb": args.rotate_gb, "calls": args.calls, "replays": args.replays, **({"dry_run": True} if d.dry else {})})
    copy_gbps = None if "copy" in skip else bench_copy(args, torch, d)
    for n, k in args.shapes:
        if "int4" not in skip:
            for ikt in args.ikt:
                bench_int4(args, torch, d, n, k, ikt, copy_gbps)
                if not d.dry:
                    torch.cuda.empty_cache()
        if "bf16" not in skip:
            bench_bf16(args, torch, d, n, k, copy_gbps)
            if not d.dry:
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
