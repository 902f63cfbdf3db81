"""Worker bodies for hybridep's static per-rank budget (`moe_expert_rank_capacity_factor`):
the documented budget against a dense oracle, megatron-core's paged-stash rerun through the
manager's hooks, and routing-map rows past top-k (run on every rank of a gloo DistPool; helpers
and the device modes are megatron_cases.py's)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_cases import (_global_problem, _init_megatron, _make_dispatcher, _routing_map, _run_dispatcher, _to,
                            check_cuda_buffers, guarded, side)
from oracle import expected_expert_major


def budget_oracle_rows(case, R, L, align, grown=0):
    """The documented budget, re-derived: room for int(T * topk * factor) real rows (T: the
    largest token count over the group, so every rank budgets alike, T = 0 ranks included),
    plus align - 1 pad rows per local expert, rounded up to the alignment, at least one
    alignment; `grown` real rows at least after a grow_recv_capacity."""
    real = max(int(max(case["Ts"]) * case["K"] * case["factor"]), grown)
    rows = real + L * (align - 1)
    return max(rows + (-rows % align), align)


def _budget_dispatcher(case, f):
    """A flex hybridep dispatcher with moe_expert_rank_capacity_factor = f (0.16 has no such
    config field: there the manager is driven directly); the alignment forced to case["align"]."""
    from megatron_ep.megatron import compat

    feats = compat.features()
    # 0.19 accepts the knob for hybridep only with TE's op fuser (main: or moe_use_grouped_tensor);
    # the flag changes nothing in the dispatcher itself.
    extra = {"moe_expert_rank_capacity_factor": f, "use_transformer_engine_op_fuser": True} if feats.rank_capacity_factor else {}
    extra.update(case.get("config", {}))
    disp = _make_dispatcher("hybridep", case["E"], case["K"], case["H"], **extra)
    mgr = disp._comm_manager
    if not feats.rank_capacity_factor:
        mgr.moe_expert_rank_capacity_factor = mgr._factor = f
    mgr.align = case["align"]
    return disp, mgr


def _budget_expected(case, inputs, W, upstream, probs_full, grown=0):
    """What a budgeted dispatch must give on this rank: each rank q keeps the first budget rows
    of its expert-major layout; returns (errors-free expectations) as a dict."""
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H, align = case["E"], case["K"], case["H"], case["align"]
    L = E // R
    budget = budget_oracle_rows(case, R, L, align, grown)
    kept, dropped_real, needed = set(), {}, {}
    for q in range(R):
        exp = expected_expert_major(inputs, q, R, E, align)
        dropped_real[q] = sum(1 for i, s in enumerate(exp["src"]) if s is not None and i >= budget)
        needed[q] = sum(1 for s in exp["src"] if s is not None)
        kept |= {s for i, s in enumerate(exp["src"]) if s is not None and i < budget}
        if q == r:
            want_x = torch.zeros((budget, H))
            n = min(budget, exp["x"].shape[0])
            want_x[:n] = exp["x"][:n]
            ends = torch.cumsum(exp["tokens_per_expert"], 0)
            want_tpe = ends.clamp(max=budget) - (ends - exp["tokens_per_expert"]).clamp(max=budget)
            want_tpe[-1] += budget - want_tpe.sum()
    # Dense reference of the surviving pairs, with autograd for the input and probs gradients.
    mine = inputs[r]
    xr = mine["x"].clone().double().requires_grad_(True)
    pr = probs_full[r].clone().double().requires_grad_(True)
    y = torch.zeros((case["Ts"][r], H), dtype=torch.float64)
    for t in range(case["Ts"][r]):
        for k in range(K):
            e = int(mine["idx"][t, k])
            if e >= 0 and (r, t, k) in kept:
                y[t] = y[t] + (xr[t] @ W[e].double()) * pr[t, e]
    ((y * upstream[r].double()).sum() + 0 * (xr.sum() + pr.sum())).backward()  # a graph even when T = 0
    return dict(budget=budget, x=want_x, tpe=want_tpe, dropped=dropped_real, needed=needed,
                y=y.detach(), gx=xr.grad, gp=pr.grad)


def _budget_errors(tag, got, want, flag, ndrop, align, r):
    errors = []
    if not torch.equal(got["perm_x"], want["x"]):
        errors.append(f"{tag} dispatched rows: shape {tuple(got['perm_x'].shape)} vs {tuple(want['x'].shape)} or values differ")
    if got["tpe"].tolist() != want["tpe"].tolist():
        errors.append(f"{tag} tokens_per_expert {got['tpe'].tolist()} != {want['tpe'].tolist()}")
    if any(c % align for c in got["tpe"].tolist()):
        errors.append(f"{tag} tokens_per_expert {got['tpe'].tolist()} not multiples of {align}")
    # over_budget is the group's (any rank dropped); num_dropped_rows this rank's own drops
    any_drop = any(n > 0 for n in want["dropped"].values())
    if flag != any_drop or ndrop != want["dropped"][r]:
        errors.append(f"{tag} over_budget={flag} num_dropped_rows={ndrop}, want {any_drop} / {want['dropped'][r]}")
    for name, a, b in (("output", got["y"], want["y"]), ("grad hidden", got["gx"], want["gx"]), ("grad probs", got["gp"], want["gp"])):
        if not torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} {name}: max abs diff {(a.double() - b).abs().max().item():.3g}")
    return errors


@guarded
def run_rank_budget_case(case):
    """hybridep with moe_expert_rank_capacity_factor: exactly the documented budget of rows per
    rank, rows past it dropped and counted, against a dense oracle of which (token, expert)
    pairs survive; ranks may have no tokens. case["expect_drop"] says whether any rank must drop
    (the promise under test: a factor equal to the EP size never drops)."""
    from megatron_ep.megatron import compat

    with side(case, "ref")[0]:
        _init_megatron()
    R, r = dist.get_world_size(), dist.get_rank()
    E, f, align = case["E"], case["factor"], case["align"]
    L = E // R
    inputs, W, upstream, probs_full = _global_problem(case)
    mine = inputs[r]
    routing_map = _routing_map(mine["idx"], E)
    ctx, dev = side(case, "ours")
    with ctx:
        disp, mgr = _budget_dispatcher(case, f)
        x = mine["x"].to(dev).clone().requires_grad_(True)
        probs_leaf = probs_full[r].to(dev).clone().requires_grad_(True)
        got = _to(_run_dispatcher(disp, x, routing_map.to(dev), probs_leaf, W[r * L:(r + 1) * L].to(dev),
                                  upstream[r].to(dev)), "cpu")
        flag, ndrop = bool(mgr.over_budget.item()), int(mgr.num_dropped_rows.item())
        need = int(mgr.required_recv.item()) if hasattr(mgr, "required_recv") else None
        disp_flag = disp.check_over_budget() if compat.features().dispatcher_over_budget else None
        dist.barrier()

    tag = f"[R={R} rank={r} Ts={case['Ts']} factor={f} align={align} {case.get('device', 'cpu')}]"
    want = _budget_expected(case, inputs, W, upstream, probs_full)
    errors = check_cuda_buffers(case, tag) + _budget_errors(tag, got, want, flag, ndrop, align, r)
    if need != want["needed"][r]:
        errors.append(f"{tag} required_recv={need}, want the {want['needed'][r]} real rows this rank needed")
    if disp_flag is not None and bool(disp_flag.item()) != flag:
        errors.append(f"{tag} MoEFlexTokenDispatcher.check_over_budget() disagrees with the manager")
    if case["expect_drop"] != any(want["dropped"].values()):
        errors.append(f"{tag} case expected dropping={case['expect_drop']} but the oracle says {want['dropped']}")
    return errors


class _RerunModel(torch.nn.Module):
    """What megatron-core's PagedStashRunner walks: a chunk with a decoder whose layers have an
    `mlp` holding the flex `token_dispatcher` (here the dispatcher alone, with toy experts)."""

    def __init__(self, disp, config):
        super().__init__()
        self.config, self.mtp_process = config, False
        self.decoder = torch.nn.Module()
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.token_dispatcher = disp
        self.decoder.layers = torch.nn.ModuleList([layer])

    def zero_grad_buffer(self):
        pass


def _paged_stash_runner():
    """megatron-core's PagedStashRunner when it drives the capacity hooks (main), else None."""
    try:
        from megatron.core.transformer.moe import paged_stash
        from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    except ImportError:
        return None
    if not hasattr(MoEFlexTokenDispatcher, "grow_ep_recv_capacity"):
        return None
    return paged_stash


@contextlib.contextmanager
def _stash_state_on(device):
    """PagedStashRunner asks the (unused) paged stash for its overflow flags as device='cuda'
    tensors; on CPU they are made here, everything else is megatron-core's."""
    from megatron.core.transformer.moe import paged_stash

    if device != "cpu":
        yield
        return
    saved = paged_stash.check_paged_stash_overflow, paged_stash.check_paged_stash_host_spill
    paged_stash.check_paged_stash_overflow = paged_stash.check_paged_stash_host_spill = lambda: torch.zeros(1, dtype=torch.bool)
    try:
        yield
    finally:
        paged_stash.check_paged_stash_overflow, paged_stash.check_paged_stash_host_spill = saved


def _hook_protocol_step(disp, mgr, attempt):
    """The paged-stash rerun protocol of megatron-core main (paged_stash.py, PagedStashRunner),
    through the manager's hooks directly, for versions whose runner lacks them: run; if any
    rank went over budget, clear the factor, reset, invalidate, grow to the group's largest
    required_recv, rerun dropless; restore the factor."""
    results, factor = [attempt()], mgr.moe_expert_rank_capacity_factor
    over = mgr.over_budget.to(torch.int32).cpu()
    dist.all_reduce(over)
    if int(over) > 0:
        required = mgr.required_recv.cpu().clone()
        dist.all_reduce(required, op=dist.ReduceOp.MAX)
        mgr.moe_expert_rank_capacity_factor = None
        mgr.over_budget.fill_(0)
        mgr.required_recv.fill_(0)
        mgr._bootstrapped = False
        mgr.grow_recv_capacity(int(required))
        results.append(attempt())
        mgr._bootstrapped = False
    mgr.moe_expert_rank_capacity_factor = factor
    return results


def _captured_after_rerun(mgr, attempt):
    """The step after a rerun as megatron-core's full-iteration CUDA graph takes it: invalidated
    (`_bootstrapped = False`) and captured, so no collective may run. On CPU the capture is
    simulated: the manager sees capturing() and any collective raises."""
    import megatron_ep.megatron.hybridep_manager as hm

    def no_collective(*a, **k):
        raise AssertionError("a collective ran inside the (simulated) capture")

    saved = hm.capturing, hm.agree_max
    mgr._bootstrapped = False
    hm.capturing, hm.agree_max, mgr.buffer.reserve = (lambda: True), no_collective, no_collective
    try:
        return attempt()
    except Exception as e:  # reported, not raised: every rank must reach the barrier
        return f"the step captured after a rerun raised {type(e).__name__}: {e}"
    finally:
        hm.capturing, hm.agree_max = saved
        del mgr.buffer.reserve  # the Buffer's own method again


@guarded
def run_budget_rerun_case(case):
    """An over-budget step under megatron-core's paged-stash rerun (main's PagedStashRunner, or
    its hook protocol driven directly where the runner lacks the hooks): the step reruns dropless
    and its result equals Megatron's alltoall (no row lost); the manager grows its budget to what
    the step needed, so the next step on the same routing fits at once, without a rerun."""
    ctx, _ = side(case, "ref")
    with ctx:
        _init_megatron()
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H = case["E"], case["K"], case["H"]
    L = E // R
    inputs, W, upstream, probs_full = _global_problem(case)
    routing_map = _routing_map(inputs[r]["idx"], E)
    errors, tag = [], f"[R={R} rank={r} rerun factor={case['factor']} {case.get('device', 'cpu')}]"
    with side(case, "ref")[0]:  # the reference: Megatron's alltoall on the same inputs (a fresh context: single-use)
        x = inputs[r]["x"].clone().requires_grad_(True)
        pl = probs_full[r].clone().requires_grad_(True)
        ref = _run_dispatcher(_make_dispatcher("alltoall", E, K, H), x, routing_map, pl, W[r * L:(r + 1) * L], upstream[r])
    ctx, dev = side(case, "ours")
    runner_mod = _paged_stash_runner()
    with ctx, (_stash_state_on(dev) if runner_mod is not None else contextlib.nullcontext()):
        disp, mgr = _budget_dispatcher(case, case["factor"])

        def attempt():
            xx = inputs[r]["x"].to(dev).clone().requires_grad_(True)
            pp = probs_full[r].to(dev).clone().requires_grad_(True)
            got = _run_dispatcher(disp, xx, routing_map.to(dev), pp, W[r * L:(r + 1) * L].to(dev), upstream[r].to(dev))
            return _to(got, "cpu")

        steps = []
        for step in range(2):
            drops_before = int(mgr.num_dropped_rows.item())
            if runner_mod is not None:
                tried = []

                def forward_backward(model, data_iterator, num_microbatches, seq_length, forward_only):
                    for _ in range(num_microbatches):
                        next(data_iterator[0])
                        tried.append(attempt())
                    return tried[-1]

                runner = runner_mod.PagedStashRunner(disp.config, False, [_RerunModel(disp, disp.config)], None,
                                                     forward_backward)
                runner(model=[runner.model[0]], data_iterator=iter([0, 0]), num_microbatches=1, seq_length=1,
                       forward_only=False)
            else:
                tried = _hook_protocol_step(disp, mgr, attempt)
            steps.append((tried, int(mgr.num_dropped_rows.item()) - drops_before))
        captured = _captured_after_rerun(mgr, attempt)
        dist.barrier()
    errors += check_cuda_buffers(case, tag)
    if isinstance(captured, str):
        errors.append(f"{tag} {captured}")
    else:
        for key in ("y", "gx", "gp"):
            if not torch.allclose(captured[key], ref[key], rtol=1e-5, atol=1e-5):
                errors.append(f"{tag} the step captured after a rerun: {key} differs from alltoall's")
    driver = "PagedStashRunner" if runner_mod is not None else "the hook protocol"
    for step, (tried, dropped) in enumerate(steps):
        for key in ("y", "gx", "gp"):
            a, b = tried[-1][key], ref[key]
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                errors.append(f"{tag} step {step} ({len(tried)} attempts, {driver}): {key} differs from alltoall's")
        want = 2 if step == 0 else 1
        if len(tried) != want:
            errors.append(f"{tag} step {step}: {len(tried)} attempts through {driver}, want {want}")
        if step == 1 and dropped:
            errors.append(f"{tag} step 1 dropped {dropped} rows: grow_recv_capacity did not make room")
    over = torch.tensor([steps[0][1]])
    dist.all_reduce(over)
    if int(over) == 0:
        errors.append(f"{tag} no rank went over budget in step 0: the case does not exercise the rerun")
    return errors


@guarded
def run_overfull_routing_case(case):
    """A routing-map row with more than top-k experts (case["extra"]: "one" adds experts to one
    row of case["bad_ranks"]' maps, "all" marks every expert of every row there). The dynamic
    managers reject it before any communication: the bad ranks raise ValueError naming the row,
    the others PeerFailedError, and the next dispatch works (checked against alltoall). The
    budget mode, which cannot sync, counts the extra pairs as dropped and raises over_budget on
    every rank."""
    from megatron_ep.core.errors import PeerFailedError

    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H = case["E"], case["K"], case["H"]
    L = E // R
    inputs, W, upstream, probs_full = _global_problem(case)
    good_map = _routing_map(inputs[r]["idx"], E)
    bad_map = good_map.clone()
    row = 1
    if r in case["bad_ranks"]:
        if case["extra"] == "all":
            bad_map[:] = True
        else:  # every expert this row lacks, up to K + 2 in all
            free = (~bad_map[row]).nonzero().flatten()[: K + 2 - int(bad_map[row].sum())]
            bad_map[row, free] = True
    excess = int((bad_map.sum(-1) - K).clamp(min=0).sum())
    errors, tag = [], f"[R={R} rank={r} {case['backend']} extra={case['extra']} bad={case['bad_ranks']} {case.get('device', 'cpu')}]"
    with side(case, "ref")[0]:
        _init_megatron()
    W_local = W[r * L:(r + 1) * L]
    ctx, dev = side(case, "ours")

    def run(disp, routing_map, device):
        x = inputs[r]["x"].to(device).clone().requires_grad_(True)
        pl = probs_full[r].to(device).clone().requires_grad_(True)
        return _to(_run_dispatcher(disp, x, routing_map.to(device), pl, W_local.to(device), upstream[r].to(device)), "cpu")

    with ctx:
        if case.get("budget"):
            disp, mgr = _budget_dispatcher(dict(case, align=1), float(R))
        else:
            disp = _make_dispatcher(case["backend"], E, K, H)
            mgr = disp._comm_manager
        try:
            run(disp, bad_map, dev)
            outcome = None
        except (ValueError, PeerFailedError) as e:
            outcome = e
        if case.get("budget"):
            if outcome is not None:
                errors.append(f"{tag} the budget mode raised {type(outcome).__name__}: {outcome}")
            ndrop, flag = int(mgr.num_dropped_rows.item()), bool(mgr.over_budget.item())
            group = torch.tensor([excess])
            dist.all_reduce(group)  # over_budget is the group's: raised on every rank when any rank dropped
            if ndrop != excess or flag != (int(group) > 0):
                errors.append(f"{tag} num_dropped_rows={ndrop} over_budget={flag}, want the {excess} pairs past top-k "
                              f"(the group's {int(group)})")
            dist.barrier()
            return errors + check_cuda_buffers(case, tag)
        got = run(disp, good_map, dev)  # the Buffer stays usable: the valid routing, against alltoall
    with side(case, "ref")[0]:
        ref = run(_make_dispatcher("alltoall", E, K, H), good_map, "cpu")
    dist.barrier()
    mine = r in case["bad_ranks"]
    if mine and not (type(outcome) is ValueError and f"routing map row {row if case['extra'] == 'one' else 0} " in str(outcome)):
        errors.append(f"{tag} want a ValueError naming the row, got {type(outcome).__name__}: {outcome}")
    if not mine and not isinstance(outcome, PeerFailedError):
        errors.append(f"{tag} want PeerFailedError from the bad rank, got {type(outcome).__name__}: {outcome}")
    for key in ("y", "gx", "gp"):
        if not torch.allclose(got[key], ref[key], rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} after the rejected call, {key} differs from alltoall's by "
                          f"{(got[key] - ref[key]).abs().max().item():.3g}")
    return errors + check_cuda_buffers(case, tag)


@guarded
def run_bad_routing_inputs_case(case):
    """A manager given a routing map that is not a bool map, probs shaped unlike it (transposed
    included), or hidden states that are not the routed tokens, raises a ValueError naming what
    the caller passed at its dispatch, on every rank alike, and then works (against
    alltoall); a rank capacity factor of NaN, inf, 0 or below is refused when the manager is
    built (0 and negative ones used to switch the budget off silently)."""
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H = case["E"], case["K"], case["H"]
    L = E // R
    inputs, W, upstream, probs_full = _global_problem(case)
    good_map = _routing_map(inputs[r]["idx"], E)
    errors, tag = [], f"[R={R} rank={r} {case['backend']}]"
    with side(case, "ref")[0]:
        _init_megatron()
    W_local = W[r * L:(r + 1) * L]
    ctx, dev = side(case, "ours")
    x = inputs[r]["x"].to(dev)
    probs = (probs_full[r] * good_map).to(dev)
    with ctx:
        disp = _make_dispatcher(case["backend"], E, K, H)
        mgr = disp._comm_manager
        T = x.shape[0]
        for name, rmap, p, h, text in [
                ("float routing map", good_map.float(), probs, x, "routing_map must be a torch.bool"),
                ("int routing map", good_map.long(), probs, x, "routing_map must be a torch.bool"),
                ("probs shape", good_map, probs[:, :-1], x, "probs has shape"),
                # [E, T] probs for [T, E] have the right size and every value in the wrong place
                ("probs transposed", good_map, probs.t().contiguous(), x, f"probs has shape {(E, T)}"),
                ("fewer hidden states", good_map, probs, x[:-1], f"hidden_states has {T - 1} tokens but the "
                                                                   f"routing_map given to setup_metadata has {T} rows")]:
            try:
                mgr.setup_metadata(rmap.to(dev), p)
                mgr.dispatch(h)
                errors.append(f"{tag} {name}: no error")
            except ValueError as e:
                if text not in str(e):
                    errors.append(f"{tag} {name}: {e!r} does not mention {text!r}")
        got = _to(_run_dispatcher(disp, x.clone().requires_grad_(True), good_map.to(dev),
                                  probs_full[r].to(dev).clone().requires_grad_(True), W_local.to(dev),
                                  upstream[r].to(dev)), "cpu")
    with side(case, "ref")[0]:
        ref = _to(_run_dispatcher(_make_dispatcher("alltoall", E, K, H), inputs[r]["x"].clone().requires_grad_(True),
                                  good_map, probs_full[r].clone().requires_grad_(True), W_local, upstream[r]), "cpu")
    if not torch.allclose(got["y"], ref["y"], rtol=1e-5, atol=1e-5):
        errors.append(f"{tag} the dispatch after the refused ones differs from alltoall")
    if case["backend"] == "hybridep":
        from megatron_ep.megatron.hybridep_manager import MegatronEPHybridEPManager

        for f in (float("nan"), float("inf"), 0.0, -1.0):
            try:
                with side(case, "ours")[0], _with_factor(mgr.config, f) as config:
                    MegatronEPHybridEPManager(mgr.group, mgr.num_local_experts, E, config)
                errors.append(f"{tag} rank capacity factor {f}: accepted")
            except ValueError as e:
                if "capacity_factor" not in str(e):
                    errors.append(f"{tag} rank capacity factor {f}: {e!r} does not name it")
    dist.barrier()
    return errors


@contextlib.contextmanager
def _with_factor(config, f):
    """A copy of `config` whose rank capacity factor is `f` (through the environment variable
    where the installed megatron-core has no such field; restored after)."""
    import copy
    import os

    from megatron_ep.megatron import compat

    c = copy.copy(config)
    key, before = "MEGATRON_EP_RANK_CAPACITY_FACTOR", os.environ.get("MEGATRON_EP_RANK_CAPACITY_FACTOR")
    if compat.features().rank_capacity_factor:
        c.moe_expert_rank_capacity_factor = f
    else:
        os.environ[key] = str(f)
    try:
        yield c
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@guarded
def run_budget_growth_case(case):
    """A rank's token count grows past the one agreed at the first budgeted dispatch (rank 0: 4
    tokens, then 40; the others keep 4), with a factor equal to the EP size: the others' budgets
    are too small for rank 0's rows and drop some. Every rank must then report it: over_budget
    raised on every rank, group_dropped_rows the sum of every rank's num_dropped_rows (> 0),
    while a step that drops nothing leaves every flag down."""
    with side(case, "ref")[0]:
        _init_megatron()
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H = case["E"], case["K"], case["H"]
    L = E // R
    ctx, dev = side(case, "ours")
    errors, tag = [], f"[budget growth R={R} rank={r}]"
    with ctx:
        disp, mgr = _budget_dispatcher(case, float(R))
        for step, Ts in enumerate(case["steps"]):
            inputs, W, upstream, probs_full = _global_problem(dict(case, Ts=Ts, seed=case["seed"] + step))
            mgr.over_budget.zero_()  # what reset_over_budget() does between steps
            group_rows = lambda: int(getattr(mgr, "group_dropped_rows", mgr.num_dropped_rows).sum())  # noqa: E731
            before = int(mgr.num_dropped_rows.sum()), group_rows()
            _run_dispatcher(disp, inputs[r]["x"].to(dev).requires_grad_(True), _routing_map(inputs[r]["idx"], E).to(dev),
                            probs_full[r].to(dev).requires_grad_(True), W[r * L:(r + 1) * L].to(dev), upstream[r].to(dev))
            mine = int(mgr.num_dropped_rows.sum()) - before[0]
            group = group_rows() - before[1]
            seen = torch.tensor([int(mgr.over_budget.item()), mine, group])
            every = [torch.zeros_like(seen) for _ in range(R)]
            dist.all_gather(every, seen)
            total = sum(int(e[1]) for e in every)
            for q, e in enumerate(every):
                if int(e[2]) != total or bool(e[0]) != (total > 0):
                    errors.append(f"{tag} step {step} (Ts={Ts}): rank {q} reports over_budget={bool(e[0])}, "
                                  f"group_dropped_rows={int(e[2])}; the ranks dropped {total} rows in all")
            if step == 0 and total:
                errors.append(f"{tag} step 0 dropped {total} rows at a factor equal to the EP size")
            if step == 1 and not total:
                errors.append(f"{tag} step 1 dropped nothing: the case checks nothing")
    return errors
