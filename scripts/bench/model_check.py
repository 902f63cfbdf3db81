"""The normal path's model check (--ranks-per-node): megatron_ep.tools.model's exact per-link bytes of
the run's routing against the bench's own counts (a disagreement is a bug: the run fails), and
a time check: per-SM rates calibrated on one measured op per direction predict the others."""

from __future__ import annotations

import dataclasses

from megatron_ep.tools import model as MODEL

from bench.harness import fp8_row_bytes, mean_over_ranks


def model_check(args, allres, key, row_bytes, ref_key=None) -> str:
    """The "model check" block (--ranks-per-node): megatron_ep.tools.model's exact per-link bytes of
    this run's routing against the bench's own counts, and the time check (`_model_times`):
    rates calibrated on one measured op per direction predict the others; those of SM count
    `ref_key` predict this one. Raises after printing when an exact count disagrees (a bug, not
    a measurement); a time outside 25% is printed as OUTSIDE."""
    R, P = args.ranks, args.ranks_per_node
    sms_out = [r["sms"][key] for r in allres]
    lc = None
    for o in sms_out:
        c = MODEL.LinkCount(R, P, row_bytes, *[o["links"][f] for f in MODEL.LINK_FIELDS])
        lc = c if lc is None else lc + c
    mb = lambda v: f"{v / 1e6:.2f} MB"  # noqa: E731
    lines = [f"  model check (megatron_ep.tools.model, {R // P} nodes x {P} ranks, bf16 rows of {row_bytes} B; per rank "
             f"mean [min, max]):"]

    def span(vals):
        return f"{mb(sum(vals) / R)} [{mb(min(vals))}, {mb(max(vals))}]"

    lines.append(f"    exact, link_count of this run's routing: RDMA domain sent {span(lc.rdma_bytes)}; DeepEP RDMA "
                 f"accounting (incl. own node) {span(lc.deepep_rdma_bytes)}; NVLink forwarded {span(lc.nvlink_bytes)}; "
                 f"rank-major rows received {span(lc.bytes('recv_rows'))}")
    bad = []
    bench_rows = [o.get("rdma_rows_sent") for o in sms_out]
    if all(v is not None for v in bench_rows):
        same = bench_rows == lc.deepep_rdma
        lines.append(f"    bench's own RDMA count x row bytes {span([v * row_bytes for v in bench_rows])}: "
                     f"{'equal on every rank' if same else 'DIFFERS'}")
        bad += [] if same else [f"RDMA rows: bench {bench_rows} vs model {lc.deepep_rdma}"]
    delivered = [o["rows_rank_major"] for o in sms_out]
    same = delivered == lc.recv_rows
    lines.append(f"    rank-major rows our path delivered: {'equal to the count on every rank' if same else 'DIFFER'}")
    bad += [] if same else [f"delivered rows {delivered} vs model {lc.recv_rows}"]
    if P == R:
        lines.append("    one node: no RDMA domain, no timing check (pass --ranks-per-node below --ranks)")
    else:
        lines += _model_times(args, allres, key, ref_key, lc)
    text = "\n".join(lines)
    if bad:
        print(text)
        raise AssertionError("scripts/bench normal, model check: exact counts disagree: " + "; ".join(bad))
    return text


def _phase_means(allres, key, op):
    """{mark: loop µs, mean over ranks} of `op`'s phase marks at SM count `key`, or None (not
    traced: torch backend, or the internal hook is missing)."""
    per = [r["sms"].get(key, {}).get("phases", {}).get(op) for r in allres]
    if any(not p for p in per):
        return None
    loops = [{k[:-len("(loop)")]: v for k, v in p.items() if k.endswith("(loop)")} for p in per]
    if not all(loops):
        return None
    names = list(dict.fromkeys(k for lp in loops for k in lp))
    return {k: sum(lp.get(k, 0.0) for lp in loops) / len(loops) for k in names}


def _stages_text(t, sep=" + ") -> str:
    return sep.join(f"{MODEL.STAGE_NAMES[s]} {t.of(s):.1f}" for s in MODEL.STAGES if t.of(s) or s != "fixed")


def _check_lines(chk, note="") -> list:
    """A prediction against the measured call (the verdict) and, when traced, its phases."""
    p = chk.predicted
    fixed = " (measured, no model term)" if p.fixed_us else ""
    out = [f"      {chk.name}{note}: predicted {_stages_text(p)}{fixed} = {p.total_us:.1f} vs measured "
           f"{chk.call_us:.1f} per call: {chk.ratio:.2f} ({MODEL.verdict(chk.ratio)})"]
    if chk.measured is None:
        out.append("        per phase: n/a (this op's phases not traced)")
        return out
    m = chk.measured
    ratios = ", ".join(f"{MODEL.STAGE_NAMES[s]} {chk.stage_ratio(s):.2f}" + ("" if MODEL.within(chk.stage_ratio(s))
                                                                             else " OUTSIDE")
                       for s in MODEL.STAGES if s != "fixed" and chk.stage_ratio(s) is not None)
    out.append(f"        measured phases {_stages_text(m, ', ')} (sum {m.total_us:.1f}: predicted/sum "
               f"{p.total_us / m.total_us:.2f}; {chk.outside_marks_us:.1f} of the call outside the marks); "
               f"predicted/measured per phase: {ratios}")
    return out


def _model_times(args, allres, key, ref_key, lc) -> list:
    """The time check: per-SM rates of the RDMA hop, the intranode stage and the local work
    calibrated on ONE measured operation per direction (its phase marks) predict the others
    from this run's exact rows (megatron_ep.tools.model's stages); rates calibrated at the first SM
    count predict the others; the SM split if the two copy stages ran at once."""
    R, H = len(allres), args.hidden
    bf16, fp8 = 2 * H, fp8_row_bytes(H)
    rows = sum(lc.recv_rows) / R  # the intranode stage delivers the rank-major rows (own ones included)
    pairs = sum(lc.deepep_rdma) / R  # what the RDMA-domain kernels handle (the own node's copy local)
    erows = sum(r["sms"][key]["rows_expert_major"] for r in allres) / R

    def sizes(k):
        o = allres[0]["sms"][k]
        return o.get("num_sms"), (o.get("rdma_blocks") or o.get("num_sms")), bool(o.get("rdma_blocks"))

    def call(op, k=key):
        v = mean_over_ranks(allres, lambda r: r["sms"][k]["t"].get(op))
        return v[1] if v else None

    sms, blocks, known = sizes(key)
    if not sms:
        return ["    times: n/a (no SM count: torch backend, no phase marks; tests/tools/test_model.py checks the time check "
                "on recorded GPU figures)"]
    out = [f"    times (µs per call and rank, loop mode, mean over ranks; megatron_ep.tools.model's stages): RDMA hop on "
           f"{blocks} blocks{'' if known else ' (assumed = SMs: internal hook n/a)'}, intranode stage on {sms} SMs, local "
           f"work (fan-out) on the rank's GPU share; rates calibrated on ONE op per direction, the rest predicted "
           f"from this run's rows x row bytes"]
    checks, rates_of = [], {}
    # code that reordered after the intranode stage (a "reorder" mark) had local work on every op
    ph0 = _phase_means(allres, key, "dispatch_cached") or {}
    reorder = "reorder" in ph0
    if reorder:
        out.append("    (the measured path reorders after its intranode stage: a 'reorder' phase; modelled as local work)")
    dw = lambda row, sk=sms, bk=blocks, **kw: MODEL.dispatch_stage_work(pairs, rows, row, bk, sk, reorder=reorder, **kw)  # noqa: E731
    cw = lambda sk=sms, bk=blocks, **kw: MODEL.combine_stage_work(pairs, rows, H, bk, sk, reorder=reorder, **kw)  # noqa: E731

    def measured(op, k=key):
        ph = _phase_means(allres, k, op)
        return None if ph is None else MODEL.phase_stages(ph)

    def with_local(rates, op, work, k=key):
        """The rates, with a local rate from `op`'s own local phase where the calibrating op had none
        (its local work is then measured, not predicted)."""
        if rates.local_gbps is not None or work is None or work.local_bytes == 0:
            return rates, ""
        m = measured(op, k)
        if m is None or m.local_us <= 0:
            return None, ""
        return (dataclasses.replace(rates, local_gbps=MODEL.gbps_of(work.local_bytes, m.local_us * 1e-6)),
                "; its local rate from its own fan-out phase")

    def calibrate(label, op, what, work, unit_rows):
        m, c = measured(op), call(op)
        if m is None or c is None:
            out.append(f"    {label}: n/a (no phase marks of the {what}: the internal hook is missing)")
            return None
        try:
            r = MODEL.calibrate_stages(work, m)
        except ValueError as exc:  # a stage without a mark
            out.append(f"    {label}: n/a ({exc})")
            return None
        rates_of[op] = r
        out.append(f"    {label}: calibrated on the {what} (its phases {_stages_text(m, ', ')}; call "
                   f"{c:.1f}): RDMA hop {r.rdma_per_sm:.1f} GB/s per block ((token, node) pairs x {unit_rows} B), "
                   f"intranode stage {r.node_per_sm:.1f} GB/s per SM (rank-major rows x {unit_rows} B), local "
                   + (f"{r.local_gbps:.0f} GB/s (bytes read + written)" if r.local_gbps is not None
                      else "none (no local work)"))
        return r

    def predict(name, op, work, rates, note="", k=key):
        c = call(op, k)
        rates, how = with_local(rates, op, work, k)
        if c is None or work is None or rates is None:
            out.append(f"      {name}: n/a (not measured{'' if rates is not None else ', or no local phase'})")
            return
        note += how
        chk = MODEL.check_stages(name, work, rates, c, measured(op, k))
        checks.append(chk)
        out.extend(_check_lines(chk, note))

    rd = calibrate("dispatch", "dispatch_cached", "bf16 cached rank-major dispatch", dw(bf16), bf16)
    if rd is not None:
        notify = measured("dispatch")
        predict("FP8 cached, rank-major", "dispatch_fp8_cached", dw(fp8), rd, f" (same rows, {fp8} B)")
        predict("incl. notify, rank-major", "dispatch", dw(bf16, fixed_us=notify.fixed_us) if notify else None, rd,
                " (the first call also " + ("sorts the order keys and " if reorder else "") + "syncs with the host: "
                "no model term)")
        predict("cached, expert-major", "dispatch_expert_cached", dw(bf16, expert_rows=erows), rd,
                f" (fan-out{' + reorder' if reorder else ''} of {erows:.0f} rows)")
        predict("FP8 cached, expert-major", "dispatch_expert_fp8_cached", dw(fp8, expert_rows=erows), rd)
    rc = calibrate("combine", "combine", "bf16 rank-major combine", cw(), bf16)
    if rc is not None:
        em = _phase_means(allres, key, "combine_expert")
        partials = em is None or "reduce" in em
        predict("expert-major", "combine_expert", cw(expert_rows=erows, partials=partials), rc,
                (" (reorder of the expert rows; " if reorder else " (") + ("fp32 partials cross the intranode stage)"
                                                                           if partials else "every expert row crosses the intranode stage)"))
    if ref_key is not None and ref_key != key:
        rsms, rblocks, _ = sizes(ref_key)
        out.append(f"    SM sweep: rates calibrated at {rsms} SMs ({rblocks} blocks) predict {sms} SMs ({blocks} blocks); "
                   f"the local work does not scale with the SMs")
        for label, op, wref, wnow in (("cached dispatch, rank-major", "dispatch_cached", dw(bf16, rsms, rblocks), dw(bf16)),
                                      ("combine, rank-major", "combine", cw(rsms, rblocks), cw())):
            m = measured(op, ref_key)
            try:
                rates = MODEL.calibrate_stages(wref, m) if m is not None else None
            except ValueError:
                rates = None
            if rates is None:
                out.append(f"      {label}: n/a (no phase marks of every stage at {rsms} SMs)")
                continue
            predict(label, op, wnow, rates)
    if checks:
        bad = [f"{c.name} {c.ratio:.2f}" for c in checks if not c.within]
        out.append(f"    time check: {len(checks) - len(bad)} of {len(checks)} predictions within "
                   f"{100 * MODEL.TIME_TOLERANCE:g}% of the measured call" + (f"; OUTSIDE: {', '.join(bad)}" if bad else ""))
    nic = MODEL.Machine().nic_gbps
    for label, op, work in (("dispatch", "dispatch_cached", dw(bf16)), ("combine", "combine", cw())):
        r = rates_of.get(op)
        if r is None:
            continue
        s = MODEL.split_sms(sms, work.rdma_bytes, work.node_bytes, r.rdma_per_sm, r.node_per_sm)
        remote = sum(lc.rdma_sent) / R * (work.rdma_bytes / pairs)
        sn = MODEL.split_sms(sms, work.rdma_bytes, work.node_bytes, r.rdma_per_sm, r.node_per_sm, nic_gbps=nic,
                             rdma_link_bytes=remote)
        seq = MODEL.predict_stages(work, r)
        out.append(f"    if the stages were fused/overlapped ({label}, calibrated rates): split {sms} SMs as {s.rdma_sms} "
                   f"RDMA hop / {s.node_sms} intranode stage -> {s.time_us:.1f} µs (ideal {s.ideal_us:.1f}; one after the "
                   f"other on all {sms}: {seq.rdma_us + seq.node_us:.1f}); bound by {s.bound.describe()}; over a "
                   f"{nic:g} GB/s NIC carrying the {remote / 1e6:.2f} MB of remote rows: {sn.rdma_sms} / {sn.node_sms} -> "
                   f"{sn.time_us:.1f} µs, bound by {sn.bound.describe()}")
    intra = call("intra_dispatch_cached")
    if rd is not None and intra is not None:
        rate = MODEL.per_sm_gbps(rows, bf16, intra, sms)
        out.append(f"    not a check: the intranode path (one node of all ranks, same run) cached dispatch {intra:.1f} µs -> "
                   f"{rate:.3g} GB/s per SM; the calibrated RDMA hop / intranode stage rates are {rd.rdma_per_sm / rate:.2f}x / "
                   f"{rd.node_per_sm / rate:.2f}x it")
    out.append("    assumptions: the stages run one after the other (the marks of one stream); hop and intranode stage "
               "SM-bound at their per-SM rates (virtual nodes: NVSHMEM P2P over NVLink, no NIC); local work at one "
               "per-GPU rate per direction (bytes read + written, independent of --num-sms); the expert-major combine's "
               "pre-reduction takes the staging copy's place (its read of the expert rows has no term); the first "
               "call's host sync (and, with a reorder, its sort), and metadata, have no term")
    return out
