"""The environment variables megatron_ep reads, parsed in one place: a switch is on for 1 / true
/ yes / on (any case) and off for 0 / false / no / off or unset; a number that does not parse
or is out of range is an error naming the variable and its value, never a silent default.
Standard library only (commands read their switches before they load torch), and loadable by
file path: setup.py reads its switches through it, and the set-up script asks it

    python3 megatron_ep/core/envs.py flag MEGATRON_EP_CPU_ONLY MEGATRON_EP_SKIP_CUDA
        # "1" or "0" per name, one line each; a bad value: one line, exit status 2
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a file: the package's own types.py must not shadow the standard library's

from typing import Iterable, Optional  # noqa: E402

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

# One prefix: every variable the package, its build and its set-up read is MEGATRON_EP_*. These
# were read under MEP_ before; the old name still works where the new one is unset, with a
# one-line notice the first time it is read.
RENAMED = {f"MEP_{name}": f"MEGATRON_EP_{name}" for name in (
    "BUILD_ONLY", "CPU_ONLY", "CUDA_AS_CPU", "DEBUG", "DEBUG_TRACEBACK", "DEVICE_SHARERS", "INTERNODE_FORCE_PUTS",
    "LL_MAX_BYTES", "MASK_TIMEOUT_S", "PTXAS_VERBOSE", "PUSH_MAX_SMS", "RANK_ERRORS", "REQUIRE_EXTENSION",
    "SKIP_CUDA", "TIMEOUT_S")}
_OLD_NAME = {new: old for old, new in RENAMED.items()}
_noticed: set = set()


def raw(name: str, environ=None) -> Optional[str]:
    """The value of `name` in `environ` (default os.environ), or of its old name (RENAMED) when
    only that one is set; None when neither is. Every reader of a megatron_ep variable reads it
    here."""
    env = os.environ if environ is None else environ
    value = env.get(name)
    old = _OLD_NAME.get(name)
    if value is None and old is not None and old in env:
        value = env[old]
        if old not in _noticed:
            _noticed.add(old)
            print(f"megatron_ep: {old} is now {name}; the old name still works", file=sys.stderr, flush=True)
    return value


def text(name: str, default: str, environ=None) -> str:
    """The string `name` holds (`default` when unset; surrounding spaces dropped)."""
    value = raw(name, environ)
    return default if value is None else value.strip()

# Every switch megatron_ep, its build (setup.py) and its set-up (scripts/env/setup_env.sh) read,
# each through flag(); tests/unit/test_envs.py keeps the list complete. Commands check them all
# before they start (megatron_ep.tools.cli), so a typo is one line there, not a traceback later.
SWITCHES = {
    "MEGATRON_EP_DEBUG_TRACEBACK": "a failing command prints the traceback too",
    "MEGATRON_EP_INSTALL": "importing megatron_ep.megatron installs the flex managers",
    "MEGATRON_EP_CHECK_INPUTS": "the flex managers' cuda Buffers check expert ids (a host sync)",
    "MEGATRON_EP_INTERNODE_FORCE_PUTS": "the internode path stages its RDMA puts even on one host",
    "MEGATRON_EP_CPU_ONLY": "set-up without the CUDA extension (implies MEGATRON_EP_SKIP_CUDA)",
    "MEGATRON_EP_SKIP_CUDA": "build without the CUDA extension",
    "MEGATRON_EP_REQUIRE_EXTENSION": "a build that cannot make the CUDA extension fails, saying why",
    "MEGATRON_EP_DEBUG": "build device code with -G -O0",
    "MEGATRON_EP_PTXAS_VERBOSE": "build with ptxas's register and spill report",
    "MEGATRON_EP_CUDA_AS_CPU": "scripts/deepep_tests.py --cpu: a test's CUDA devices are the CPU (scripts/cuda_as_cpu)",
}


def flag(name: str) -> bool:
    """Whether the switch `name` is on; ValueError for a value that is neither on nor off."""
    given = raw(name) or ""
    value = given.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={given!r} is not a switch: use 1 or 0 (true/false, yes/no, on/off)")


def check_switches(names: Iterable[str] = tuple(SWITCHES)) -> None:
    """ValueError naming the first of `names` whose value is neither on nor off."""
    for name in names:
        flag(name)


def _parsed(name: str, convert, what: str):
    """`convert` of the value of `name`; None when it is unset or empty."""
    given = (raw(name) or "").strip()
    if not given:
        return None
    try:
        return convert(given)
    except ValueError:
        raise ValueError(f"{name}={given!r} is not {what}") from None


def integer(name: str, default: Optional[int], minimum: Optional[int] = None,
            maximum: Optional[int] = None) -> Optional[int]:
    """The integer `name` holds (`default` when unset or empty), in [minimum, maximum]."""
    value = _parsed(name, int, "an integer")
    if value is None:
        return default
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} must be at most {maximum}")
    return value


def number(name: str, default: Optional[float], above: Optional[float] = None) -> Optional[float]:
    """The number `name` holds (`default` when unset or empty), greater than `above`."""
    value = _parsed(name, float, "a number")
    if value is None:
        return default
    if above is not None and not value > above:
        raise ValueError(f"{name}={value} must be greater than {above}")
    return value


def _main(argv) -> int:
    """`flag NAME...`: each switch as 1 or 0 on its own line (for shell scripts: one parser, one
    rule). A bad value: one line on stderr, exit status 2, nothing on stdout. `--prog P` names
    the caller in that line."""
    prog = "megatron_ep/core/envs.py"
    if argv[:1] == ["--prog"] and len(argv) > 1:
        prog, argv = argv[1], argv[2:]
    if len(argv) < 2 or argv[0] != "flag":
        print(f"usage: {prog} [--prog P] flag NAME [NAME ...]", file=sys.stderr)
        return 2
    try:
        values = [flag(name) for name in argv[1:]]
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join("1" if v else "0" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
