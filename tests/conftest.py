import collections
import os
import signal
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# pytest put tests/ itself on sys.path for this file: there its folders cuda/, megatron/, deep_ep/
# would be namespace packages of those names (`import deep_ep` would succeed without DeepEP, and
# megatron's and cuda-python's namespaces would take them in). The helpers go on instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != TESTS]
sys.path.insert(0, os.path.join(TESTS, "support"))  # the helpers

import distpool  # noqa: E402
from distpool import DistPool  # noqa: E402

_pools = {}

# Every test has a time limit that ends it: GPU tests MEP_GPU_TEST_LIMIT_S (default 240 s), the
# others MEP_TEST_LIMIT_S (default 600 s), or a test's own `@pytest.mark.limit(seconds)`. Pool
# waits stop at the limit with each silent rank's stack (distpool.py); code that waits in this
# process is interrupted by SIGALRM a little later, with its stack. Slow cases get smaller sizes,
# not longer limits.
GPU_LIMIT_S = float(os.environ.get("MEP_GPU_TEST_LIMIT_S", "240"))
CPU_LIMIT_S = float(os.environ.get("MEP_TEST_LIMIT_S", "600"))
ALARM_GRACE_S = 20


class TestLimitExceeded(Exception):
    pass


def _limit_of(item) -> float:
    mark = item.get_closest_marker("limit")
    if mark is not None:
        return float(mark.args[0])
    return GPU_LIMIT_S if item.get_closest_marker("gpu") is not None else CPU_LIMIT_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = _limit_of(item)
    distpool.set_test_limit(item.nodeid, limit)

    def on_alarm(signum, frame):
        import faulthandler

        faulthandler.dump_traceback(all_threads=False)
        raise TestLimitExceeded(f"{item.nodeid} ran past its limit of {limit:.0f}s (stack above)")

    use_alarm = hasattr(signal, "setitimer")
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit + ALARM_GRACE_S)
    try:
        yield
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        distpool.set_test_limit(None, None)


def pytest_runtest_logreport(report):
    """A failure's report as soon as the test ends, not only in the session's summary: a run killed
    at its budget (the GPU gate's files share one) still shows why each earlier test failed, and a
    test stopped at its limit shows the silent ranks' stacks."""
    if not report.failed:
        return
    reporter = _reporter.get("terminal")
    if reporter is None:
        return
    reporter.write_line("")
    reporter.write_sep("-", f"{report.nodeid} failed ({report.when}); its report")
    reporter.write_line(report.longreprtext[-30000:])


_reporter = {}


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    _reporter["terminal"] = config.pluginmanager.get_plugin("terminalreporter")


@pytest.fixture(scope="session")
def pools():
    """pools(R) -> a live gloo DistPool of R ranks, shared by the whole session."""

    def get(world_size: int) -> DistPool:
        pool = _pools.get(world_size)
        if pool is None or pool.broken:
            pool = _pools[world_size] = DistPool(world_size)
        return pool

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def skip_reason(report) -> str:
    """A skipped test's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def pytest_terminal_summary(terminalreporter):
    """Skips once per reason, with their count (pyproject's -r leaves them out): on a machine
    without a GPU every GPU test skips, which -rs would list test by test."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(skip_reason(r) for r in skipped)
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (-rs lists each)")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"{n:4d} skipped: {reason}")
