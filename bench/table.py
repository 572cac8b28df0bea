#!/usr/bin/env python3
"""The W4A16 table of one bench/gpu-bench.sh run: ours vs PyTorch int4 vs cuBLAS bf16, with the issue-10 goals.

Reads the Rust timing log (the `BENCH w4a16 n=.. k=.. m=..` lines of engine/tests/cuda_bench.rs and its
`BENCH device .. copy X GB/s` line), bench/peers.py's JSON lines and optionally a status file (one
`part<TAB>exit code` line per part gpu-bench.sh ran), and prints one markdown block, ready to paste into
bench/RESULTS.md: date, GPU, commit, the copy ceiling, one row per shape and M, the goals met or not, and
every failure by name. A missing or failed part leaves its cells as "failed"/"—"; the table still prints.
Goals (issue 10): ours >= 90 % of the copy bandwidth for M <= 16; ours >= 2.4x PyTorch's int4 kernel at
M = 1 (graph time against graph time). Exit 0 table printed, 2 bad arguments or unreadable input.
"""
import argparse
import datetime
import json
import os
import re
import sys

SHAPES = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256)]
MS = [1, 2, 4, 8, 16, 32, 64]
GOAL_PCT, GOAL_PCT_MAX_M = 90.0, 16
GOAL_SPEEDUP, GOAL_SPEEDUP_M = 2.4, 1


def parse_rust(text):
    """-> ({(n, k, m): record}, rust copy GB/s or None, [notes])."""
    rows, copy, notes = {}, None, []
    for line in text.splitlines():
        if line.startswith("BENCH w4a16 "):
            kv = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
            try:
                key = (int(kv["n"]), int(kv["k"]), int(kv["m"]))
                rec = {f: float(kv[f]) for f in ("graph_us", "eager_us", "gbps", "copy_gbps") if f in kv}
                rec["splits"] = int(kv.get("splits", 0))
                rec["bytes"] = int(kv["w_bytes"]) + int(kv["xy_bytes"])
            except (KeyError, ValueError) as e:
                notes.append(f"unparseable Rust line ({type(e).__name__} {e}): {line[:120]}")
                continue
            if key in rows:
                notes.append(f"Rust: n={key[0]} k={key[1]} m={key[2]} measured twice; the last one is shown")
            rows[key] = rec
        else:
            m = re.match(r"^BENCH device .* copy ([0-9.]+) GB/s", line)
            if m:
                copy = float(m.group(1))
    return rows, copy, notes


def parse_peers(text, allow_dry):
    """-> (records, errors, env, [notes])."""
    recs, errors, env, notes, bad, dry = [], [], {}, [], 0, 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or "op" not in r:
                raise ValueError("not an object with an op")
        except ValueError:
            bad += 1
            continue
        if r.get("dry_run") and not allow_dry:
            dry += 1
            continue
        if "error" in r:
            errors.append(r)
        elif r["op"] == "env":
            env = r
        else:
            recs.append(r)
    if bad:
        notes.append(f"peers: {bad} line(s) that are not JSON records, ignored")
    if dry:
        notes.append(f"peers: {dry} dry-run line(s) ignored (they are not measurements)")
    return recs, errors, env, notes


def fmt(v, spec, none="—"):
    return none if v is None else format(v, spec)


def best_torch(recs, n, k, m):
    """The fastest torch_int4 record over inner_k_tiles (graph time; eager only where no graph time)."""
    cands = [r for r in recs if r["op"] == "torch_int4" and (r.get("N"), r.get("K"), r.get("M")) == (n, k, m)]
    graphed = [r for r in cands if r.get("us_graph")]
    if graphed:
        r = min(graphed, key=lambda r: r["us_graph"])
        return r, r["us_graph"], False
    eager = [r for r in cands if r.get("us_median")]
    if eager:
        r = min(eager, key=lambda r: r["us_median"])
        return r, r["us_median"], True
    return None, None, False


def goal(tally, value, target, shown):
    """One goal cell: "n/a" without a value, else met / not met (`shown`), counted in tally [met, rows]."""
    if value is None:
        return "n/a"
    ok = value >= target
    tally[0] += ok
    tally[1] += 1
    return f"{'met' if ok else 'not met'} ({shown})"


def failed_for(errors, op, n, k, m):
    return [e for e in errors if e.get("op") == op and e.get("N") == n and e.get("K") == k and e.get("M") in (None, m)]


def build(rust, rust_copy, rust_notes, recs, errors, env, peer_notes, status, gpu, commit, date, dry):
    by = lambda op, n, k, m: next((r for r in reversed(recs) if r["op"] == op and (r.get("N"), r.get("K"), r.get("M")) == (n, k, m)), None)
    copy = next((r["gbps"] for r in recs if r["op"] == "copy" and r.get("gbps")), None)
    read = next((r["gbps"] for r in recs if r["op"] == "read_sum" and r.get("gbps")), None)
    ref, ref_name = (copy, "torch copy_") if copy else (rust_copy, "Rust memcpy_dtod") if rust_copy else (None, None)
    keys = [(n, k) for n, k in SHAPES]
    extra = sorted(({(n, k) for n, k, _ in rust} | {(r["N"], r["K"]) for r in recs if "N" in r}) - set(keys))
    ms = sorted(set(MS) | {m for *_, m in rust} | {r["M"] for r in recs if "M" in r})
    out = []
    title = f"## {date}, {gpu}: commit `{commit}` (bench/gpu-bench.sh)"
    out.append(title + (" — DRY RUN, not results" if dry else ""))
    out.append("")
    gbs = lambda v: "not measured" if v is None else f"{v:.0f} GB/s"
    out.append(
        f"- Copy ceiling: torch copy_ {gbs(copy)} (random bytes, read + write), read-only sum {gbs(read)}, "
        f"Rust memcpy_dtod {gbs(rust_copy)}; \"% copy\" is against " + (f"{ref:.0f} GB/s ({ref_name})." if ref else "nothing (no copy figure).")
    )
    out.append(
        "- µs per call replayed from a CUDA graph (launch-free), weights rotated far past the 60 MB L2, random data; "
        "GB/s counts the weights as stored (packed int4 + scales, torch's + zeros) plus x read and y written. "
        f"torch int4 = `_weight_int4pack_mm` at group 32, the fastest inner_k_tiles (torch {env.get('torch', '?')}); "
        "cuBLAS = `F.linear` on bf16 weights. \"torch / ours\" > 1: ours is faster."
    )
    out.append("")
    out.append("| N × K | M | ours µs | ours GB/s | ours % copy | torch int4 µs (ikt) | torch / ours | cuBLAS bf16 µs | ≥ 90 % copy (M ≤ 16) | ≥ 2.4× torch (M = 1) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    met = {"pct": [0, 0], "speed": [0, 0]}
    for n, k in keys + extra:
        rows_m = [m for m in ms if (n, k, m) in rust or by("torch_int4", n, k, m) or by("cublas_bf16", n, k, m) or ((n, k) in keys and m in MS)]
        for m in rows_m:
            o = rust.get((n, k, m))
            ous = o.get("graph_us") if o else None
            ogb = o["bytes"] / (ous * 1e-6) / 1e9 if ous else None  # one definition for every row: bytes / graph time
            opct = 100 * ogb / ref if ogb and ref else None
            t, tus, t_eager = best_torch(recs, n, k, m)
            if t:
                tcell = f"{tus:.2f}{' eager' if t_eager else ''} ({t.get('ikt')})" + (" check FAILED" if t.get("check") == "FAILED" else "")
            else:
                tcell = "failed" if failed_for(errors, "torch_int4", n, k, m) or status.get("peers_failed") else "—"
            b = by("cublas_bf16", n, k, m)
            bus = (b.get("us_graph") or b.get("us_median")) if b else None
            bcell = (f"{bus:.2f}" + ("" if b.get("us_graph") else " eager")) if b and bus else ("failed" if failed_for(errors, "cublas_bf16", n, k, m) or status.get("peers_failed") else "—")
            # Like against like: graph against graph; where torch has only an eager figure, eager against eager.
            ours_like = (o.get("eager_us") if o else None) if t_eager else ous
            speed = tus / ours_like if tus and ours_like else None
            g1 = goal(met["pct"], opct, GOAL_PCT, f"{opct:.0f} %" if opct is not None else "") if m <= GOAL_PCT_MAX_M else "—"
            g2 = goal(met["speed"], speed, GOAL_SPEEDUP, f"{speed:.2f}×{', eager' if t_eager else ''}" if speed is not None else "") if m == GOAL_SPEEDUP_M else "—"
            ocell = fmt(ous, ".2f", "failed" if status.get("rust_failed") else "—")
            out.append(f"| {n} × {k} | {m} | {ocell} | {fmt(ogb, '.0f')} | {fmt(opct, '.0f')} | {tcell} | {fmt(speed, '.2f')}{' eager' if speed and t_eager else ''} | {bcell} | {g1} | {g2} |")
    out.append("")
    out.append(
        f"Goals: ≥ {GOAL_PCT:.0f} % of copy for M ≤ {GOAL_PCT_MAX_M}: met on {met['pct'][0]} of {met['pct'][1]} rows measured; "
        f"≥ {GOAL_SPEEDUP}× torch int4 at M = {GOAL_SPEEDUP_M}: met on {met['speed'][0]} of {met['speed'][1]} rows measured."
    )
    fails = [f"{p}: exit {rc}" for p, rc in status.get("parts", []) if rc != "0"]
    fails += grouped([(e.get("op"), e.get("error"), e) for e in errors])
    fails += grouped([(r["op"], f"graph capture failed ({r['graph_error']}); eager figures shown", r) for r in recs if r.get("graph_error")])
    notes = rust_notes + peer_notes
    if fails or notes:
        out.append("")
        out.extend(f"- failed: {f}" for f in fails)
        out.extend(f"- note: {x}" for x in notes)
    return "\n".join(out) + "\n"


def grouped(items):
    """[(op, message, record)] -> one line per (op, message): how many, and the first few configurations."""
    groups = {}
    for op, msg, r in items:
        groups.setdefault((op, msg), []).append(" ".join(f"{f}={r[f]}" for f in ("N", "K", "ikt", "M") if f in r))
    lines = []
    for (op, msg), where in groups.items():
        shown = "; ".join(w for w in where[:3] if w) + (f"; and {len(where) - 3} more" if len(where) > 3 else "")
        lines.append(f"peers {op}: {msg}" + (f" (x{len(where)}: {shown})" if shown else ""))
    return lines


def read(path, what):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        print(f"table.py: cannot read the {what} {path}: {e}", file=sys.stderr)
        return None


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rust", help="log of the cuda_bench* runs (BENCH lines)")
    p.add_argument("--peers", help="bench/peers.py JSON lines")
    p.add_argument("--status", help="part<TAB>exit code lines written by bench/gpu-bench.sh")
    p.add_argument("--commit-file", help="file holding the commit (written by `make gpu-stage`)")
    p.add_argument("--gpu", default=None, help="GPU name (default: the peers env line)")
    p.add_argument("--date", default=None, help="YYYY-MM-DD (default: today, UTC)")
    p.add_argument("--md-out", help="also write the block to this file")
    p.add_argument("--allow-dry-run", action="store_true", help="accept peers.py --dry-run lines (the block says DRY RUN)")
    a = p.parse_args(argv)
    if not a.rust and not a.peers:
        p.error("give --rust and/or --peers")
    rust_text = read(a.rust, "Rust log") if a.rust else None
    peers_text = read(a.peers, "peers output") if a.peers else None
    if rust_text is None and peers_text is None:
        return 2
    rust, rust_copy, rust_notes = parse_rust(rust_text or "")
    if a.rust and rust_text is None:
        rust_notes.append(f"Rust log {a.rust} unreadable")
    elif a.rust and not rust:
        rust_notes.append(f"no `BENCH w4a16` line in {a.rust}")
    recs, errors, env, peer_notes = parse_peers(peers_text or "", a.allow_dry_run)
    if a.peers and peers_text is None:
        peer_notes.append(f"peers output {a.peers} unreadable")
    status = {"parts": []}
    if a.status:
        for line in (read(a.status, "status file") or "").splitlines():
            part, _, rc = line.partition("\t")
            if part:
                status["parts"].append((part, rc.strip()))
    # Our figures come from the cuda_bench binary alone: its failure is what an empty "ours" cell means.
    status["rust_failed"] = any(part == "cuda_bench" and rc != "0" for part, rc in status["parts"])
    status["peers_failed"] = any(part == "peers.py" and rc != "0" for part, rc in status["parts"])
    commit = "unknown"
    if a.commit_file:
        commit = ((read(a.commit_file, "commit file") or "").strip().split() or ["unknown"])[0]
    gpu = a.gpu or env.get("gpu") or "unknown GPU"
    date = a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    dry = a.allow_dry_run and env.get("dry_run", False)
    block = build(rust, rust_copy, rust_notes, recs, errors, env, peer_notes, status, gpu, commit, date, dry)
    try:
        sys.stdout.write(block)
        sys.stdout.flush()
    except BrokenPipeError:
        return 0
    if a.md_out:
        tmp = a.md_out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(block)
        os.replace(tmp, a.md_out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
