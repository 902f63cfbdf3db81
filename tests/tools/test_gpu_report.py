"""The GPU gate's bookkeeping (scripts/gate/gpu_report.py), on CPU: summary rows from a junit record
or from the log of a run killed at its timeout, the record's two run lines, and verify."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("gpu_report", os.path.join(ROOT, "scripts", "gate", "gpu_report.py"))
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)

JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="t" name="a"/><testcase classname="t" name="b"><skipped/></testcase>
<testcase classname="t" name="c"><failure message="x"/></testcase></testsuite></testsuites>"""


def _record(tmp_path, monkeypatch):
    """A record of this test's own, written for commit abc1234."""
    record = tmp_path / "gpu-status.md"
    monkeypatch.setattr(gr, "RECORD", str(record))
    monkeypatch.setenv("MEP_GATE_COMMIT", "abc1234")
    return record


def test_rows_from_junit_and_from_a_killed_run(tmp_path, capsys):
    (tmp_path / "j.xml").write_text(JUNIT)
    gr.main(["--row", "tests/t.py", "--junit", str(tmp_path / "j.xml"), "--log", "-", "--rc", "1", "--seconds", "7"])
    assert capsys.readouterr().out.split("\t")[:5] == ["tests/t.py", "1", "1", "1", "7"]
    (tmp_path / "l.log").write_text("tests/t.py::test_a PASSED\ntests/t.py::test_b \n")
    gr.main(["--row", "tests/t.py", "--junit", str(tmp_path / "none.xml"), "--log", str(tmp_path / "l.log"),
             "--rc", "124", "--seconds", "9", "--limit", "9"])
    out = capsys.readouterr().out
    assert out.split("\t")[1:3] == ["1", "1"] and "while running tests/t.py::test_b" in out


def test_record_keeps_each_mode_and_verify_checks_the_code(tmp_path, monkeypatch, capsys):
    record = _record(tmp_path, monkeypatch)
    (tmp_path / "g.tsv").write_text("tests/a.py\t3\t0\t0\t20\t\n")
    (tmp_path / "l.tsv").write_text("tests/a.py (long)\t1\t1\t0\t50\t\n")
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "g.tsv"), "--out", str(tmp_path), "--elapsed", "30"]) == 0
    assert gr.verify() == 0
    assert gr.main(["--mode", "long", "--results", str(tmp_path / "l.tsv"), "--out", str(tmp_path), "--elapsed", "60"]) == 1
    text = record.read_text()
    assert "Gate run: **passed**" in text and "Long run: **FAILED**" in text and "| tests/a.py | passed |" in text
    assert gr.verify() == 0  # the gate line decides
    monkeypatch.setattr(gr, "code_hash", lambda root=gr.ROOT: "0" * 16)
    assert gr.verify() == 1 and "run the gate" in capsys.readouterr().out


def test_rows_per_file_of_one_run(tmp_path, capsys):
    files = "tests/test_a.py tests/test_b.py tests/test_c.py"
    junit = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.test_a" name="x" time="1.5"/><testcase classname="tests.test_a" name="y" time="2"/>
<testcase classname="tests.test_b" name="z" time="4"><failure message="m"/></testcase>
<testcase classname="tests.test_c" name="w" time="1"><skipped/></testcase></testsuite></testsuites>"""
    (tmp_path / "j.xml").write_text(junit)
    gr.main(["--files", files, "--junit", str(tmp_path / "j.xml"), "--log", "-", "--rc", "1"])
    rows = [r.split("\t") for r in capsys.readouterr().out.strip().split("\n")]
    assert [r[:5] for r in rows] == [["tests/test_a.py", "2", "0", "0", "4"], ["tests/test_b.py", "0", "1", "0", "4"],
                                     ["tests/test_c.py", "0", "0", "1", "1"]]
    (tmp_path / "l.log").write_text("tests/test_a.py::x PASSED\ntests/test_b.py::z PASSED\ntests/test_b.py::q \n")
    gr.main(["--files", files, "--junit", str(tmp_path / "none.xml"), "--log", str(tmp_path / "l.log"), "--rc", "124",
             "--limit", "500"])
    rows = [r.split("\t") for r in capsys.readouterr().out.strip().split("\n")]
    assert rows[0][1:3] == ["1", "0"] and rows[1][1:3] == ["1", "1"] and "running tests/test_b.py::q" in rows[1][5]
    assert rows[2][2] == "1" and "not reached" in rows[2][5]


def test_a_whole_run_drops_its_modes_old_rows(tmp_path, monkeypatch):
    """A row renamed or removed (e.g. a build step) does not linger after a full run of its mode;
    a run over some files keeps the rows of the others, and the other mode's rows stay."""
    record = _record(tmp_path, monkeypatch)
    (tmp_path / "old.tsv").write_text("build _C_old\t1\t0\t0\t5\t\ntests/a.py\t3\t0\t0\t20\t\n")
    (tmp_path / "long.tsv").write_text("tests/a.py (long)\t1\t0\t0\t50\t\n")
    (tmp_path / "new.tsv").write_text("build _C_new\t1\t0\t0\t5\t\ntests/a.py\t3\t0\t0\t21\t\n")
    gr.main(["--mode", "gate", "--results", str(tmp_path / "old.tsv"), "--out", str(tmp_path)])
    gr.main(["--mode", "long", "--results", str(tmp_path / "long.tsv"), "--out", str(tmp_path)])
    gr.main(["--mode", "gate", "--results", str(tmp_path / "new.tsv"), "--out", str(tmp_path)])
    assert "build _C_old" in record.read_text()  # a partial run keeps it
    gr.main(["--mode", "gate", "--results", str(tmp_path / "new.tsv"), "--out", str(tmp_path), "--whole"])
    text = record.read_text()
    assert "build _C_old" not in text and "| build _C_new | passed |" in text and "tests/a.py (long)" in text


def test_a_row_that_ran_nothing_is_recorded_as_skipped(tmp_path, monkeypatch):
    """An optional build that failed (its cases skip, the gate goes on) reads 'skipped', not
    'passed', in the record; the gate's own verdict is unchanged."""
    record = _record(tmp_path, monkeypatch)
    (tmp_path / "g.tsv").write_text("build deepgemm\t0\t0\t1\t90\tits first GEMM failed\ntests/a.py\t3\t0\t2\t20\t\n")
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "g.tsv"), "--out", str(tmp_path), "--elapsed", "30"]) == 0
    text = record.read_text()
    assert "| build deepgemm | skipped |" in text and "| tests/a.py | passed |" in text and "Gate run: **passed**" in text


def test_a_partial_run_passes_the_gate_only_with_every_gate_row_passed_at_its_code(tmp_path, monkeypatch, capsys):
    """verify reads the Gate line alone, so a run over some files that passes writes 'passed' only
    when every other gate row of the record passed at the same code; else 'incomplete', naming them."""
    record = _record(tmp_path, monkeypatch)
    (tmp_path / "a.tsv").write_text("tests/a.py\t3\t0\t0\t20\t\ntests/b.py\t1\t1\t0\t20\t\n")
    (tmp_path / "c.tsv").write_text("tests/c.py\t2\t0\t0\t20\t\n")
    (tmp_path / "b.tsv").write_text("tests/b.py\t2\t0\t0\t20\t\n")
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "a.tsv"), "--out", str(tmp_path)]) == 1
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "c.tsv"), "--out", str(tmp_path)]) == 0
    assert "Gate run: **incomplete**" in record.read_text() and "Not passed at this code: tests/b.py." in record.read_text()
    assert gr.verify() == 1 and "did not pass" in capsys.readouterr().out
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "b.tsv"), "--out", str(tmp_path)]) == 0
    assert "Gate run: **passed**" in record.read_text() and gr.verify() == 0
    monkeypatch.setattr(gr, "code_hash", lambda root=gr.ROOT: "0" * 16)  # new code: the old rows no longer count
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "c.tsv"), "--out", str(tmp_path)]) == 0
    assert "Gate run: **incomplete**" in record.read_text() and "tests/a.py, tests/b.py" in record.read_text()


def test_the_whole_gates_files_decide_and_moved_files_drop_their_rows(tmp_path, monkeypatch):
    """With --expect (the whole gate's files, as scripts/gate/gpu_check.sh passes them), a file with
    no row at this code keeps the verdict incomplete, and a row named after a test file that is
    no longer in the tree (it moved) is dropped, whatever its mode; without --expect both stay as
    they were."""
    record = _record(tmp_path, monkeypatch)
    here, gone = "tests/tools/test_gpu_report.py", "tests/test_moved_away.py"
    (tmp_path / "old.tsv").write_text(f"{gone}\t3\t0\t0\t20\t\n")
    (tmp_path / "long.tsv").write_text(f"{gone} (long)\t1\t0\t0\t50\t\n")
    (tmp_path / "part.tsv").write_text(f"{here}\t3\t0\t0\t20\t\n")
    gr.main(["--mode", "gate", "--results", str(tmp_path / "old.tsv"), "--out", str(tmp_path)])
    gr.main(["--mode", "long", "--results", str(tmp_path / "long.tsv"), "--out", str(tmp_path)])
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "part.tsv"), "--out", str(tmp_path)]) == 0
    assert f"| {gone} | passed |" in record.read_text() and f"{gone} (long)" in record.read_text()
    expect = f"{here} tests/unit/test_never_ran.py"
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "part.tsv"), "--out", str(tmp_path),
                    "--expect", expect]) == 0
    text = record.read_text()
    assert gone not in text and f"| {here} | passed |" in text
    assert "Gate run: **incomplete**" in text and "Not passed at this code: tests/unit/test_never_ran.py." in text
    (tmp_path / "rest.tsv").write_text("tests/unit/test_never_ran.py\t1\t0\t0\t5\t\n")
    assert gr.main(["--mode", "gate", "--results", str(tmp_path / "rest.tsv"), "--out", str(tmp_path),
                    "--expect", expect]) == 0
    assert "Gate run: **passed**" in record.read_text() and gr.verify() == 0
