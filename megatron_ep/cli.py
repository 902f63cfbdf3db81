"""What every command-line entry point shares (demo, recipes, A/B script, launchers, model).

* `ArgumentParser`: `--help` shows every option's default; a bad argument prints one line
  (`prog: error: ...`) instead of the whole usage; `--debug` is added.
* `integer(min, max)`, `number(min)`: option types that hold an option's range (finite floats
  only), so argparse refuses a bad value, naming the option, before anything runs.
* `run_main(main)`: runs an entry point. A failure prints one line naming the problem and
  returns a non-zero exit status (2 for a bad argument, 1 otherwise); `--debug` or
  `MEP_DEBUG_TRACEBACK=1` adds the traceback. In a multi-rank run one rank says it.
* `launch(nprocs, cmd)`: runs a command line as `nprocs` local ranks with torchrun's
  environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); the caller validates its
  arguments first, and a failing rank comes back as one line, not a multi-process traceback.
* `require(*modules)`: a command run by an interpreter that cannot import torch (a system python
  outside the project's `.venv`) exits with one line saying so and how to enter the
  environment, instead of an import traceback. This module imports only the standard library,
  and `import megatron_ep` loads torch only on first use of its API, so commands call it first.
* `note(line)`: an informational line, printed by rank 0 only.
* `quiet()`: filters third-party warnings that say nothing about a run of our scripts
  (Apex / TransformerEngine absent, torch's "No CUDA runtime is found" on CPU machines, ...).
  Only our scripts call it; importing the library changes no filter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, List, Optional, Sequence

from . import envs

DEBUG_ENV = "MEP_DEBUG_TRACEBACK"
_ERRORS_ENV = "MEP_RANK_ERRORS"  # set by launch(): the directory where ranks leave their one line
DEBUG_HINT = f"--debug or {DEBUG_ENV}=1 shows the traceback"


class UsageError(Exception):
    """A bad argument or an unmet precondition, found before any work: printed as one line
    without a traceback, exit status 2."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise UsageError(message)


# ------------------------------------------------------------------------- option types
# The type and range of an option live in its add_argument(type=...): argparse applies them to
# every value given, before main() runs, and a bad one is one line naming the option
# ("argument --lr: must be a finite number > 0, got 'inf'").
def integer(minimum: int = 1, maximum: Optional[int] = None) -> Callable[[str], int]:
    """argparse type: an int in [minimum, maximum]."""
    wanted = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {wanted}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {wanted}, got {value}")
        return value

    parse.bounds = (minimum, maximum)  # read by the tests that every numeric option is bounded
    return parse


def number(minimum: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """argparse type: a finite float >= minimum (> minimum with above=True). float() alone
    takes "nan" and "inf", which no option of ours means."""
    wanted = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {text!r}")
        return value

    parse.bounds = (float(minimum), None)
    return parse


# --------------------------------------------------------------------------------- parsing
class HelpFormatter(argparse.HelpFormatter):
    """Descriptions of several lines as written (one line: wrapped); `(default: X)` after every
    option that has a default."""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, defaults in --help and a --debug flag."""

    def __init__(self, *args, debug: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        if debug:
            self.add_argument("--debug", action="store_true",
                              help=f"on a failure, print the full traceback (or set {DEBUG_ENV}=1)")

    def error(self, message):  # argparse's version prints the whole usage first
        _report(f"{self.prog}: error: {message} (--help lists the options)", usage=True)
        sys.exit(2)


def debug_requested(argv: Optional[Sequence[str]] = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or envs.flag(DEBUG_ENV)


# ------------------------------------------------------------------------------- failures
def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def world_size_from_env() -> Optional[int]:
    """The world size a launcher (torchrun, launch()) gave this process, or None outside one."""
    return _env_int("WORLD_SIZE") if "RANK" in os.environ else None


def launched_by_us() -> bool:
    """Whether this process is a rank started by launch() (not by torchrun)."""
    return _ERRORS_ENV in os.environ


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (the message alone for a UsageError)."""
    text = str(exc).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if isinstance(exc, UsageError):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _report(line: str, usage: bool) -> None:
    """Say `line` once for the whole run: the parent of launch() prints the first rank's; under
    torchrun a bad argument (the same on every rank) is said by rank 0 only, and other
    failures by each failing rank, prefixed with its rank."""
    rank, world = _env_int("RANK"), world_size_from_env() or 1
    directory = os.environ.get(_ERRORS_ENV)
    if directory and rank is not None:
        path = os.path.join(directory, f"rank{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(line)
        os.replace(path + ".tmp", path)
        return
    if world > 1 and rank is not None:
        if usage:
            if rank != 0:
                time.sleep(2.0)  # let rank 0 say it and exit first: torchrun stops the others then
                return
        else:
            line = f"[rank {rank}] {line}"
    print(line, file=sys.stderr, flush=True)
    _tell_torchrun(line)


def _tell_torchrun(line: str) -> None:
    """Under torchrun, also leave the line in the error file torchrun reads from a failed rank
    (TORCHELASTIC_ERROR_FILE, the file torch's @record writes): the failure report that torchrun
    prints after it then names the problem instead of pointing at how to get a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report then says what it says without it; the line was printed


def run_main(main: Callable[[List[str]], Optional[int]], argv: Optional[Sequence[str]] = None, *,
             prog: str, hint: str = DEBUG_HINT) -> int:
    """main(argv) -> exit status. A failure is one line (`prog: error: ...`), status 2 for a
    UsageError, 1 otherwise; the traceback too with --debug / MEP_DEBUG_TRACEBACK=1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse (already reported), --help, or an explicit exit
        if isinstance(e.code, str):
            _report(f"{prog}: error: {e.code}", usage=True)
            return 2
        return e.code or 0
    except KeyboardInterrupt:
        return 130
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line
        usage = isinstance(e, UsageError)
        if debug and not usage:
            traceback.print_exc()
        _report(f"{prog}: error: {one_line(e)}" + ("" if usage or debug or not hint else f" ({hint})"), usage)
        return 2 if usage else 1
    code = code or 0
    if code and launched_by_us():
        _report("", usage=False)  # the rank reported its failure itself: the launcher adds nothing
    return code


# ---------------------------------------------------------------------------- environment
ENV_HINT = "run `source .venv/bin/activate` in the repository first (`bash scripts/setup_env.sh` creates .venv)"


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
    `alternative`: another way to run the command, appended to the advice."""
    missing = missing_modules(modules)
    if missing:
        names = " and ".join(missing) + (" is" if len(missing) == 1 else " are")
        print(f"{prog}: error: {names} not importable by {sys.executable}: {ENV_HINT}"
              + (f", or {alternative}" if alternative else ""), file=sys.stderr, flush=True)
        sys.exit(2)


def note(line: str) -> None:
    """Print an informational line on rank 0 only (or outside a launcher): said once per run
    when every rank comes to it."""
    if (_env_int("RANK") or 0) == 0:
        print(line, flush=True)


# ------------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(nprocs: int, cmd: Sequence[str], *, prog: str, grace_s: float = 5.0) -> int:
    """Run `cmd` as `nprocs` local ranks (torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set). When a rank
    fails, the others get `grace_s` to finish, then SIGTERM; the first failure's one line is
    printed here (without a rank when every failing rank said the same). Returns the first
    failing rank's exit status, else 0."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="mep-ranks-") as errors:
        base = dict(os.environ)
        base.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), **{_ERRORS_ENV: errors})
        base.setdefault("OMP_NUM_THREADS", "1")
        # the children import megatron_ep from where this process did
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))
        procs = []
        for r in range(nprocs):
            procs.append(subprocess.Popen(list(cmd), env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}))
        first, deadline = None, None
        try:
            while True:
                codes = [p.poll() for p in procs]
                for r, c in enumerate(codes):
                    if c not in (None, 0) and first is None:
                        first, deadline = (r, c), time.monotonic() + grace_s
                if all(c is not None for c in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    _stop(procs)
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            _stop(procs, signal.SIGINT)
            return 130
        if first is None:
            return 0
        rank, code = first
        said = {}
        for name in os.listdir(errors):
            if name.startswith("rank") and name[4:].isdigit():
                path = os.path.join(errors, name)
                with open(path) as f:
                    said[int(name[4:])] = (os.path.getmtime(path), f.read().strip())
        if said:
            _, r0 = min((t, r) for r, (t, _) in said.items())
            line = said[r0][1]
            if line and len({text for _, text in said.values() if text}) > 1:
                line = line.replace(f"{prog}: error: ", f"{prog}: error: rank {r0}: ", 1)
        else:
            how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            line = f"{prog}: error: rank {rank} {how} without a message"
        if line:
            print(line, file=sys.stderr, flush=True)
        return code if code > 0 else 1


def _stop(procs, sig=signal.SIGTERM, wait_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    end = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------- quiet
# (message regex matched at the start, category): printed by megatron-core / torch on machines
# without Apex or TransformerEngine, or for defaults our scripts do not choose; none of them
# says anything about the run (our recipes build Megatron's local, non-TE layer specs).
QUIET_WARNINGS = (
    (r"Apex is not installed", UserWarning),
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Transformer Engine is not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),  # Megatron's own default cuda_graph_scope
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),  # Megatron's call
)
QUIET_LOGS = {
    "torch.utils.cpp_extension": "No CUDA runtime is found",  # importing cpp_extension on a CPU machine
    "torch.multiprocessing.spawn": "Terminating process",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_quiet_done = False


def quiet() -> None:
    """Install the filters above in this process (idempotent). For our scripts' entry points;
    the library itself never calls it."""
    global _quiet_done
    if _quiet_done:
        return
    _quiet_done = True
    for pattern, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, prefix in QUIET_LOGS.items():
        logging.getLogger(name).addFilter(_DropMessage(prefix))
