"""The test pool's failure reports (tests/distpool.py): a rank that dies fails the run at once,
naming its signal and where it died; a rank that waits past the limit is named with its stack."""

from __future__ import annotations

import os
import signal
import time

import pytest

from distpool import DistPool


def die_on_rank_1(sig: int) -> int:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), sig)
        time.sleep(5)  # (the signal ends the process first)
    return 0


def wait_on_rank_1(seconds: float) -> int:
    if int(os.environ["RANK"]) == 1:
        time.sleep(seconds)
    return 0


@pytest.fixture
def pool():
    p = DistPool(2)
    yield p
    p.close()


def test_a_rank_that_dies_fails_the_run_at_once_naming_its_signal_and_stack(pool):
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        pool.run(die_on_rank_1, int(signal.SIGFPE), timeout=120)
    waited = time.monotonic() - start
    text = str(e.value)
    assert waited < 30, f"the pool waited {waited:.0f}s for a dead rank"
    assert "rank(s) [1] died" in text and "killed by SIGFPE" in text, text
    assert "die_on_rank_1" in text, f"no stack of where the rank died:\n{text}"
    assert pool.broken


def test_a_rank_that_waits_past_the_timeout_is_named_with_its_stack(pool):
    with pytest.raises(AssertionError) as e:
        pool.run(wait_on_rank_1, 60.0, timeout=3)
    text = str(e.value)
    assert "ranks [1] gave no answer" in text and "alive" in text, text
    assert "wait_on_rank_1" in text, f"no stack of where the rank waited:\n{text}"
