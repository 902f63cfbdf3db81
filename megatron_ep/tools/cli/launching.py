"""Local ranks with torchrun's environment (megatron_ep.tools.cli)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence, Tuple

from .failures import _ERRORS_ENV

def free_port() -> int:
    """A TCP port free on this host now (a rendezvous for local processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_failure(procs: Sequence[subprocess.Popen], grace_s: float, poll_s: float = 0.05) -> Optional[Tuple[int, int]]:
    """Wait until every process ended, or until `grace_s` after the first one failed; return
    (index, exit status) of the first that failed, or None. Stopping the rest is the caller's."""
    first, deadline = None, None
    while True:
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c not in (None, 0) and first is None:
                first, deadline = (i, c), time.monotonic() + grace_s
        if all(c is not None for c in codes) or (deadline is not None and time.monotonic() > deadline):
            return first
        time.sleep(poll_s)


def how_it_ended(code: int) -> str:
    """A nonzero exit status in words ("was killed by signal SIGKILL", "exited with status 2")."""
    return f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def _package_root() -> str:
    """The directory holding the megatron_ep package (read from the package, not from where this
    file sits in it)."""
    import megatron_ep

    return os.path.dirname(os.path.dirname(os.path.abspath(megatron_ep.__file__)))


def launch(nprocs: int, cmd: Sequence[str], *, prog: str, grace_s: float = 5.0) -> int:
    """Run `cmd` as `nprocs` local ranks (torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set). When a rank
    fails, the others get `grace_s` to finish, then SIGTERM; the first failure's one line is
    printed here (without a rank when every failing rank said the same). Returns the first
    failing rank's exit status, else 0."""
    port = free_port()
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
        try:
            first = first_failure(procs, grace_s)
        except KeyboardInterrupt:
            stop(procs, signal.SIGINT)
            return 130
        stop(procs)  # the ranks still running past the grace (a no-op for ended ones)
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
            line = f"{prog}: error: rank {rank} {how_it_ended(code)} without a message"
        if line:
            print(line, file=sys.stderr, flush=True)
        return code if code > 0 else 1


def stop(procs: Sequence[subprocess.Popen], sig=signal.SIGTERM, wait_s: float = 5.0, groups: bool = False) -> None:
    """Signal each process still running, give them `wait_s` together, then kill. `groups`: the
    processes were started with start_new_session=True and their process groups (what they
    spawned too) are signalled and killed, whether or not the leader still runs."""
    def send(p, s):
        try:
            if groups:
                os.killpg(p.pid, s)
            elif p.poll() is None:
                p.send_signal(s)
        except (ProcessLookupError, PermissionError):
            pass

    for p in procs:
        send(p, sig)
    end = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if groups or p.poll() is None:
            send(p, signal.SIGKILL)
        p.wait()
