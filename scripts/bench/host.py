"""The host cost of every call: how long the host spends issuing one call, and one call's share of
a loop of back-to-back calls, for each implementation in its own set of processes:

  ours     megatron_ep.Buffer (the native API)
  deep_ep  megatron_ep.deep_ep (our DeepEP V1 drop-in) on our kernels
  deepep   DeepEP V1 itself, when `deep_ep` from a DeepEP build imports (never part of this
           repository; each implementation starts NVSHMEM once per process, hence the process sets)
  base     megatron_ep.Buffer from another checkout (--base DIR, its extension built there): a
           change's host cost against the code before it, in the same run

Ops, each with T tokens per rank, hidden H, top-K of E experts (uniform random routing, distinct
experts per token), bf16 rows:

  dispatch          a new routing: the layout where the API needs one, then the dispatch
  cached_dispatch   the same routing again (its handle)
  combine           back along that handle
  ll_dispatch       low-latency dispatch (FP8 cast in the call), eager
  ll_combine        low-latency combine, eager

Figures, median over --reps repetitions of --loop back-to-back calls after --warmup calls:
"issue" is host time per call until the loop's last call returns, "loop" is time per call until
the device finished them (torch.cuda.synchronize). The implementations run --rounds times, in
turn and in alternating order (ours, deep_ep, deepep, then deepep, deep_ep, ours, ...), each time
in fresh processes: the same C++ steps have taken up to 1.5x longer in one set of processes than
in the next on the same machine, so the table gives each figure's median over the rounds and
the lines below it each round's issue times. Where a call syncs the host itself (a new
routing's counts), issue and loop agree. --profile adds cProfile's top functions of one call
of each op (host time by function, after the warm-up): where the host time goes.

--ranks-per-node P below --ranks measures our two-level internode path (virtual nodes of P
ranks) for `ours`; the DeepEP API's internode path needs nodes of 8 ranks, so `deep_ep` and
`deepep` are left out there.

Only same-run ratios count: absolute host times move between runs of the same machine kind.

    python3 scripts/bench host --ranks 2                  # one GPU under MPS, or two GPUs
    python3 scripts/bench host --ranks 2 --profile 25     # with each op's top 25 functions
    python3 scripts/bench host --cpu                      # CPU: checks the script
    python3 scripts/bench host --canned                   # CPU, one process: our calls' Python alone
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Optional

# The ranks of --base's implementation import that checkout's megatron_ep: the variable is set for
# their spawn alone, and a spawned process runs this file (its main module) before anything else.
if os.environ.get("MEP_BENCH_CHECKOUT"):
    sys.path.insert(0, os.environ["MEP_BENCH_CHECKOUT"])

import torch
import torch.distributed as dist

from bench import deepep, harness, host_split
from bench.low_latency import routing, rows_of

IMPLS = ("ours", "deep_ep", "deepep", "base")
OPS = ("dispatch", "cached_dispatch", "combine", "ll_dispatch", "ll_combine")
# the low-latency calls are decode's: measured up to this many tokens per rank (their buffer is
# sized per token; DeepEP's size hint at 4096 tokens is past what its num_rdma_bytes may be)
LL_MAX_TOKENS = 256


def parse(argv=None, description=None):
    p = argparse.ArgumentParser(prog="scripts/bench host", description=description)
    p.add_argument("--ranks", type=int, default=2, help="processes (rank r on GPU r %% visible; default 2)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[128, 4096],
                   help="tokens per rank, a comma list (default 128,4096)")
    p.add_argument("--hidden", type=int, default=7168, help="default 7168")
    p.add_argument("--experts", type=int, default=256, help="default 256")
    p.add_argument("--topk", type=int, default=8, help="default 8")
    p.add_argument("--loop", type=int, default=20, help="back-to-back calls per timed repetition (default 20)")
    p.add_argument("--reps", type=int, default=15, help="repetitions; the median is reported (default 15)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--impls", default=None,
                   help=f"a comma list of {', '.join(IMPLS)} (default: all, base where --base is given)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="each op's N functions with the most host time, µs per call over 20 calls (default 0: none)")
    p.add_argument("--phases", action="store_true",
                   help="ours and deep_ep on the cuda backend: the steps of each one-crossing entry (notify_call, "
                        "dispatch_call, combine_call), µs per call over 20 calls, from the extension's own clock")
    p.add_argument("--kernels", action="store_true",
                   help="the GPU time of each kernel per call (torch.profiler), every implementation: over 20 "
                        "back-to-back calls (which kernel a loop's time waits for, a peer's lateness included), "
                        "then over 20 calls one at a time, each after a sync and a barrier (a kernel's own work)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="P",
                   help="our Buffer's ranks_per_node: below --ranks, our two-level internode path over "
                        "--ranks / P virtual nodes (ours only; default: one node)")
    p.add_argument("--no-check-inputs", dest="check_inputs", action="store_false",
                   help="ours: Buffer(check_inputs=False) (the expert-id checks cost host syncs; DeepEP has none)")
    p.add_argument("--deepep-ll", action="store_true",
                   help="DeepEP's own low-latency calls too (its NVSHMEM needs one process per GPU; off by default)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of every implementation, in alternating order, each in fresh processes; figures are "
                        "medians over them (default 2; --profile, --phases and --kernels come from the first)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per implementation (default 900)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="another checkout with its extension built (python3 setup.py build_ext --inplace there): "
                        "adds the implementation `base`, that checkout's megatron_ep.Buffer, to the run (its package laid "
                        "out as this one's: megatron_ep.core, megatron_ep.tools)")
    p.add_argument("--canned", action="store_true",
                   help="only the Python of our calls (native and megatron_ep.deep_ep), in this process on CPU, each "
                        "crossing returning a saved result (bench/host_canned.py); no GPU")
    p.add_argument("--cpu", action="store_true",
                   help="CPU processes on the torch backend at a small shape: checks the script (figures mean nothing)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    a.first_round = True  # (main sets it per round)
    default = [i for i in IMPLS if i != "base" or a.base]
    a.impls = [i for i in a.impls.split(",") if i] if a.impls is not None else default
    bad = [i for i in a.impls if i not in IMPLS]
    if bad:
        p.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    if "base" in a.impls:
        if not a.base:
            p.error("--impls base needs --base DIR (another checkout, its extension built)")
        a.base = os.path.abspath(a.base)
        if not os.path.isdir(os.path.join(a.base, "megatron_ep")):
            p.error(f"--base {a.base}: no megatron_ep package there")
        # this bench's ranks import the package by role (megatron_ep.core, megatron_ep.tools)
        if not all(os.path.isdir(os.path.join(a.base, "megatron_ep", d)) for d in ("core", "tools")):
            p.error(f"--base {a.base}: its megatron_ep is laid out before megatron_ep/core and megatron_ep/tools, "
                    "which this bench imports: take a later commit")
    P = a.ranks_per_node
    if P is not None and not (1 <= P <= a.ranks and a.ranks % P == 0):
        p.error(f"--ranks-per-node {P} must divide --ranks {a.ranks}")
    a.internode = P is not None and P < a.ranks
    if a.internode and any(i not in ("ours", "base") for i in a.impls):
        if "ours" not in a.impls:
            p.error("--ranks-per-node below --ranks measures ours only: add it to --impls")
        print(f"scripts/bench host: --ranks-per-node {P}: only ours (and base) are measured (the DeepEP API's internode "
              f"path needs nodes of 8 ranks)", flush=True)
        a.impls = [i for i in a.impls if i in ("ours", "base")]
    if a.cpu:
        a.tokens, a.hidden, a.experts, a.topk, a.loop, a.reps, a.warmup = [4, 16], 256, 16, 4, 3, 3, 1
        a.impls = [i for i in a.impls if i != "deepep"]
    return a


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_op(fn, a, device, group) -> dict:
    """{"issue": µs, "loop": µs} per call, medians over a.reps loops of a.loop calls (the ranks
    start each loop together: a barrier on the control group, outside the timing)."""
    for _ in range(a.warmup):
        fn()
    _sync(device)
    issue, loop = [], []
    for _ in range(a.reps):
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(a.loop):
            fn()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        issue.append((t1 - t0) / a.loop * 1e6)
        loop.append((t2 - t0) / a.loop * 1e6)
    return {"issue": statistics.median(issue), "loop": statistics.median(loop)}


def profile_op(fn, top: int, device, calls: int = 20) -> str:
    """cProfile of `calls` calls of `fn`: its `top` functions by cumulative time, in µs per call
    (own time and with callees)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    _sync(device)
    st = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    if not st:  # (seen once on the GPU image's Python 3.12: say what held the profiler, if anything)
        mon = getattr(sys, "monitoring", None)
        holder = mon.get_tool(mon.PROFILER_ID) if mon is not None else None
        return (f"cProfile recorded no call of {calls} (Python {sys.version.split()[0]}; sys.monitoring's "
                f"profiler slot held by {holder!r}; sys.getprofile() {sys.getprofile()!r})\n")
    out = []
    for title, key in (("by time with callees", 3), ("by own time", 2)):
        out.append(f"{title}:\n{'calls/call':>10} {'own us':>8} {'cum us':>8}  function")
        for (file, line, name), (_, n, tt, ct, _) in sorted(st.items(), key=lambda kv: -kv[1][key])[:top]:
            where = name if file == "~" else \
                f"{os.path.relpath(file) if file.startswith(os.getcwd()) else os.path.basename(file)}:{line}({name})"
            out.append(f"{n / calls:10.1f} {tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f}  {where}")
    return "\n".join(out) + "\n"


def kernels_op(fn, calls: int = 20) -> str:
    """Each kernel's GPU µs per call (torch.profiler), the longest first: over `calls` back-to-back
    calls of `fn`, with the host's µs per call of that loop (the profiler adds to it), then over
    `calls` calls one at a time (each after a sync and a barrier), where a kernel that waits for
    its peers no longer counts a peer's host time, only the ranks' start skew."""
    out = []
    for paced, title in ((False, "back to back"), (True, "one at a time")):
        got = harness.kernel_profile(fn, calls, paced=paced)
        rows = sorted(got["kernels"].items(), key=lambda kv: -kv[1][0])
        out.append(f"{title}:")
        out += [f"{us:8.1f} µs  {n:4.1f} per call  {name}" for name, (us, n) in rows]
        gpu = sum(us for us, _ in got["kernels"].values())
        host = f"the loop's host: {got['host_us_per_call']:.1f} µs per call (under the profiler)" if not paced else \
            "each call after a sync and a barrier"
        out.append(f"kernels: {gpu:.1f} µs of GPU time per call; {host}")
    return "\n".join(out) + "\n"


def phases_op(fn, buf, device, calls: int = 20) -> Optional[str]:
    """The steps of each one-crossing entry `calls` calls of `fn` made, µs per call, from the
    extension's clock (megatron_ep.tools.tracing.host_steps), and the host time of those calls outside
    it, split (bench/host_split.py) into the crossings' argument and result conversions, the
    outputs' freeing, and the rest; for calls without such entries (the low-latency calls, DeepEP's
    own Buffer) only what freeing their outputs costs; None on the CPU."""
    if device.type != "cuda":
        return None
    inner = getattr(buf, "runtime", buf)  # megatron_ep.deep_ep's Buffer: our Buffer inside

    def steps_of(loop):
        """(µs per call in the extension's steps or None, the lines per entry) of loop()."""
        from megatron_ep.tools import tracing

        if not hasattr(inner, "_backend"):
            loop()
            return None, []
        with tracing.host_steps(inner) as steps:
            loop()
        lines, inside = [], 0.0
        for entry, d in steps.items():
            n = d.pop("calls")
            inside += sum(d.values()) / calls / 1e3
            parts = ", ".join(f"{k} {v / n / 1e3:.1f}" for k, v in d.items())
            lines.append(f"{entry}: {n / calls:.1f} per call, {sum(d.values()) / n / 1e3:.1f} µs each: {parts}")
        return (inside if lines else None), lines

    t = {}

    def plain():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t["issue"] = (time.perf_counter() - t0) / calls * 1e6

    inside, out = steps_of(plain)
    _sync(device)
    outside = None
    if inside is not None:
        outside = t["issue"] - inside
        out.append(f"these calls: {t['issue']:.1f} µs of host time each, {inside:.1f} in the extension's steps, "
                   f"{outside:.1f} outside them")
    out.append(host_split.split(fn, inner, calls, lambda loop: steps_of(loop)[0], lambda: _sync(device), outside))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------- the calls
def ops_ours(a, T, device, x, idx, w):
    import megatron_ep as mep

    E = a.experts
    buf = mep.Buffer(backend="torch" if device.type == "cpu" else "cuda", check_inputs=a.check_inputs,
                     ranks_per_node=a.ranks_per_node)
    state = {}

    def dispatch():  # (the output kept until the next call's, as a training step keeps it)
        state["out"] = out = buf.dispatch(x, idx, w, num_experts=E)
        return out

    dispatch()
    h = state["out"].handle
    rows = state["out"].x.clone()
    fns = {"dispatch": dispatch,
           "cached_dispatch": lambda: buf.dispatch(x, handle=h),
           "combine": lambda: buf.combine(rows, h)}
    if T <= LL_MAX_TOKENS:
        ll = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T, use_fp8=True)
        ll_rows = rows_of(ll.x)
        fns["ll_dispatch"] = lambda: buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T, use_fp8=True)
        fns["ll_combine"] = lambda: buf.low_latency_combine(ll_rows, idx, w, ll.handle)
    fns["_buffer"] = buf
    return fns, buf.destroy


def ops_deep_ep(a, T, device, x, idx, w, module=None):
    """DeepEP V1's API: `module` is megatron_ep.deep_ep (ours) or DeepEP's own deep_ep (its
    low-latency calls only with --deepep-ll)."""
    own = module is None
    if own:
        from megatron_ep import deep_ep as module
    E, R = a.experts, dist.get_world_size()
    ll = T <= LL_MAX_TOKENS and (own or a.deepep_ll)
    rdma = module.Buffer.get_low_latency_rdma_size_hint(T, a.hidden, R, E) if ll else 0
    buf = module.Buffer(dist.group.WORLD, int(1e9), rdma, low_latency_mode=ll, num_qps_per_rank=max(1, E // R),
                        explicitly_destroy=True)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert)

    recv_x, _, _, _, handle, _ = dispatch()
    recv_x = recv_x.clone()
    fns = {"dispatch": dispatch,
           "cached_dispatch": lambda: buf.dispatch(x, handle=handle),
           "combine": lambda: buf.combine(recv_x, handle)}
    if ll:
        ll_x, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        ll_rows = rows_of(ll_x)
        fns["ll_dispatch"] = lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        fns["ll_combine"] = lambda: buf.low_latency_combine(ll_rows, idx, w, ll_handle)
    fns["_buffer"] = buf
    return fns, buf.destroy


def worker(rank, a, impl, port, queue):
    try:
        if impl == "base":  # the ranks must run --base's code, not this checkout's
            import megatron_ep

            got = os.path.dirname(os.path.dirname(os.path.abspath(megatron_ep.__file__)))
            if got != a.base:
                raise RuntimeError(f"base imported megatron_ep from {got}, not from --base {a.base}")
        device = harness.init_rank(rank, a.ranks, port, not a.cpu, cpu_threads=1)
        res = {}
        for T in a.tokens:
            x, idx, w = routing(T, a.experts, a.topk, a.hidden, 100 + rank, device)
            if impl in ("ours", "base"):  # (base: this process imported --base's megatron_ep)
                fns, close = ops_ours(a, T, device, x, idx, w)
            else:
                module = None
                if impl == "deepep":
                    module, exc = deepep.load()
                    if module is None:
                        raise exc
                fns, close = ops_deep_ep(a, T, device, x, idx, w, module)
            for op in OPS:
                if op not in fns:
                    continue
                res[(T, op)] = time_op(fns[op], a, device, dist.group.WORLD)
                if a.profile and a.first_round:  # every rank makes the call (it is collective); rank 0's profile is shown
                    text = profile_op(fns[op], a.profile, device)
                    if rank == 0:
                        res[(T, op, "profile")] = text
                text = phases_op(fns[op], fns["_buffer"], device) if a.phases and a.first_round else None
                if text and rank == 0:
                    res[(T, op, "phases")] = text
                if a.kernels and a.first_round and device.type == "cuda":  # collective, as the op is
                    text = kernels_op(fns[op])
                    if rank == 0:
                        res[(T, op, "kernels")] = text
            dist.barrier()
            close()
        queue.put((rank, res, None))
    except Exception as exc:  # noqa: BLE001 - reported by run_ranks, the other implementations go on
        import traceback

        queue.put((rank, None, f"rank {rank} ({impl}): {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def table(a, results: dict) -> str:
    """Markdown: one row per (T, op), an issue / loop column pair per implementation, rank 0's
    figures (the ranks run in step)."""
    impls = [i for i in a.impls if i in results]
    head = "| T | op | " + " | ".join(f"{i} loop (issue) µs" for i in impls) + " |"
    rows = [head, "|" + "---|" * (2 + len(impls))]
    for T in a.tokens:
        for op in OPS:
            cells = []
            for i in impls:
                r = results[i].get((T, op)) if isinstance(results[i], dict) else None
                cells.append(f"{r['loop']:.0f} ({r['issue']:.0f})" if r else "-")
            rows.append(f"| {T} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def over_rounds(runs: list) -> dict:
    """One implementation's figures from its rounds' results: each (T, op)'s issue and loop
    medians over the rounds that measured it (each round's issue times kept as "rounds"), and
    the first round's profile and phases texts."""
    out = {}
    for key in runs[0]:
        if len(key) == 3:
            out[key] = runs[0][key]
            continue
        got = [r[key] for r in runs if key in r]
        out[key] = {"issue": statistics.median(g["issue"] for g in got),
                    "loop": statistics.median(g["loop"] for g in got), "rounds": [g["issue"] for g in got]}
    return out


def _run_impl(a, impl: str):
    """One implementation's ranks (run_ranks' answer); `base`'s import --base's checkout, which
    this file puts first on their path (MEP_BENCH_CHECKOUT, set for their spawn)."""
    from unittest import mock  # (patch.dict: the environment as it was afterwards)

    with mock.patch.dict(os.environ, {"MEP_BENCH_CHECKOUT": a.base} if impl == "base" else {}):
        return harness.run_ranks(worker, a.ranks, (a, impl, harness.free_port()), a.timeout)


def main(a) -> int:
    if a.canned:
        from bench import host_canned

        print(host_canned.run())
        return 0
    if not a.cpu and not torch.cuda.is_available():
        print("scripts/bench host: no CUDA GPU here; --cpu checks the script on CPU processes (figures mean nothing)")
        return 2
    path = f"internode, {a.ranks // a.ranks_per_node} nodes of {a.ranks_per_node}" if a.internode else "one node"
    print(f"host cost per call ({path}): ranks {a.ranks}, tokens {a.tokens}, hidden {a.hidden}, top-{a.topk} of {a.experts}, "
          f"loop {a.loop} x reps {a.reps} (warm-up {a.warmup}); implementations {', '.join(a.impls)}", flush=True)
    runs, failed = {}, {}
    for r in range(a.rounds):
        a.first_round = r == 0
        for impl in (a.impls if r % 2 == 0 else a.impls[::-1]):
            if impl in failed:
                continue
            got, why = _run_impl(a, impl)
            if got is None:
                failed[impl] = why
                print(f"{impl}: not measured: {why.splitlines()[0] if why else '?'}", flush=True)
                continue
            runs.setdefault(impl, []).append(got[0])
            print(f"{impl}: measured (round {r + 1} of {a.rounds})", flush=True)
    results = {impl: over_rounds(got) for impl, got in runs.items() if impl not in failed}
    print(table(a, results))
    if a.rounds > 1:
        print("\nissue µs per round (the spread between sets of processes):")
        for impl, res in results.items():
            for (T, op), r in ((k, v) for k, v in res.items() if len(k) == 2):
                print(f"  {impl} T={T} {op}: {', '.join(f'{v:.0f}' for v in r['rounds'])}")
    for impl, res in results.items():
        for key, text in res.items():
            if len(key) == 3:
                print(f"\n--- {key[2]}: {impl}, T={key[0]}, {key[1]} ---\n{text}")
    return 1 if failed and not results else 0


if __name__ == "__main__":
    sys.exit(main(parse(description=__doc__.split("\n")[0])))
