"""The interpreter a command runs under (megatron_ep.tools.cli)."""

from __future__ import annotations

import importlib.util
import sys
from typing import List, Sequence

from ...core import envs

ENV_HINT = "run `source .venv/bin/activate` in the repository first (`bash scripts/env/setup_env.sh` creates .venv)"


def missing_modules(names: Sequence[str]) -> List[str]:
    """The modules among `names` that this interpreter cannot import. Looked up (find_spec), not
    imported: torch is not loaded here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a dotted name whose parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def require(*modules: str, prog: str, alternative: str = "") -> None:
    """Exit with status 2 and one line when a module this command needs is not importable, e.g.
    under a system python outside the project's environment, where Python's own answer is a
    traceback ending in ModuleNotFoundError. Commands call it before they import torch.
    `alternative`: another way to run the command, appended to the advice. Also checks every
    switch (envs.SWITCHES): importing the modules a command needs can read one (e.g.
    MEGATRON_EP_INSTALL), and a bad value is then one line here instead of an import traceback."""
    try:
        envs.check_switches()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    missing = missing_modules(modules)
    if missing:
        names = " and ".join(missing) + (" is" if len(missing) == 1 else " are")
        print(f"{prog}: error: {names} not importable by {sys.executable}: {ENV_HINT}"
              + (f", or {alternative}" if alternative else ""), file=sys.stderr, flush=True)
        sys.exit(2)
