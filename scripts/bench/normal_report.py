"""The normal path's report: the console tables (per SM count: ours, DeepEP, phases, the model
check, traces; the NCCL table; the baseline checks), the markdown table for docs/performance.md,
and the --markdown / --json files."""

from __future__ import annotations

import datetime
import os
import shlex
import sys

import torch

from bench import deepep, harness
from bench.harness import mean_over_ranks
from bench.model_check import model_check
from bench.report import git_revision, md_line, md_rule, write_json, write_markdown


def machine_line(args, cuda) -> str:
    R = args.ranks
    if not cuda:
        return (f"CPU smoke run: {os.cpu_count()} cores, {R} processes, gloo, torch reference backend; "
                f"torch {torch.__version__}")
    used, visible = harness.gpus_used(R), torch.cuda.device_count()
    per_gpu = harness.ranks_per_gpu(R)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        nccl = "?"
    share = "one process per GPU" if per_gpu == 1 else \
        f"{per_gpu} processes per GPU (virtual ranks, {'under MPS' if harness.mps_running() else 'MPS control pipe NOT found'})"
    return (f"{used} x {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"{visible} visible), {R} processes, {share}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"NCCL {nccl}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")


def _code_revision() -> str:
    rev = git_revision(harness.REPO)
    if rev is None:
        return "unknown (no git metadata)"
    return rev[0] + (" + local changes" if rev[1] else "")


OUR_ROWS = [  # (key, bytes per row, peer key for the ratio)
    ("layout", None, "deepep_layout"),
    ("dispatch", "bf16", "deepep_dispatch"),
    ("dispatch_cached", "bf16", "deepep_dispatch_cached"),
    ("dispatch_fp8_cached", "fp8", "deepep_dispatch_fp8_cached"),
    ("dispatch_expert", "bf16", "deepep_dispatch_plus_permute"),
    ("dispatch_expert_cached", "bf16", "deepep_dispatch_cached_plus_permute"),
    ("dispatch_expert_fp8_cached", "fp8", "deepep_dispatch_fp8_cached_plus_permute"),
    ("combine", "bf16", "deepep_combine"),
    ("combine_zero_copy", "bf16", "deepep_combine"),
    ("combine_expert", "bf16", "deepep_unpermute_plus_combine"),
    ("combine_expert_zero_copy", "bf16", "deepep_unpermute_plus_combine"),
    ("notify_kernel", None, None),
    ("notify_kernel_T0", None, None),
]
DEEPEP_ROWS = [("deepep_layout", None), ("deepep_dispatch", "bf16"), ("deepep_dispatch_plus_permute", "bf16"),
               ("deepep_dispatch_cached", "bf16"), ("deepep_dispatch_fp8_cached", "fp8"),
               ("deepep_dispatch_cached_plus_permute", "bf16"), ("deepep_dispatch_fp8_cached_plus_permute", "fp8"),
               ("deepep_combine", "bf16"), ("deepep_unpermute_plus_combine", "bf16")]
NCCL_ROWS = [  # (key, rows kind, bytes per row)
    ("meg_meta", None, None), ("meg_dispatch", "megatron", "bf16"), ("meg_dispatch_cached", "megatron", "bf16"),
    ("meg_dispatch_fp8_cached", "megatron", "fp8"), ("meg_combine", "megatron", "bf16"),
    ("meg_a2a", "megatron", "bf16"), ("meg_a2a_fp8", "megatron", "fp8"),
    ("rm_dispatch", "rank_major", "bf16"), ("rm_dispatch_cached", "rank_major", "bf16"),
    ("rm_dispatch_fp8_cached", "rank_major", "fp8"), ("rm_combine", "rank_major", "bf16"),
    ("rm_a2a", "rank_major", "bf16"), ("rm_a2a_fp8", "rank_major", "fp8"),
]
# markdown rows: (label, ours key, DeepEP key, NCCL key)
MD_ROWS = [
    ("layout kernel", "layout", "deepep_layout", None),
    ("notify kernel alone (count exchange + positions) [1]", "notify_kernel", None, "meg_meta"),
    ("dispatch incl. notify, rank-major [2]", "dispatch", "deepep_dispatch", "rm_dispatch"),
    ("cached dispatch, rank-major", "dispatch_cached", "deepep_dispatch_cached", "rm_dispatch_cached"),
    ("FP8 cached dispatch, rank-major", "dispatch_fp8_cached", "deepep_dispatch_fp8_cached", "rm_dispatch_fp8_cached"),
    ("expert-major dispatch incl. notify [3]", "dispatch_expert", "deepep_dispatch_plus_permute", "meg_dispatch"),
    ("expert-major cached dispatch (ours: fused permute) [3]", "dispatch_expert_cached",
     "deepep_dispatch_cached_plus_permute", "meg_dispatch_cached"),
    ("FP8 expert-major cached dispatch [3]", "dispatch_expert_fp8_cached", "deepep_dispatch_fp8_cached_plus_permute",
     "meg_dispatch_fp8_cached"),
    ("combine, rank-major, staged input", "combine", "deepep_combine", "rm_combine"),
    ("combine, rank-major, zero-copy input", "combine_zero_copy", "deepep_combine", "rm_combine"),
    ("expert-major combine, staged input [4]", "combine_expert", "deepep_unpermute_plus_combine", "meg_combine"),
    ("expert-major combine, zero-copy input [4]", "combine_expert_zero_copy", "deepep_unpermute_plus_combine",
     "meg_combine"),
    ("all_to_all_single alone, Megatron rows, bf16 [5]", None, None, "meg_a2a"),
    ("all_to_all_single alone, Megatron rows, FP8 bytes [5]", None, None, "meg_a2a_fp8"),
    ("all_to_all_single alone, rank-major rows, bf16 [5]", None, None, "rm_a2a"),
    ("all_to_all_single alone, rank-major rows, FP8 bytes [5]", None, None, "rm_a2a_fp8"),
]


def report(args, allres):
    R = args.ranks
    r0 = allres[0]
    rows_mean = lambda get: sum(get(r) for r in allres) / R  # noqa: E731
    row_bytes = {"bf16": r0["bytes_row_bf16"], "fp8": r0["bytes_row_fp8"], None: None}
    print(f"\nscripts/bench normal: {R} ranks x {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}, "
          f"alignment {args.alignment}; median of {args.iters} isolated calls / mean of {args.iters} back to back")
    print(f"  machine: {r0['machine']}")
    if r0.get("deepep_error"):
        print(f"  DeepEP not measured: {r0['deepep_error']}")
    else:
        print(f"  DeepEP: {r0.get('deepep_label')}")
    base = {k: mean_over_ranks(allres, lambda r, k=k: r["base"].get(k)) for k in ("copy", "permute")}
    ref_key = next((str(n) for n in args.num_sms if not r0["sms"][str(n)]["skipped"]), None)  # the SM sweep's calibration
    for n in args.num_sms:
        key = str(n)
        if r0["sms"][key]["skipped"]:
            print(f"\n--num-sms {n}: skipped: {r0['sms'][key]['skipped']}")
            continue
        get = lambda k: mean_over_ranks(allres, lambda r: r["sms"][key]["t"].get(k))  # noqa: E731
        N = rows_mean(lambda r: r["sms"][key]["rows_rank_major"])
        M = rows_mean(lambda r: r["sms"][key]["rows_expert_major"])
        dskip = r0["sms"][key].get("deepep_skipped")
        ours_sms = r0["sms"][key]["num_sms"]
        print(f"\n  ours: {r0['sms'][key].get('path')}")
        if r0["sms"][key].get("rdma_rows_sent") is not None:
            rd = rows_mean(lambda r: r["sms"][key]["rdma_rows_sent"])
            print(f"  RDMA domain: {rd:.0f} rows sent per rank ((token, node) pairs, own node included): "
                  f"{rd * row_bytes['bf16'] / 1e6:.1f} MB bf16; NVLink stage rows as in the table below")
        print(f"\n--num-sms {n}: ours {ours_sms if ours_sms is not None else 'n/a (no SM knob)'} SMs/rank, DeepEP "
              f"{'not measured' if (r0.get('deepep_error') or dskip) else (n or deepep.DEFAULT_SMS)}"
              f"{' (' + dskip + ')' if dskip else ''}; rows/rank rank-major {N:.0f}, expert-major {M:.0f}")
        print(f"{'operation':<42}{'us':>9}{'us loop':>9}{'us max':>9}{'GB/s':>7}{'vs copy':>9}{'vs DeepEP':>10}{'(loop)':>8}")
        copy = base["copy"]
        for name, bkind, peer in OUR_ROWS + [(k, b, None) for k, b in DEEPEP_ROWS]:
            v = get(name)
            if v is None:
                if not name.startswith("deepep") or get("deepep_dispatch") is not None:
                    print(f"{name:<42}{'n/a':>9}")
                continue
            iso, loop, mx, _ = v
            gbs = f"{N * row_bytes[bkind] / loop / 1e3:>7.0f}" if bkind else f"{'':>7}"
            vs_copy = f"{loop / copy[1]:>8.2f}x" if (copy and bkind) else f"{'':>9}"
            p = get(peer) if peer else None
            ratio = f" {iso / p[0]:>9.2f}x{loop / p[1]:>7.2f}x" if p else ""
            print(f"{name:<42}{iso:>9.1f}{loop:>9.1f}{mx:>9.1f}{gbs}{vs_copy}{ratio}")
        for pkey in ("dispatch", "dispatch_cached", "dispatch_fp8_cached", "dispatch_expert_cached",
                     "dispatch_expert_fp8_cached", "combine", "combine_expert"):
            per = [r["sms"][key]["phases"].get(pkey) for r in allres]
            if any(p is None for p in per):
                print(f"  phases {pkey:<26} n/a")
                continue
            names = per[0].keys()
            print(f"  phases {pkey:<26} " + "  ".join(f"{nm} {sum(p.get(nm, 0) for p in per) / R:.0f}" for nm in names) + " us")
        if args.ranks_per_node:
            print(model_check(args, allres, key, row_bytes["bf16"], ref_key))
        gb = [r["sms"][key].get("gpu_bound") for r in allres]
        if all(gb):
            print("  GPU-bound (host queued ahead behind a sleep kernel): " + "; ".join(
                f"{k} {sum(g[k] for g in gb) / R:.1f} us" for k in gb[0]))
        prof = r0["sms"][key].get("profile") or {}
        for op, pr in prof.items():  # rank 0's trace
            ks = sorted(pr["kernels"].items(), key=lambda kv: -kv[1][0])
            print(f"  trace {op:<25} host {pr['host_us_per_call']:.0f} us/call; GPU: " +
                  "; ".join(f"{k} {v[0]:.1f} us x{v[1]:.0f}" for k, v in ks[:6]))
    for k, v in base.items():
        if v is not None:
            print(f"baseline {k:<33}{v[0]:>9.1f}{v[1]:>9.1f}{v[2]:>9.1f}")

    nstat = r0["nccl"]["status"]
    print(f"\nNCCL baselines ({nstat}; NCCL has no SM knob, so measured once)")
    if r0["nccl"]["t"]:
        print(f"  Megatron ops: {r0['nccl']['megatron_ops']}")
        nrows = {kind: rows_mean(lambda r, kind=kind: r["nccl"]["rows"][kind]) for kind in ("megatron", "rank_major")}
        print(f"  rows received per rank: Megatron (one per token-expert pair) {nrows['megatron']:.0f}, "
              f"rank-major (one per token-rank pair) {nrows['rank_major']:.0f}")
        print(f"{'operation':<42}{'us':>9}{'us loop':>9}{'us max':>9}{'GB/s':>7}")
        for name, kind, bkind in NCCL_ROWS:
            v = mean_over_ranks(allres, lambda r, name=name: r["nccl"]["t"].get(name))
            if v is None:
                print(f"{name:<42}{'n/a':>9}")
                continue
            gbs = f"{nrows[kind] * row_bytes[bkind] / v[1] / 1e3:>7.0f}" if kind else ""
            print(f"{name:<42}{v[0]:>9.1f}{v[1]:>9.1f}{v[2]:>9.1f}{gbs}")
        checks = [r["nccl"]["checks"] for r in allres]
        if checks[0]:
            eq = lambda k: "yes" if all(c[k] for c in checks) else "NO"  # noqa: E731
            mx = lambda k: max(c[k] for c in checks)  # noqa: E731
            print(f"  checks (all ranks): rank-major rows == ours: {eq('rank_major_rows_equal_ours')}; Megatron rows == "
                  f"ours expert-major without pad rows: {eq('megatron_rows_equal_ours_expert_major')}; combine max rel. "
                  f"diff vs ours: rank-major {mx('rank_major_combine_max_rel_diff'):.1e}, Megatron "
                  f"{mx('megatron_combine_max_rel_diff'):.1e} (bf16 scatter_add_)")
    else:
        print(f"  {nstat}")

    md = markdown(args, allres, base)
    print("\n" + md)
    write_markdown(args.markdown, md)
    write_json(args.json, {"args": vars(args), "command": _command(), "ranks": allres})


def _command() -> str:
    return shlex.join(["python3"] + sys.argv)


def markdown(args, allres, base) -> str:
    R, r0 = args.ranks, allres[0]
    nstat = r0["nccl"]["status"]
    have_nccl = bool(r0["nccl"]["t"])
    sms = [n for n in args.num_sms if not r0["sms"][str(n)]["skipped"]]

    def ours(n, k):
        return mean_over_ranks(allres, lambda r: r["sms"][str(n)]["t"].get(k)) if k else None

    def nccl(k):
        return mean_over_ranks(allres, lambda r: r["nccl"]["t"].get(k)) if (k and have_nccl) else None

    def cell(v):
        if v is None:
            return "n/a"
        return f"{v[1]:.1f}" + ("" if v[3] else " †")

    def ratio(a, b):
        return f"{a[1] / b[1]:.2f}x" if (a is not None and b is not None) else ""

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    N = sum(r["sms"][str(sms[0])]["rows_rank_major"] for r in allres) / R if sms else float("nan")
    M = sum(r["sms"][str(sms[0])]["rows_expert_major"] for r in allres) / R if sms else float("nan")
    deepep = r0.get("deepep_error") or r0.get("deepep_label")
    lines = [
        f"### scripts/bench normal, {now}",
        "",
        f"Command: `{_command()}`",
        "",
        f"* machine: {r0['machine']}",
        f"* code: {_code_revision()}",
        "* push kernel SMs per SM count: " + ", ".join(
            f"{n} -> {r0['sms'][str(n)].get('push_sms')}" for n in sms if not r0["sms"][str(n)].get("skipped")),
        f"* shape: {R} ranks x {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts} experts "
        f"(uniform random routing), bf16 / FP8 dispatch, bf16 combine, expert alignment {args.alignment}; rows "
        f"received per rank: rank-major {N:.0f}, expert-major {M:.0f} (with padding)"
        + (f", Megatron's {sum(r['nccl']['rows']['megatron'] for r in allres) / R:.0f}" if have_nccl else ""),
        f"* DeepEP: {deepep}; NCCL: {nstat}" + (f", {r0['nccl']['megatron_ops']}" if have_nccl else ""),
        f"* µs per call and rank, mean over ranks of the mean over {args.iters} calls back to back (loop mode); "
        f"† = median of {args.iters} isolated calls (input refreshed before each call). ours/best = ours / the "
        "faster of DeepEP and NCCL. NCCL has no SM knob: one column for every SM count.",
        "",
    ]
    head = ["operation", "NCCL"]
    for n in sms:
        lab = f"{n} SMs" if n else "default SMs"
        head += [f"ours {lab}", f"DeepEP {lab}", f"ours/DeepEP {lab}", f"ours/best {lab}"]
    lines.append(md_line(head))
    lines.append(md_rule(len(head)))
    for label, ok, dk, nk in MD_ROWS:
        nv = nccl(nk)
        ncell = ("—" if nk is None else (cell(nv) if have_nccl else nstat))
        row = [label, ncell]
        for n in sms:
            o, d = ours(n, ok), ours(n, dk)
            best = min((v for v in (d, nv) if v is not None), key=lambda v: v[1], default=None)
            row += ["—" if ok is None else cell(o), "—" if dk is None else cell(d), ratio(o, d), ratio(o, best)]
        lines.append(md_line(row))
    lines += ["", "Notes:"]
    if any(r0["sms"][str(n)]["skipped"] for n in args.num_sms):
        for n in args.num_sms:
            if r0["sms"][str(n)]["skipped"]:
                lines.append(f"* --num-sms {n} skipped: {r0['sms'][str(n)]['skipped']}")
    lines += [
        "* [1] ours: the notify kernel alone (an internal hook; n/a if missing); NCCL: Megatron's preprocess "
        "(per-expert counts, count all-gather, device-to-host copy and sync).",
        "* [2] NCCL: the rank-major rows ours and DeepEP deliver (one per token and destination rank): layout, count "
        "all-to-all + host sync, index_select, all_to_all_single of rows, top-k ids and weights.",
        "* [3] ours: expert-major dispatch (permute fused, segments padded to the alignment); DeepEP: its dispatch "
        "then an index_select into expert order (the permute index built from its output where uncached); NCCL: "
        "Megatron's alltoall dispatcher (one row per token-expert pair: permute by expert, count all-gather + host "
        "sync, all_to_all_single of rows and probs, sort_chunks_by_idxs into local-expert order; cached: permute, "
        "rows, sort only). FP8: the same bytes as uint8 rows of H + H/128*4 (Megatron has no FP8 dispatch).",
        "* [4] DeepEP: a manager's unpermute (index_add_ of the expert rows into received rows) then its combine; "
        "NCCL: Megatron's combine (reverse sort_chunks_by_idxs, reverse all_to_all_single, unpermute = bf16 "
        "scatter_add_). Rank-major NCCL combine: reverse all_to_all_single, fp32 index_add_, cast to bf16.",
        "* [5] all_to_all_single of pre-permuted rows only; Megatron rows: one per token-expert pair, rank-major: one "
        "per token-rank pair.",
    ]
    copy, perm = base.get("copy"), base.get("permute")
    if copy or perm:
        lines.append(f"* same run, single-process baselines: device copy of the received rank-major bytes "
                     f"{cell(copy)} µs; index_select of them into expert order {cell(perm)} µs.")
    pool = {n: r0["sms"][str(n)].get("pool") for n in sms}
    if any(pool.values()):
        lines.append("* our output pool during each dispatch's timing (rank 0; GPU-side waits / no room, "
                     "then staged and pulled): " + "; ".join(
                         f"{n} SMs: " + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in pool[n].items())
                         for n in sms if pool[n]) + ".")
    checks = [r["nccl"]["checks"] for r in allres]
    if checks[0]:
        ok = all(c["rank_major_rows_equal_ours"] and c["megatron_rows_equal_ours_expert_major"] for c in checks)
        lines.append(f"* baseline checks, all ranks: NCCL rank-major rows and Megatron's rows "
                     f"{'equal' if ok else 'DIFFER FROM'} ours bit for bit; combine max rel. diff vs ours "
                     f"{max(c['rank_major_combine_max_rel_diff'] for c in checks):.1e} (rank-major), "
                     f"{max(c['megatron_combine_max_rel_diff'] for c in checks):.1e} (Megatron, bf16 accumulation).")
    return "\n".join(lines)
