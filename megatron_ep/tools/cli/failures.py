"""A command's failures: one line, said once per run (megatron_ep.tools.cli)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable, List, Optional, Sequence

from ...core import envs

DEBUG_ENV = "MEGATRON_EP_DEBUG_TRACEBACK"
_ERRORS_ENV = "MEGATRON_EP_RANK_ERRORS"  # set by launch(): the directory where ranks leave their one line
DEBUG_HINT = f"--debug or {DEBUG_ENV}=1 shows the traceback"


class UsageError(Exception):
    """A bad argument or an unmet precondition, found before any work: printed as one line
    without a traceback, exit status 2."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise UsageError(message)


def debug_requested(argv: Optional[Sequence[str]] = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or envs.flag(DEBUG_ENV)


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
    UsageError, 1 otherwise; the traceback too with --debug / MEGATRON_EP_DEBUG_TRACEBACK=1. A switch of
    envs.SWITCHES set to neither on nor off is such a line before main runs; stdout closed by
    its reader ends quietly (stdout_closed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        envs.check_switches()  # every switch, before anything reads one deep inside the run
        debug = debug_requested(argv)
    except ValueError as e:
        _report(f"{prog}: error: {e}", usage=True)
        return 2
    try:
        try:
            code = main(argv)
        finally:
            sys.stdout.flush()  # a reader gone (`| head -1`) shows here, not at the interpreter's exit
    except BrokenPipeError:
        return stdout_closed()
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


SIGPIPE_STATUS = 128 + 13  # the shell's status of a command ended by SIGPIPE, as `yes | head -1` gives


def stdout_closed() -> int:
    """The reader of stdout went away (`cmd | head -1`): end quietly, as a command ended by
    SIGPIPE does, with no error line for output nobody asked for. Later writes and the
    interpreter's final flush go to /dev/null instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return SIGPIPE_STATUS


def note(line: str) -> None:
    """Print an informational line on rank 0 only (or outside a launcher): said once per run
    when every rank comes to it."""
    if (_env_int("RANK") or 0) == 0:
        print(line, flush=True)
