"""A persistent pool of R worker processes joined in one torch.distributed group.

Tests send a module-level function to every rank and get each rank's return value back.
Spawning 15 processes per test would dominate CI time on two cores, so pools live for the
whole session. A rank that raises reports its traceback.

Every wait is bounded: by the run's own `timeout` and by the running test's limit (conftest.py
sets it from the test's `limit` mark or MEP_TEST_LIMIT_S). When either passes, each rank that
gave no answer dumps its Python stack (faulthandler on SIGUSR1), the whole pool is killed (GPU
memory and MPS clients with it), and the test fails naming itself, the ranks and where each one
waited. A worker that dies (a signal, an exit) fails the run within a second, naming its signal
and the Python stack faulthandler wrote as it died, instead of leaving the others to wait out the
limit. Workers also die with the process that started them (PR_SET_PDEATHSIG), so a killed
pytest leaves none behind.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
STACK_DIR = os.path.join(tempfile.gettempdir(), "mep-pool-stacks")

# The running test's name and monotonic deadline (conftest.py's pytest_runtest_call sets them).
_test = {"name": None, "deadline": None, "limit": None}


def set_test_limit(name, limit_s) -> None:
    """Bound every pool wait of test `name` to `limit_s` seconds from now (None: unbounded)."""
    _test.update(name=name, limit=limit_s, deadline=None if limit_s is None else time.monotonic() + limit_s)


def flat(per_rank) -> list:
    """One list of the error strings every rank's case body returned."""
    return [e for rank_errors in per_rank for e in rank_errors]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the daemon flag still ends workers at a normal exit
        pass


def _stack_file(pid: int) -> str:
    return os.path.join(STACK_DIR, f"{pid}.txt")


def _worker(rank, world_size, port, backend, env, tasks, results):
    _die_with_parent()
    import faulthandler

    os.makedirs(STACK_DIR, exist_ok=True)
    stacks = open(_stack_file(os.getpid()), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # a fatal signal's stack, for DistPool._died
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if env.get("MEP_TEST_CUDA") == "1":  # virtual ranks: every process on the visible GPU(s)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.empty(1, device="cuda")  # the context (and its module loading) now, while the pool waits for work
    timeout = datetime.timedelta(seconds=float(env.get("MEP_TEST_COLLECTIVE_TIMEOUT", "60")))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    for module in filter(None, env.get("MEP_TEST_PRELOAD", "").split(",")):
        try:  # slow imports (megatron) before the first task; a failure is the task's to report
            importlib.import_module(module)
        except Exception:
            pass
    while True:
        item = tasks.get()
        if item is None:
            break
        module, name, args, kwargs = item
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report, keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _read_stack(pid: int) -> str:
    try:
        with open(_stack_file(pid)) as f:
            return f.read()
    except OSError:
        return ""


def _innermost(stack: str, lines: int = 14) -> str:
    """The worker thread's innermost frames of a faulthandler dump (threads come one block each,
    most recent call first; the one that runs the case has _worker in it)."""
    blocks = [b.strip() for b in stack.split("\n\n") if b.strip()]
    mine = [b for b in blocks if "_worker" in b] or blocks
    if not mine:
        return "(no stack: the process wrote none)"
    return "\n".join(mine[-1].splitlines()[:lines])


class DistPool:
    def __init__(self, world_size: int, backend: str = "gloo", env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, dict(env or {}), self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = 900, **kwargs):
        """Run fn(*args, **kwargs) on every rank; return the list of per-rank results."""
        assert not self.broken, "pool was killed after an earlier timeout"
        start = time.monotonic()
        deadline = start + timeout
        limited_by_test = _test["deadline"] is not None and _test["deadline"] < deadline
        if limited_by_test:
            deadline = _test["deadline"]
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        got, errors = {}, []
        try:
            while len(got) < self.world_size:
                try:  # (in slices: a worker that died is seen within one)
                    rank, ok, value = self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    dead = [r for r in range(self.world_size) if r not in got and not self.procs[r].is_alive()]
                    if dead:
                        raise AssertionError(self._died(fn, dead, got)) from None
                    if time.monotonic() >= deadline:
                        raise AssertionError(self._hung(fn, got, time.monotonic() - start, limited_by_test)) from None
                    continue
                got[rank] = value
                if not ok:
                    errors.append(f"--- rank {rank} ---\n{value}")
        except BaseException:
            self.kill()  # a pool left with unanswered work would hand its answers to the next test
            raise
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [got[r] for r in range(self.world_size)]

    def _died(self, fn, dead: list, got: dict) -> str:
        """Which ranks died, how, and where (the stack faulthandler wrote as each died), then where
        the other silent ranks wait."""
        others = [r for r in range(self.world_size) if r not in got and r not in dead]
        return (f"{_test['name'] or 'test'}: {fn.__name__}: rank(s) {dead} died before answering; the pool was "
                f"killed. Where each died (innermost frame first):\n" + "\n".join(map(self._where, dead))
                + (f"\n(ranks {others} were still waiting)" if others else ""))

    def _hung(self, fn, got: dict, waited: float, limited_by_test: bool) -> str:
        """Where each silent rank waits (its stack), for the failure message."""
        silent = [r for r in range(self.world_size) if r not in got]
        for r in silent:
            p = self.procs[r]
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(1.0)
        bound = (f"the test's limit of {_test['limit']:.0f}s" if limited_by_test else "the run's timeout")
        return (f"{_test['name'] or 'test'}: {fn.__name__}: ranks {silent} gave no answer within {waited:.0f}s "
                f"({bound}); the pool was killed. Where each waited (innermost frame first):\n"
                + "\n".join(map(self._where, silent)))

    def _where(self, r: int) -> str:
        """Rank r's state (alive, killed by which signal, or its exit code) and the innermost frames
        of the last stack it wrote (on SIGUSR1, or as a fatal signal killed it)."""
        p = self.procs[r]
        code = p.exitcode  # (None while it runs)
        if code is None:
            state = "alive"
        elif code < 0:
            state = f"killed by {signal.Signals(-code).name}"
        else:
            state = f"exited with {code}"
        return f"--- rank {r} (pid {p.pid}, {state}) ---\n{_innermost(_read_stack(p.pid))}"

    def kill(self):
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
            try:
                os.unlink(_stack_file(p.pid))
            except (OSError, TypeError):
                pass

    def close(self):
        if not self.broken:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        self.kill()
