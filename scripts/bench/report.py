"""The benchmarks' report writer: markdown table lines, the --markdown and --json options and
files, and the code revision the figures were measured on."""

from __future__ import annotations

import json
import subprocess


def md_line(cells) -> str:
    """One markdown table row of `cells` (strings)."""
    return "| " + " | ".join(cells) + " |"


def md_rule(columns: int, right_aligned: bool = True) -> str:
    """The header rule of a markdown table: the first column left-aligned and the others
    right-aligned (columns of figures), or every column with the default alignment."""
    return "|---|" + "---:|" * (columns - 1) if right_aligned else "|" + "---|" * columns


def markdown_option(parser, default=None) -> None:
    parser.add_argument("--markdown", default=default, help="also write the markdown table here")


def json_option(parser, help: str, default=None) -> None:
    parser.add_argument("--json", default=default, help=help)


def write_markdown(path, text: str) -> None:
    """`text` and a newline to `path` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def write_json(path, obj) -> None:
    """`obj` as indented JSON to `path` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def git_revision(root: str):
    """(short commit, whether tracked files have uncommitted changes) of the checkout at `root`,
    or None (no git, not a checkout, git failing)."""
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001  (a revision is a note in the report, never a reason to fail it)
        return None
    if rev.returncode:
        return None
    return rev.stdout.strip(), bool(dirty.stdout.strip())
