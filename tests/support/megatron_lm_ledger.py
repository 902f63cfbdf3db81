"""Test-only: tests/support/megatron_lm_virtual.py (pretrain_gpt.py on virtual ranks) with a ledger of every
megatron_ep Buffer call of each rank, for a run that hangs or times out: which rank made which
call when, which waited where.

    MEP_CALL_LEDGER=DIR torchrun --nproc-per-node 4 tests/support/megatron_lm_ledger.py [--ep-* OPTIONS] pretrain_gpt.py ...

DIR/rank<R>.log (R: the global rank) gets, each line led by the seconds since the process started
and the thread's name:
* the process's CUDA module loading (the driver's answer) and, at each cuda Buffer's first call,
  its SM budget and the ranks it counts on this GPU;
* every Buffer call as its host side begins and ends: Buffer ordinal, call number, op, and at the
  end the signature's non-zero fields, or the exception it raised;
* after a call that raised: the rank's handshake counters (signal[slot][source rank] and the
  handshakes it completed, from its communication region's control block);
* every thread's Python stack each time nothing began or ended for MEP_LEDGER_STALL_S seconds
  (default 15; at most 4 dumps per stall): where a rank's host stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the harness beside this file, else the one of the repository it runs in (a copy of this file
# kept outside the tree runs the tree's own harness)
sys.path[:0] = [HERE, os.path.join(os.getcwd(), "tests", "support"), os.path.dirname(os.path.dirname(HERE))]


def _loading_mode() -> str:
    try:
        mode = ctypes.c_int(0)
        ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode))
        return {1: "EAGER", 2: "LAZY"}.get(mode.value, f"mode {mode.value}")
    except (OSError, AttributeError) as exc:
        return f"unknown ({exc})"


class Ledger:
    def __init__(self, path: str, stall_s: float):
        self.f = open(path, "a", buffering=1)
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()
        self.stall_s = stall_s
        self.seen: set = set()
        threading.Thread(target=self._watch, name="ledger", daemon=True).start()

    def write(self, text: str, progress: bool = True) -> None:
        with self.lock:
            now = time.monotonic()
            self.f.write(f"{now - self.t0:9.3f} {threading.current_thread().name:>16} {text}\n")
            if progress:
                self.last = now

    def _watch(self) -> None:
        dumps = 0
        while True:
            time.sleep(1.0)
            idle = time.monotonic() - self.last
            if idle < self.stall_s:
                dumps = 0
            elif dumps < 4 and idle >= self.stall_s * (dumps + 1):
                dumps += 1
                self.write(f"--- nothing began or ended for {idle:.0f}s: every thread's stack", progress=False)
                with self.lock:
                    self.f.flush()
                    faulthandler.dump_traceback(self.f, all_threads=True)
                    self.f.flush()

    def describe_buffer(self, buf) -> None:
        if buf.id in self.seen:
            return
        self.seen.add(buf.id)
        rt = getattr(buf._impl, "rt", None) or getattr(getattr(buf._impl, "path", None), "rt", None)
        if rt is None:
            self.write(f"buf{buf.ordinal}: backend {buf.backend}, {buf.num_ranks} ranks")
            return
        self.write(f"buf{buf.ordinal}: backend cuda, {buf.num_ranks} ranks, num_sms {rt.budget.num_sms}, push_sms "
                   f"{rt.budget.push_sms}, local_sms {rt.budget.local_sms}, ranks on this GPU "
                   f"{rt.ranks_per_device} of {rt.sm_count} SMs, timeout {rt.timeout_s:.0f}s")

    def counters(self, buf) -> None:
        """The handshake counters of this rank's region (a copy on a side thread: a stream that
        still waits cannot stop the ledger)."""
        rt = getattr(buf._impl, "rt", None) or getattr(getattr(buf._impl, "path", None), "rt", None)
        if rt is None or not rt.region.ready:
            return
        import torch
        from megatron_ep.core import protocol as P

        slots, ranks = 8, 8
        got: dict = {}

        def read():
            try:
                with torch.cuda.stream(torch.cuda.Stream()):
                    got["v"] = rt.region.view(rt.region.plan.control, [slots * ranks + slots], torch.int64).cpu().tolist()
            except Exception as exc:  # noqa: BLE001 - a diagnostic
                got["err"] = repr(exc)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(10.0)
        if "v" not in got:
            self.write(f"buf{buf.ordinal}: counters not read ({got.get('err', 'the copy did not finish in 10s')})")
            return
        v, R = got["v"], rt.num_ranks
        names = P.SLOT_NAMES
        for s in range(6):
            self.write(f"buf{buf.ordinal}: counters '{names.get(s, s)}': from ranks {v[s * ranks:s * ranks + R]}, "
                       f"completed {v[slots * ranks + s]}", progress=False)


def install(directory: str) -> Ledger:
    import torch.distributed as dist  # noqa: F401
    from megatron_ep.core import buffer as B
    from megatron_ep.core import protocol as P

    os.makedirs(directory, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    led = Ledger(os.path.join(directory, f"rank{rank}.log"), float(os.environ.get("MEP_LEDGER_STALL_S", "15")))
    led.write(f"rank {rank}: pid {os.getpid()}, CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset)')}")
    original = B.Buffer._call

    @contextlib.contextmanager
    def call(self, op):
        with original(self, op) as c:
            led.describe_buffer(self)
            led.write(f"buf{self.ordinal} #{c.seq} {op} begin")
            try:
                yield c
            except BaseException as exc:
                led.write(f"buf{self.ordinal} #{c.seq} {op} raised {type(exc).__name__}: {exc}")
                led.counters(self)
                raise
            sig = " ".join(f"{n}={v}" for n, v in zip(P.SIG_FIELDS, c.sig) if v and n not in ("buffer", "op", "seq"))
            led.write(f"buf{self.ordinal} #{c.seq} {op} end {sig}")

    B.Buffer._call = call
    return led


def main() -> int:
    directory = os.environ.get("MEP_CALL_LEDGER")
    led = install(directory) if directory else None
    import megatron_lm_virtual

    try:
        if led is not None:  # CUDA starts in the harness: the mode is known once it runs
            import torch

            real = torch.cuda.set_device

            def set_device(*args, **kwargs):
                real(*args, **kwargs)
                led.write(f"CUDA started: module loading {_loading_mode()}")

            torch.cuda.set_device = set_device
        return megatron_lm_virtual.main()
    except BaseException as exc:
        if led is not None:
            led.write(f"exit: {type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())
