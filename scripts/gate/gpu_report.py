#!/usr/bin/env python3
"""The GPU gate's bookkeeping (scripts/gate/gpu_check.sh calls it; CONTRIBUTING.md says why).

    gpu_report.py --row NAME --junit X --log L --rc N --seconds S --limit T   one TSV summary row
    gpu_report.py --files "A B" --junit X --log L --rc N --limit T            a row per file of one run
    gpu_report.py --mode gate|long|e2e --results TSV --out DIR --elapsed S        summary lines, and
                  DIR/gpu-status.md: docs/gpu-status.md with the rows of this run replaced
    gpu_report.py hash                                                        the code hash
    gpu_report.py verify                                                      is the working
                  tree's code the code the record's gate run passed on? (exit 0 yes, 1 no)

The code hash is a SHA-256 over the contents of csrc/, megatron_ep/ and tests/ (build outputs
left out), so the record names the code it ran on even where the GPU machine has no git: the
commit in the record is the one the run was started for, and `verify` checks that the working
tree's code is that code.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD = os.path.join(ROOT, "docs", "gpu-status.md")
CODE_DIRS = ("csrc", "megatron_ep", "tests")
SKIP_DIRS = {"__pycache__", "build", ".pytest_cache"}
SKIP_SUFFIXES = (".so", ".pyc", ".o", ".egg-info")
FIELDS = ("file", "passed", "failed", "skipped", "seconds", "note")


def code_hash(root: str = ROOT) -> str:
    h = hashlib.sha256()
    for top in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            for name in sorted(filenames):
                if name.endswith(SKIP_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
                h.update(b"\0")
    return h.hexdigest()[:16]


def row(args) -> str:
    """passed / failed / skipped from the junit record; without one (the file's timeout killed
    pytest), from the verbose log, naming the test that was running."""
    passed = failed = skipped = 0
    note = ""
    if os.path.exists(args.junit):
        for case in ET.parse(args.junit).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            if kinds & {"failure", "error"}:
                failed += 1
            elif "skipped" in kinds:
                skipped += 1
            else:
                passed += 1
        if args.rc != 0 and failed == 0:
            failed, note = 1, f"pytest exit {args.rc}"
    else:
        log = open(args.log, errors="replace").read() if os.path.exists(args.log) else ""
        passed = len(re.findall(r" PASSED", log))
        failed = len(re.findall(r" (FAILED|ERROR)", log)) + 1
        skipped = len(re.findall(r" SKIPPED", log))
        started = re.findall(r"^(tests/\S+::\S+)", log, re.M)
        running = started[-1] if started else "before the first test"
        note = f"killed at the file's {args.limit}s timeout while running {running}"
    return "\t".join(map(str, (args.row, passed, failed, skipped, args.seconds, note)))


def file_rows(args) -> str:
    """One summary row per test file of a single pytest run over several files (`--files`), from
    its junit record (test times summed per file), or -- killed at its timeout -- from its
    verbose log: the file that was running is named, files after it were not reached."""
    files = args.files.split()
    counts = {f: [0, 0, 0, 0.0] for f in files}  # passed, failed, skipped, seconds
    notes = {f: "" for f in files}
    if os.path.exists(args.junit):
        for case in ET.parse(args.junit).getroot().iter("testcase"):
            path = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py")
            f = next((x for x in files if path.endswith(x) or x.endswith(path)), None)
            if f is None:
                continue
            kinds = {child.tag for child in case}
            counts[f][1 if kinds & {"failure", "error"} else 2 if "skipped" in kinds else 0] += 1
            counts[f][3] += float(case.get("time", 0) or 0)
        if args.rc not in (0, 5) and not any(c[1] for c in counts.values()):
            counts[files[-1]][1] += 1
            notes[files[-1]] = f"pytest exit {args.rc}"
    else:
        log = open(args.log, errors="replace").read() if os.path.exists(args.log) else ""
        started = re.findall(r"^(tests/\S+?\.py)::(\S+)", log, re.M)
        for f in files:
            counts[f][0] = len(re.findall(rf"^{re.escape(f)}::\S+ PASSED", log, re.M))
            counts[f][1] = len(re.findall(rf"^{re.escape(f)}::\S+ (?:FAILED|ERROR)", log, re.M))
            counts[f][2] = len(re.findall(rf"^{re.escape(f)}::\S+ SKIPPED", log, re.M))
        running = started[-1] if started else None
        reached = True
        for f in files:
            if running and f == running[0]:
                counts[f][1] += 1
                notes[f] = f"killed at the run's {args.limit}s timeout while running {running[0]}::{running[1]}"
                reached = False
            elif not reached or running is None:
                counts[f][1] += 1
                notes[f] = "not reached before the run's timeout"
    return "\n".join("\t".join(map(str, (f, c[0], c[1], c[2], round(c[3]), notes[f]))) for f, c in counts.items())


def read_rows(path: str) -> list:
    rows = []
    for line in open(path):
        parts = line.rstrip("\n").split("\t")
        if len(parts) >= 5:
            rows.append(dict(zip(FIELDS, parts + [""] * (len(FIELDS) - len(parts)))))
    return rows


def machine() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    return f"{len(names)} x {names[0]}" if names else "no GPU"


def commit() -> str:
    if os.environ.get("MEP_GATE_COMMIT"):
        return os.environ["MEP_GATE_COMMIT"][:12]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


HEADER = """# GPU record

Written by `scripts/gate/gpu_check.sh` (CONTRIBUTING.md): the last run of each mode (the gate; `long`:
the long fuzz, soak and sanitizer tools; `e2e`: Megatron-LM's pretrain_gpt.py) and, for each GPU
test file, its last run,
at which commit and code hash (`python3 scripts/gate/gpu_report.py hash`: csrc/, megatron_ep/, tests/),
on which machine, and its summary. `python3 scripts/gate/gpu_report.py verify` says whether the working
tree's code is the code of the last gate run. Do not edit by hand: commit the copy the gate writes
under `$OUT`.

"""


def _parse_record(text: str) -> dict:
    """The table rows of an existing record, by file."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("test file", "---") and not cells[0].startswith("-"):
            rows[cells[0]] = cells
    return rows


def report(args) -> int:
    rows = read_rows(args.results)
    ok = all(int(r["failed"]) == 0 for r in rows) and rows
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where, sha, code = machine(), commit(), code_hash()
    print(f"=== GPU gate ({args.mode}) at {sha}, code {code}, {where}: {'PASSED' if ok else 'FAILED'} "
          f"in {args.elapsed} s")
    for r in rows:
        line = f"{r['file']}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, {r['seconds']} s"
        print(line + (f" ({r['note']})" if r["note"] else ""))
    text = open(RECORD).read() if os.path.exists(RECORD) else ""
    old = _parse_record(text)
    expected = set((getattr(args, "expect", None) or "").split())
    if expected:
        # the gate's own run (it names its files): a test file that moved or went away keeps no
        # row, in any mode; its name could never pass at this code
        old = {name: cells for name, cells in old.items()
               if not name.startswith("tests/") or os.path.exists(os.path.join(ROOT, name.split(" ")[0]))}
    if getattr(args, "whole", False):
        old = {name: cells for name, cells in old.items() if cells[6] != args.mode}
    titles = {"gate": "Gate", "long": "Long", "e2e": "End-to-end"}
    runs = dict(re.findall(r"^(Gate|Long|End-to-end) run: (.*)$", text, re.M))  # the other modes' lines stay
    verdict, missing = ("passed" if ok else "FAILED"), ""
    if ok and args.mode == "gate":
        # a run over some files passes the gate only with every other gate row passed at this code
        # (verify reads this line alone)
        # (and with every file of the whole gate, --expect, run at this code: one that moved has no
        # row yet)
        ran = {r["file"] for r in rows}

        def behind_at_this_code(name: str) -> bool:
            cells = old.get(name)
            if name in ran or cells is None:
                return name not in ran and name in expected
            return cells[6] == "gate" and (cells[1] == "FAILED" or cells[3] != code)

        behind = sorted(n for n in set(old) | expected if behind_at_this_code(n))
        if behind:
            verdict, missing = "incomplete", f" Not passed at this code: {', '.join(behind)}."
    runs[titles[args.mode]] = (
        f"**{verdict}**, commit {sha}, code {code}, {when}, {where}, {args.elapsed} s in all.{missing}")
    for r in rows:
        # a row that ran nothing (e.g. an optional build that failed, its cases skipped) is not a pass
        result = ("FAILED" if int(r["failed"]) else
                  "skipped" if int(r["passed"]) == 0 and int(r["skipped"]) > 0 else "passed")
        summary = f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, {r['seconds']} s"
        if r["note"]:
            summary += f"; {r['note']}"
        old[r["file"]] = [r["file"], result, sha, code, when, where, args.mode, summary]
    lines = [HEADER] + [f"{mode} run: {runs[mode]}\n" for mode in titles.values() if mode in runs] + [
             "| test file | result | commit | code | date | machine | mode | summary |",
             "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in sorted(old.items())]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu-status.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if os.path.isdir(os.path.dirname(RECORD)):
        with open(RECORD, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def verify() -> int:
    if not os.path.exists(RECORD):
        print("no docs/gpu-status.md: no gate run is recorded")
        return 1
    m = re.search(r"^Gate run: \*\*(\w+)\*\*, commit (\w+), code (\w+)", open(RECORD).read(), re.M)
    if not m:
        print("docs/gpu-status.md has no 'Gate run' line")
        return 1
    result, sha, code = m.groups()
    here = code_hash()
    if result != "passed":
        print(f"the last recorded gate run (commit {sha}) did not pass")
        return 1
    if code != here:
        print(f"the working tree's code ({here}) is not the code the gate passed on ({code}, commit {sha}): run the gate")
        return 1
    print(f"the working tree's code {here} passed the gate at commit {sha}")
    return 0


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["hash"]:
        print(code_hash())
        return 0
    if argv[:1] == ["verify"]:
        return verify()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row")
    ap.add_argument("--files", help="rows per file of one run over these files (space-separated)")
    ap.add_argument("--junit")
    ap.add_argument("--log")
    ap.add_argument("--rc", type=int, default=0)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--mode", default="gate")
    ap.add_argument("--results")
    ap.add_argument("--out")
    ap.add_argument("--elapsed", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--expect", default="",
                    help="the whole gate's test files (space-separated): a run over some files passes the gate "
                         "only with each of these passed at this code, in this run or in the record")
    ap.add_argument("--whole", action="store_true",
                    help="the run covered its whole mode: the mode's rows from earlier runs are dropped, "
                         "so a renamed or removed row does not linger")
    args = ap.parse_args(argv)
    if args.files:
        print(file_rows(args))
        return 0
    if args.row:
        print(row(args))
        return 0
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
