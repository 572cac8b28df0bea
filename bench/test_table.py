#!/usr/bin/env python3
"""Tests of bench/table.py on the committed fixtures bench/testdata/w4a16-{rust.log,peers.jsonl} (made-up
numbers in the formats cuda_bench.rs and peers.py print): the goal verdicts, the fastest inner_k_tiles,
like-against-like ratios, failures named, dry-run and malformed lines refused. Run: `make bench-table-check`
(python3 -m unittest, stdlib only; CI runs it)."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import table  # noqa: E402

RUST = os.path.join(HERE, "testdata", "w4a16-rust.log")
PEERS = os.path.join(HERE, "testdata", "w4a16-peers.jsonl")


def run(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = table.main(list(args))
    return rc, out.getvalue()


def rows(text):
    """{("N × K", "M"): [cells]} of the markdown table."""
    got = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 10 and cells[1].isdigit():
            got[(cells[0], cells[1])] = cells
    return got


class Table(unittest.TestCase):
    def setUp(self):
        self.rc, self.out = run("--rust", RUST, "--peers", PEERS, "--date", "2026-12-01")
        self.rows = rows(self.out)

    def test_every_shape_and_m_has_a_row(self):
        self.assertEqual(self.rc, 0)
        self.assertEqual(len(self.rows), 28)
        self.assertIn("## 2026-12-01, FIXTURE", self.out)

    def test_goals_met_and_not_met(self):
        r = self.rows[("4096 × 7168", "1")]
        self.assertEqual(r[4], "95")  # 16537600 B / 4.352 us = 3800 GB/s of the 4000 GB/s torch copy_
        self.assertEqual(r[8], "met (95 %)")
        self.assertEqual(r[9], "met (2.50×)")
        self.assertEqual(self.rows[("4096 × 7168", "16")][8], "not met (86 %)")
        self.assertEqual(self.rows[("7168 × 2048", "1")][9], "not met (2.00×)")
        self.assertEqual(self.rows[("4096 × 7168", "32")][8], "—")  # the copy goal is for M <= 16 only
        self.assertEqual(self.rows[("4096 × 7168", "2")][9], "—")  # the torch goal is for M = 1 only
        self.assertIn("met on 1 of 5 rows measured", self.out)
        self.assertIn("met on 2 of 3 rows measured", self.out)

    def test_fastest_ikt_and_cublas(self):
        r = self.rows[("4096 × 7168", "1")]
        self.assertEqual(r[5], "10.88 (8)")
        self.assertEqual(r[7], "20.00")

    def test_eager_only_torch_is_compared_with_our_eager_time(self):
        r = self.rows[("512 × 7168", "1")]
        self.assertEqual(r[5], "10.00 eager (8)")
        self.assertEqual(r[6], "2.50 eager")  # 10.0 / our eager 4.0, not / our graph 2.0
        self.assertIn("graph capture failed (RuntimeError: capture failed)", self.out)

    def test_failures_named_and_bad_lines_refused(self):
        self.assertEqual(self.rows[("7168 × 256", "1")][5], "failed")
        self.assertEqual(self.rows[("7168 × 256", "1")][9], "n/a")
        self.assertIn("peers torch_int4: RuntimeError: fixture failure (x1: N=7168 K=256 ikt=8)", self.out)
        self.assertIn("1 dry-run line(s) ignored", self.out)  # its 0.5 us would otherwise win the row
        self.assertIn("1 line(s) that are not JSON records", self.out)
        self.assertIn("unparseable Rust line", self.out)
        self.assertIn("measured twice; the last one is shown", self.out)
        self.assertEqual(self.rows[("7168 × 256", "1")][2], "1.00")

    def test_status_file_and_commit_file(self):
        with tempfile.TemporaryDirectory() as d:
            st, cm, md = (os.path.join(d, f) for f in ("status", "COMMIT", "out.md"))
            with open(st, "w") as f:
                f.write("cuda_bench\t101\npeers.py\t0\n")
            with open(cm, "w") as f:
                f.write("abc1234+dirty\n")
            rc, out = run("--peers", PEERS, "--status", st, "--commit-file", cm, "--md-out", md, "--date", "2026-12-01")
            self.assertEqual(rc, 0)
            self.assertIn("commit `abc1234+dirty`", out)
            self.assertIn("- failed: cuda_bench: exit 101", out)
            self.assertEqual(rows(out)[("4096 × 7168", "1")][2], "failed")  # ours: its binary failed
            self.assertEqual(rows(out)[("4096 × 7168", "2")][5], "—")  # peers.py passed: not measured
            with open(md) as f:
                self.assertEqual(f.read(), out)
            with open(st, "w") as f:
                f.write("cuda_bench\t0\npeers.py\t124\n")
            rc, out = run("--rust", RUST, "--status", st, "--date", "2026-12-01")
            self.assertEqual(rows(out)[("4096 × 7168", "1")][5], "failed")  # peers.py timed out
            self.assertEqual(rows(out)[("4096 × 7168", "1")][7], "failed")
            self.assertIn("- failed: peers.py: exit 124", out)

    def test_unreadable_inputs(self):
        self.assertEqual(run("--rust", "/nonexistent/log", "--peers", "/nonexistent/jsonl")[0], 2)
        rc, out = run("--rust", RUST, "--peers", "/nonexistent/jsonl")
        self.assertEqual(rc, 0)
        self.assertIn("unreadable", out)
        self.assertIn("Rust memcpy_dtod", out)
        self.assertEqual(rows(out)[("4096 × 7168", "1")][4], "93")  # against the Rust copy when torch's is missing


if __name__ == "__main__":
    unittest.main()
