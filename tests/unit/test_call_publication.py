"""Where a failing rank publishes its failure (megatron_ep.core.protocol.Call.pending) is moved along by
the launches themselves: `Call.sends` queues a kernel in which this rank signals its peers and
settles the publication after it, and the cuda paths settle nowhere else."""

import pathlib
import re

import pytest

from megatron_ep.core import protocol as P

CUDA = pathlib.Path(__file__).resolve().parents[2] / "megatron_ep" / "backends" / "cuda"


def test_sends_settles_after_the_launch():
    call = P.Call(P.OP["dispatch"], 1)
    call.owe(P.Pending.STAGED)
    seen = []

    def launch(a, b=0):
        seen.append(call.pending)  # during the launch the peers still wait for this rank
        return a + b

    assert call.sends(launch, 2, b=3) == 5
    assert seen == [P.Pending.STAGED] and not call.owes


def test_a_launch_that_raises_still_owes():
    call = P.Call(P.OP["combine"], 4)
    call.owe(P.Pending.OUT_LOC)

    def launch():
        raise RuntimeError("the kernel was not queued")

    with pytest.raises(RuntimeError, match="not queued"):
        call.sends(launch)
    assert call.pending is P.Pending.OUT_LOC  # the failure is still published where the peers wait


def test_cuda_paths_settle_only_through_their_launches():
    """A settle placed by hand beside a launch is what Call.sends replaced: the cuda package settles
    only in the region's sizing exchange (first_use_in), which reports a failed rank itself."""
    hand = []
    for f in sorted(CUDA.rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\bcall\.settle\(\)", line):
                hand.append(f"{f.relative_to(CUDA.parent)}:{n}")
    assert hand == ["cuda/region.py:" + str(_first_use_in_line())], hand


def _first_use_in_line() -> int:
    lines = (CUDA / "region.py").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if "def first_use_in" in l)
    return next(i for i in range(start, len(lines)) if "call.settle()" in lines[i]) + 1
