"""A persistent pool of R worker processes joined in one torch.distributed group.

Tests send a module-level function to every rank and get each rank's return value back.
Spawning 15 processes per test would dominate CI time on two cores, so pools live for the
whole session. A rank that raises reports its traceback; a pool that stops answering is killed
and the test fails with a clear timeout instead of hanging.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def flat(per_rank) -> list:
    """One list of the error strings every rank's case body returned."""
    return [e for rank_errors in per_rank for e in rank_errors]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, env, tasks, results):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if env.get("MEP_TEST_CUDA") == "1":  # virtual ranks: every process on the visible GPU(s)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=float(env.get("MEP_TEST_COLLECTIVE_TIMEOUT", "60")))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
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
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        got, errors = {}, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                raise AssertionError(f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(got))} gave no answer within {timeout}s")
            got[rank] = value
            if not ok:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [got[r] for r in range(self.world_size)]

    def kill(self):
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self):
        if not self.broken:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        self.kill()
