"""`scripts/bench host` on CPU: its canned run (our calls' Python over recorded crossings), its
CPU-process run (the script's mechanics, figures meaningless) and its refusals, each through the
one benchmark entry."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench"), "host", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_canned_run_times_every_op_natively_and_through_deep_ep():
    p = _bench("--canned")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| ")}
    for op in ("dispatch", "cached_dispatch", "combine", "ll_dispatch", "ll_combine"):
        assert op in rows and rows[op].rstrip().endswith("x |"), p.stdout  # ours, deep_ep and their ratio


def test_cpu_run_measures_each_implementation_and_round(tmp_path):
    # (--cpu picks its own small sizes; --base: this checkout again, in processes of its own)
    p = _bench("--cpu", "--ranks", "2", "--rounds", "2", "--impls", "ours,base,deep_ep", "--phases", "--kernels",
               "--base", ROOT)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    for impl in ("ours", "base", "deep_ep"):
        assert f"{impl}: measured (round 2 of 2)" in out, out
    assert "| T | op | ours loop (issue) µs | base loop (issue) µs | deep_ep loop (issue) µs |" in out, out
    assert "| 16 | dispatch |" in out and "issue µs per round" in out, out


def test_base_checkout_without_the_package_layout_is_refused_in_one_line(tmp_path):
    (tmp_path / "megatron_ep").mkdir()  # a package without core/ and tools/: an earlier layout
    p = _bench("--cpu", "--base", str(tmp_path))
    assert p.returncode == 2 and "laid out before megatron_ep/core" in p.stderr.strip().splitlines()[-1], p.stderr
    p = _bench("--cpu", "--base", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "no megatron_ep package there" in p.stderr, p.stderr
