"""What every benchmark path shares: starting the ranks (one process per GPU, or virtual ranks
sharing a GPU), timing with CUDA events (warm-up, medians, back-to-back loops), kernel times
from torch.profiler, and CUDA graphs of back-to-back calls.

Import this module before torch (the bench modules import it first): it sets the NCCL
environment the ranks inherit.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import socket
import statistics
import time

# NVLink SHARP (NVLS) multicast is unavailable on the GPU machines; NCCL must not try it. Set
# before torch loads NCCL; spawned ranks inherit it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one FP8 row: one byte per channel and one fp32 scale per 128 channels."""
    return hidden + hidden // 128 * 4


def msg_bytes(H, fp8):
    """Low-latency dispatch bytes per valid (token, expert) in DeepEP's accounting: the row (FP8
    + one fp32 scale per 128 channels, or bf16) and a 16-byte header."""
    return (fp8_row_bytes(H) if fp8 else 2 * H) + 16


# ------------------------------------------------------------------------------ processes
def free_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, args: tuple, nprocs: int) -> None:
    """worker(rank, *args) in `nprocs` spawned processes; returns when all have ended, raises
    when one failed."""
    mp.spawn(worker, args=args, nprocs=nprocs, join=True)


def run_ranks(target, nranks: int, args: tuple, timeout: float):
    """target(rank, *args, queue) in `nranks` spawned processes, each putting one (rank, result,
    error or None) on the queue. Returns ([result per rank, by rank], None), or (None, why): the
    first rank's error, a worker that died (a crashed baseline ends the wait at once), or the
    timeout (then every worker is killed)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(nranks)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(queue.get(timeout=5))
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                return None, f"worker exit codes {[p.exitcode for p in procs]}" if dead else f"timed out after {timeout:.0f}s"
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    errors = [e for _, _, e in got if e]
    if errors:
        return None, errors[0]
    return [res for _, res, _ in sorted(got, key=lambda g: g[0])], None


def init_rank(rank: int, world: int, port: int, cuda: bool, *, rank_env: bool = False, cpu_threads=None):
    """This process as rank `rank` of `world`: the rendezvous address (and RANK / WORLD_SIZE with
    `rank_env`), GPU rank % visible GPUs on CUDA (`cpu_threads` torch threads otherwise), and a
    gloo process group: the control group (barriers, handle exchange; the kernels move the
    data). Returns the device."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank_env:
        env.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(env)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        dev = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dev


def gpus_used(ranks: int) -> int:
    """GPUs the ranks run on (rank r on GPU r % visible)."""
    return min(ranks, torch.cuda.device_count())


def ranks_per_gpu(ranks: int) -> int:
    return math.ceil(ranks / gpus_used(ranks))


def mps_running() -> bool:
    """Whether an MPS control daemon answers (virtual ranks need it, docs/design.md §5)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


# --------------------------------------------------------------------------------- timing
class Timer:
    """(isolated median, loop mean, loop measured) in us for one op; CUDA events on GPUs,
    perf_counter in a CPU smoke run. Isolated: the median of `iters` calls after `warmup`, all
    ranks released together by a barrier before each; loop: the mean of `iters` calls back to
    back (the ops' own handshakes keep the ranks in step)."""

    def __init__(self, args, cuda: bool):
        self.args, self.cuda = args, cuda

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    def __call__(self, fn, setup=None):
        iso = self.isolated(fn, setup)
        if setup is not None:  # ops whose input must be refreshed each call: isolated only
            return (iso, iso, False)
        self.sync()
        dist.barrier()
        a = self.mark()
        for _ in range(self.args.iters):
            fn()
        b = self.mark()
        self.sync()
        return (iso, self.us(a, b) / self.args.iters, True)

    def isolated(self, fn, setup=None):
        times = []
        for i in range(self.args.warmup + self.args.iters):
            if setup is not None:
                setup()
            self.sync()
            dist.barrier()
            a = self.mark()
            fn()
            b = self.mark()
            self.sync()
            if i >= self.args.warmup:
                times.append(self.us(a, b))
        return statistics.median(times)


def mean_over_ranks(allres, get):
    """Timer figures over ranks: (mean isolated, mean loop, max isolated, every loop measured),
    or None if any rank lacks it (`get(rank's results)`)."""
    vals = [get(r) for r in allres]
    if any(v is None for v in vals):
        return None
    R = len(vals)
    return (sum(v[0] for v in vals) / R, sum(v[1] for v in vals) / R, max(v[0] for v in vals), all(v[2] for v in vals))


def median_us(fn, reps, warmup):
    """Median over `reps` of one call of fn (which itself may run a loop of calls or replay a
    graph), in us: CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def gpu_bound(fn, n=25):
    """µs per call of `fn` when the GPU, not the host, sets the pace: a sleep kernel holds the
    stream while the host queues n calls, which then run back to back (ranks start together,
    so a handshake waits for the peer's kernel, not for the peer's host)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(20_000_000)  # ~10 ms at ~2 GHz: longer than queueing n calls
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def graph_of(fn, loop):
    """A CUDA graph of `loop` back-to-back fn() calls (warmed up eagerly first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(loop):
            fn()
    return g


# ------------------------------------------------------------------------- kernel times
def kernel_profile(fn, iters, paced=False):
    """Per-kernel trace of `fn` called back to back (torch.profiler, CUPTI): GPU µs per call of
    each kernel, and the host's µs per call (wall time of the loop without a sync inside: where
    the host is slower than the GPU, this is what a loop of calls costs). A kernel that waits for
    its peers counts their lateness too; `paced` starts every call after a sync and a barrier,
    so each kernel's time is its own work plus the ranks' start skew at the barrier (the host
    figure then includes both)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # inside: the profiler's start takes a different time on each rank
        t0 = time.perf_counter()
        for _ in range(iters):
            if paced:
                torch.cuda.synchronize()
                dist.barrier()
            fn()
        host = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.count:
            total = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            kernels[e.key[:60]] = (total / iters, e.count / iters)
    dist.barrier()
    return {"host_us_per_call": host, "kernels": kernels}


def union_us(intervals) -> list:
    """[start, end) intervals merged into disjoint ones, in order."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def overlap_us(a, b) -> float:
    """Length of the intersection of two interval sets (each merged first)."""
    a, b = union_us(a), union_us(b)
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return total


def kernel_streams(fn, ours=("mep::",)) -> dict:
    """One fn() under torch.profiler (CUPTI), its kernels sorted by stream: for our kernels (names
    containing one of `ours`) and for every other kernel, the busy time (µs, the union of their
    intervals), and how much of our kernels' busy time ran while another kernel was running on
    another stream: whether communication and computation shared the GPU, or took turns."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    is_ours = [any(o in e.get("name", "") for o in ours) for e in kernels]
    span = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    stream = [e.get("args", {}).get("stream") for e in kernels]
    mine_streams = {s for s, o in zip(stream, is_ours) if o}
    mine = [t for t, o in zip(span, is_ours) if o]
    other = [t for t, o, s in zip(span, is_ours, stream) if not o and s not in mine_streams]
    ours_busy = sum(e - s for s, e in union_us(mine))
    return {"ours_us": ours_busy, "other_us": sum(e - s for s, e in union_us(other)),
            "beside_us": overlap_us(mine, other), "kernels": len(kernels)}


def kernel_trace(fn, iters):
    """(name, GPU µs) of every kernel of `iters` eager fn() calls, in launch order (torch.profiler,
    CUPTI): DeepEP's accounting (kernel time, no launch gaps or host work)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in ev]


def kernel_figures(d, c, hook, iters):
    """Median kernel µs: dispatch and combine alone, and the hook's send and receive halves (the
    kernels of a hook call alternate send, receive per direction)."""
    def med(trace, word, part=None):
        us = [t for n, t in trace if word in n.lower()]
        us = us if part is None else us[part::2]
        return statistics.median(us) if us else 0.0

    td, tc, th = kernel_trace(d, iters), kernel_trace(c, iters), kernel_trace(hook, iters)
    return {"k_dispatch": med(td, "dispatch"), "k_combine": med(tc, "combine"),
            "k_d_send": med(th, "dispatch", 0), "k_d_recv": med(th, "dispatch", 1),
            "k_c_send": med(th, "combine", 0), "k_c_recv": med(th, "combine", 1)}
