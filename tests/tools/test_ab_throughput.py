"""scripts/ab_throughput.py on CPU: 2 gloo processes under torchrun, toy model (train_moe's
defaults), the backends that run on CPU (alltoall, and deepep / hybridep on megatron_ep's torch
reference backend); deep_ep's backends must be reported as skipped, a failing backend as failed."""

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMERIC = ("tokens/s", "step ms", "dispatch ms", "combine ms", "peak MiB", "vs alltoall")


def _torchrun(script, *args, env=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _table(stdout):
    """{backend: {column: cell}} from the printed table (header line starts with 'backend')."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    columns = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith(("loss check", "peak MiB", "spread", "dispatch /", "wrote", "appended", "FAILED")):
            break
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == len(columns):
            rows[cells[0]] = dict(zip(columns, cells))
        else:
            rows[cells[0]] = {"status": line.split(None, 1)[1]}
    return rows


def test_ab_cpu_alltoall_deepep_hybridep(tmp_path):
    png = tmp_path / "ab.png"
    doc = tmp_path / "performance.md"
    shutil.copy(os.path.join(ROOT, "docs", "performance.md"), doc)
    before = doc.read_text()
    out = _torchrun("scripts/ab_throughput.py", "--backend", "torch", "--reps", "2", "--warmup", "1", "--steps", "2",
                    "--png", str(png), "--append-doc", str(doc))
    log = out.stdout + "\n" + out.stderr[-4000:]
    assert out.returncode == 0, log
    rows = _table(out.stdout)
    for key in ("alltoall", "deepep", "hybridep"):
        assert key in rows and "status" not in rows[key], log
        for col in NUMERIC:
            value = float(rows[key][col])
            assert math.isfinite(value) and value > 0, (key, col, value, log)
        assert float(rows[key]["loss@0"].split()[0]) > 0
    assert float(rows["alltoall"]["vs alltoall"]) == 1.0
    for key in ("DeepEP", "HybridEP"):  # deep_ep is not installed in CI: unavailable, not a failure
        assert rows[key]["status"].startswith("skipped: deep_ep not importable"), log
        assert f"{key} (" in out.stdout and "skipped: deep_ep not importable" in out.stdout
    assert re.search(r"loss check at step 0 .*deepep .*hybridep .*: OK", out.stdout), log
    assert "FAILED" not in out.stdout
    # progress: one line per repetition and backend
    assert len(re.findall(r"^rep \d/2 +(alltoall|deepep|hybridep): step", out.stdout, re.M)) == 6, log
    # every repetition restarts from the initial weights and batch 0: the same last loss each time
    for key in ("alltoall", "deepep", "hybridep"):
        losses = re.findall(rf"^rep \d/2 +{key}: step .* loss (\S+)$", out.stdout, re.M)
        assert len(losses) == 2 and losses[0] == losses[1], (key, losses, log)
        assert re.search(rf"^last loss per repetition .*{key} \S+ x2 \(equal\)", out.stdout, re.M), log

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    text = doc.read_text()
    assert text.startswith(before)
    added = text[len(before):]
    assert "## A/B throughput run," in added and "scripts/ab_throughput.py --backend torch" in added
    assert "CPU only" in added and "| backend | tokens/s |" in added
    for key in ("alltoall", "deepep", "hybridep"):
        assert re.search(rf"^\| {key} \| \d+ \|", added, re.M), added
    assert re.search(r"^\| DeepEP \| skipped: deep_ep not importable", added, re.M), added


def test_ab_failure_is_agreed_and_reported(tmp_path):
    """hybridep raises on rank 1 only (layer mode, step 1): rank 0 reports rank 1's error, the
    other backends still run, the exit status is non-zero; deep_ep stays 'skipped'. deepep's
    loss is scaled by 1.01: its step-0 loss check fails although it ran."""
    out = _torchrun("tests/support/ab_inject_failure.py", "--mode", "layer", "--backends", "alltoall,deepep,hybridep,DeepEP",
                    "--backend", "torch", "--reps", "2", "--warmup", "1", "--steps", "1",
                    env={"AB_FAIL_BACKEND": "hybridep", "AB_FAIL_RANK": "1", "AB_FAIL_STEP": "1",
                         "AB_SKEW_BACKEND": "deepep"})
    log = out.stdout + "\n" + out.stderr[-4000:]
    assert out.returncode != 0, log
    assert "hybridep: FAILED at step 1 (repetition 1)" in out.stdout, log
    assert "[rank 1]" in out.stdout and "injected failure: hybridep step 1 rank 1" in out.stdout, log
    rows = _table(out.stdout)
    assert float(rows["alltoall"]["tokens/s"]) > 0, log
    assert rows["hybridep"]["status"].startswith("FAILED: RuntimeError: injected failure"), log
    assert rows["DeepEP"]["status"].startswith("skipped:"), log
    assert len(re.findall(r"^rep \d/2 +alltoall: step", out.stdout, re.M)) == 2, log
    # step 0 of hybridep ran before its failure and matches; deepep's skewed loss does not
    assert re.search(r"loss check at step 0 .*deepep [0-9.e+-]+ \(\|d\| [0-9.e+-]+ > tolerance\), "
                     r"hybridep [0-9.e+-]+ \(\|d\| [0-9.e+-]+\): MISMATCH", out.stdout), log
    assert "deepep (FAILED)" in rows and float(rows["deepep (FAILED)"]["tokens/s"]) > 0, log
    assert re.search(r"^FAILED deepep: step-0 loss .* differs from alltoall's", out.stdout, re.M), log


def test_ab_budget_reports_drops():
    """The budgeted hybridep (static budget, no host sync) runs on the torch backend, matches
    alltoall at step 0, and the report says how many rows its budget dropped (a number, not a
    promise: a budget of 0.1 x tokens x top-k must drop rows)."""
    out = _torchrun("scripts/ab_throughput.py", "--mode", "layer", "--backend", "torch", "--backends",
                    "alltoall,hybridep-budget", "--reps", "1", "--warmup", "0", "--steps", "1",
                    "--budget-factor", "0.1")
    log = out.stdout + "\n" + out.stderr[-4000:]
    assert out.returncode == 0, log
    m = re.search(r"rows dropped by static budgets .*: hybridep-budget (\d+) at step 0, (\d+) over all 1 steps",
                  out.stdout)
    assert m, log
    assert int(m.group(1)) > 0 and int(m.group(2)) >= int(m.group(1)), log
    assert re.search(r"hybridep-budget [0-9.e+-]+ \(not compared: its budget dropped \d+ rows at step 0\)", out.stdout), log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_ab_chunked_backend_reports_the_split():
    """hybridep-chunked in layer mode: the header prints the model's SM split, and the layer built
    with chunked experts (its communication SMs set to that split) passes the step-0 loss check."""
    out = _torchrun("scripts/ab_throughput.py", "--backend", "torch", "--backends", "alltoall,hybridep-chunked",
                    "--mode", "layer", "--chunks", "2", "--reps", "1", "--warmup", "0", "--steps", "2")
    log = out.stdout + "\n" + out.stderr[-4000:]
    assert out.returncode == 0, log
    assert re.search(r"communication needs \d+ of \d+ SMs, the expert GEMMs keep \d+", out.stdout), log
    rows = _table(out.stdout)
    assert "hybridep-chunked" in rows and "status" not in rows["hybridep-chunked"], log
    assert re.search(r"loss check at step 0 .*hybridep-chunked .*: OK", out.stdout), log


def _ab():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import ab_throughput

    return ab_throughput


def _run(ab, key, dispatch_s, combine_s, dropped=None):
    r = ab.Run(ab.BACKENDS[key])
    r.rep_step_s, r.rep_dispatch_s, r.rep_combine_s = [0.010, 0.012], dispatch_s, combine_s
    r.tokens_per_s, r.peak_mib, r.steps_total = 1000.0, 10.0, 4
    r.dropped0 = r.dropped = dropped
    return r


def test_ab_report_says_not_measured_instead_of_zeros(tmp_path):
    """Pure report functions: a backend whose dispatch / combine the timers cannot see (chunked)
    or did not see (0 s) shows "-" in the table, "not measured" with the reason in its progress
    line and a note; never 0.00. The chart draws no bar for them."""
    import argparse

    ab = _ab()
    timed = _run(ab, "hybridep", [0.002, 0.003], [0.001, 0.001], dropped=0)
    chunked = _run(ab, "hybridep-chunked", [0.0, 0.0], [0.0, 0.0], dropped=0)
    silent = _run(ab, "deepep", [0.0, 0.0], [0.0, 0.0])
    assert ab.comm_cells(timed, True) == ["2.50", "1.00"] and ab.comm_cells(timed, False) == ["-", "-"]
    assert ab.comm_cells(chunked, True) == ["-", "-"] and ab.comm_cells(silent, True) == ["-", "-"]
    assert ab.comm_progress(timed) == ", dispatch 3.00 ms, combine 1.00 ms"
    assert ab.comm_progress(chunked) == f", dispatch / combine not measured ({ab.CHUNKS_UNTIMED})"
    rows = ab.table_rows([timed, chunked, silent], argparse.Namespace(time_comm=True), None)
    assert [r[4:6] for r in rows] == [["2.50", "1.00"], ["-", "-"], ["-", "-"]], rows
    assert ab.comm_note([timed, chunked, silent]) == (
        f"dispatch / combine ms not measured (-): hybridep-chunked: {ab.CHUNKS_UNTIMED}; "
        "deepep: the timers saw no dispatch or combine call")
    assert ab.comm_note([timed]) is None
    png = tmp_path / "ab.png"
    ab.write_png(str(png), [timed, chunked], argparse.Namespace(time_comm=True), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ab_drop_note_lists_budgeted_backends_only():
    ab = _ab()
    plain = _run(ab, "hybridep", [0.002], [0.001], dropped=0)  # its manager counts drops too: always 0
    budget = _run(ab, "hybridep-budget", [0.002], [0.001], dropped=3)
    both = _run(ab, "hybridep-chunked-budget", [0.0], [0.0], dropped=0)
    assert [k for k, spec in ab.BACKENDS.items() if spec.budget] == ["hybridep-budget", "hybridep-chunked-budget"]
    assert ab.dropped_note([plain, budget, both]) == (
        "rows dropped by static budgets (forward dispatches, summed over ranks and MoE layers): "
        "hybridep-budget 3 at step 0, 3 over all 4 steps, hybridep-chunked-budget 0 at step 0, 0 over all 4 steps")
    assert ab.dropped_note([plain]) is None
