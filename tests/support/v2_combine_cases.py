"""Combine with biases against DeepEP V2's reference combine, bit for bit.

DeepEP V2's test (tests/elastic/test_ep.py) compares the combine's output bitwise with its
reference (deep_ep/utils/refs.py, `combine` and `ordered_accumulate`). That reference is
restated here from its description, independently of megatron_ep's backends:

* every (token, slot) has an expert output y[t, k] (zero where the slot is unused);
* per destination rank, the token's slots on that rank are summed in slot order in fp32 from
  zero and rounded to the output dtype; the rounded sum stands at the rank's last slot, zeros
  at its other slots (`reduce_in_local`; without it every slot keeps its own y);
* with scale-up groups (`reduce_in_scaleup`, V2's hybrid combine; here the internode path's
  nodes), the same once more over each group's slots: the group's terms summed in slot order
  in fp32 from zero, rounded, standing at the group's last slot;
* an fp32 accumulator starts at the biases (b0 + b1, b0, or zero) and adds slot 0, 1, ...
  K - 1 of that; one rounding at the end.

The rank-major combine's input row (one per token and rank) is what V2's test gives it: the
rank's own slots summed in slot order (fp32 from zero, rounded). The expert-major input holds
y of each delivered (token, slot) row, and garbage in the padding rows. Every rank builds the
same global inputs from one seed (oracle.make_inputs), then checks its own tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cases import Checker, get_buffer, run_each, to_dev
from oracle import expected_expert_major, expected_rank_major, make_inputs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def expert_outputs(seed: int, inputs, dtype: torch.dtype):
    """y[s] [T_s, K, H] for every source rank s: random, zero at unused slots."""
    g = torch.Generator().manual_seed(seed + 4242)
    out = []
    for inp in inputs:
        T, K = inp["idx"].shape
        H = inp["x"].shape[1]
        y = torch.randn((T, K, H), generator=g).to(dtype)
        y[inp["idx"] < 0] = 0
        out.append(y)
    return out


def make_biases(seed: int, rank: int, T: int, H: int, n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed * 31 + rank + 7)
    parts = [torch.randn((T, H), generator=g).to(dtype) for _ in range(n)]
    return None if n == 0 else parts[0] if n == 1 else tuple(parts)


def _grouped(terms: torch.Tensor, idx: torch.Tensor, experts_per_group: int) -> torch.Tensor:
    """Each token's slots grouped by expert // experts_per_group (unused slots: a group of their
    own): the group's terms summed in slot order (fp32 from zero), rounded, at its last slot."""
    T, K, H = terms.shape
    out = torch.zeros_like(terms)
    for t in range(T):
        groups = [int(e) // experts_per_group if int(e) >= 0 else -1 for e in idx[t].tolist()]
        for g in set(groups):
            slots = [k for k in range(K) if groups[k] == g]  # ascending
            part = torch.zeros(H, dtype=torch.float32)
            for k in slots:
                part += terms[t, k].float()
            out[t, slots[-1]] = part.to(terms.dtype)
    return out


def v2_reference(y: torch.Tensor, idx: torch.Tensor, R: int, E: int, bias, reduce_in_local: bool,
                 ranks_per_group: int = 0) -> torch.Tensor:
    """The combined tokens [T, H] of one source rank (see the module docstring); y [T, K, H];
    ranks_per_group > 0: also V2's scale-up reduction over groups of that many ranks."""
    T, K, H = y.shape
    L = E // R
    if bias is None:
        acc = torch.zeros((T, H), dtype=torch.float32)
    elif isinstance(bias, tuple):
        acc = bias[0].float() + bias[1].float()
    else:
        acc = bias.float().clone()
    terms = _grouped(y, idx, L) if reduce_in_local else y
    if ranks_per_group:
        terms = _grouped(terms, idx, L * ranks_per_group)
    for k in range(K):
        acc += terms[:, k].float()
    return acc.to(y.dtype)


def _rank_major_rows(exp, ys, inputs, rank: int, R: int, E: int, dtype: torch.dtype) -> torch.Tensor:
    """Row (s, t): the slots of token t of rank s that are on this rank, in slot order (fp32)."""
    L = E // R
    H = inputs[0]["x"].shape[1]
    rows = torch.empty((len(exp["src"]), H), dtype=dtype)
    for n, (s, t) in enumerate(exp["src"]):
        acc = torch.zeros(H, dtype=torch.float32)
        for k, e in enumerate(inputs[s]["idx"][t].tolist()):
            if e >= 0 and e // L == rank:
                acc += ys[s][t, k].float()
        rows[n] = acc.to(dtype)
    return rows


def _expert_major_rows(exp, ys, H: int, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.full((len(exp["src"]), H), 12345.0, dtype=dtype)  # padding: must not be read
    for m, src in enumerate(exp["src"]):
        if src is not None:
            s, t, k = src
            rows[m] = ys[s][t, k]
    return rows


def _same_values(chk: Checker, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact up to the sign of zero (what torch.equal, V2's check, compares)."""
    got = got.cpu()
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        chk.errors.append(f"{chk.tag} {what}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}")
        return
    if not torch.equal(got, want):
        bad = (got != want).any(dim=1).nonzero().flatten()[:5].tolist()
        diff = (got.double() - want.double()).abs().max().item()
        chk.errors.append(f"{chk.tag} {what}: not bit-exact (first bad tokens {bad}, max diff {diff:.3g})")


def run_v2_combine_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    """Rank-major and expert-major combine with cfg["bias"] biases (0, 1, 2) against
    v2_reference, and the expert-major one with single_reduction against V2's
    allow_multiple_reduction=False reference (no per-rank partial); on the cuda backend also the torch backend's bits (gloo, CPU), and the
    expert-major combine once more with its input in the buffer (the staged kernel instead of
    the partials). With cfg["sizing"]["ranks_per_node"] below R (the internode path), V2's
    hybrid reference over those nodes, and no torch backend to match (it sums in one level)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, align = cfg["E"], cfg["K"], cfg["H"], cfg["align"]
    dtype = DTYPES[cfg["dtype"]]
    inputs = make_inputs(cfg["seed"], R, E, K, H, cfg["Ts"], cfg["dtype"], cfg["pattern"], cfg.get("p_drop", 0.2))
    me = inputs[rank]
    ys = expert_outputs(cfg["seed"], inputs, dtype)
    bias = make_biases(cfg["seed"], rank, cfg["Ts"][rank], H, cfg["bias"], dtype)
    sizing = cfg.get("sizing", {})
    P = sizing.get("ranks_per_node", R)
    buf = get_buffer(backend, **sizing)
    ref = get_buffer("torch", fuzz_reference=True) if backend != "torch" and P == R else None
    chk = Checker(f"[v2 combine R={R} rank={rank} {cfg}]")
    dev_bias = None if bias is None else to_dev(bias, device)

    exp = expected_rank_major(inputs, rank, R, E)
    rows = _rank_major_rows(exp, ys, inputs, rank, R, E, dtype)
    out = buf.dispatch(to_dev(me["x"], device), me["idx"].to(device), None, num_experts=E)
    got = buf.combine(rows.to(device), out.handle, bias=dev_bias).x
    expp = expected_expert_major(inputs, rank, R, E, align)
    prow = _expert_major_rows(expp, ys, H, dtype)
    outp = buf.dispatch(to_dev(me["x"], device), me["idx"].to(device), None, num_experts=E, permute=True,
                        expert_alignment=align)
    gotp = buf.combine(prow.to(device), outp.handle, bias=dev_bias).x
    staged = single = None
    # single_reduction: every slot's row a term of its own (the cuda internode path refuses it)
    if P == R or backend == "torch":
        single = buf.combine(prow.to(device), outp.handle, bias=dev_bias, single_reduction=True).x
    else:
        try:
            buf.combine(prow.to(device), outp.handle, bias=dev_bias, single_reduction=True)
            chk.errors.append(f"{chk.tag} single_reduction across nodes did not raise")
        except NotImplementedError as e:
            if "internode" not in str(e):
                chk.errors.append(f"{chk.tag} single_reduction across nodes: the error names no path: {e}")
    if backend == "cuda" and P == R:
        inside = buf.get_combine_input(prow.shape[0], H, dtype, device=device)
        inside.copy_(prow.to(device))
        staged = buf.combine(inside, outp.handle, bias=dev_bias).x
    refs = None
    if ref is not None:
        r_out = ref.dispatch(me["x"], me["idx"], None, num_experts=E)
        r_outp = ref.dispatch(me["x"], me["idx"], None, num_experts=E, permute=True, expert_alignment=align)
        refs = (ref.combine(rows, r_out.handle, bias=bias).x, ref.combine(prow, r_outp.handle, bias=bias).x,
                ref.combine(prow, r_outp.handle, bias=bias, single_reduction=True).x)

    want = v2_reference(ys[rank], me["idx"], R, E, bias, reduce_in_local=True, ranks_per_group=P if P < R else 0)
    _same_values(chk, "rank-major combine vs V2's reference", got, want)
    _same_values(chk, "expert-major combine vs V2's reference", gotp, want)
    if staged is not None:
        _same_values(chk, "expert-major combine (staged input) vs V2's reference", staged, want)
    if single is not None:  # (one level on every topology: V2's (False, False) recipe)
        want_single = v2_reference(ys[rank], me["idx"], R, E, bias, reduce_in_local=False)
        _same_values(chk, "single_reduction combine vs V2's allow_multiple_reduction=False reference", single,
                     want_single)
    if refs is not None:
        chk.equal("rank-major combine vs the torch backend", got, refs[0])
        chk.equal("expert-major combine vs the torch backend", gotp, refs[1])
        chk.equal("single_reduction combine vs the torch backend", single, refs[2])
    return chk.errors


def run_v2_combine_cases(cfgs: list, backend: str = "torch", device: str = "cpu") -> list:
    return run_each(run_v2_combine_case, cfgs, backend, device, label=f"v2 combine rank {dist.get_rank()} ", most=20)


def v2_combine_cases(R: int, H: int = 128) -> list:
    """Every bias count and dtype over routings with unused slots, tokens whose slots all lie on
    one rank, several experts of one rank in a token, and a rank without tokens."""
    Ts = [5 + 3 * r for r in range(R)]
    if R > 1:
        Ts[1] = 0  # a rank with no tokens
    out = []
    seed = 500 + R
    for pattern, p_drop in (("random", 0.3), ("same_rank", 0.2), ("hot", 0.0)):
        for n_bias in (0, 1, 2):
            for dtype in ("bf16", "fp32"):
                seed += 1
                out.append(dict(seed=seed, E=4 * R, K=6, H=H, Ts=Ts, dtype=dtype, pattern=pattern, p_drop=p_drop,
                                bias=n_bias, align=16 if n_bias == 1 else 1))
    return out


def run_bias_refusals(backend: str = "torch", device: str = "cpu") -> list:
    """Each bad bias (and a single_reduction that is not a bool) raises its error on every rank
    before any collective; the Buffer still works."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 4 * R, 4, 128, 6
    inputs = make_inputs(900, R, E, K, H, [T] * R, "bf16", "random", 0.2)
    me = inputs[rank]
    buf = get_buffer(backend)
    out = buf.dispatch(to_dev(me["x"], device), me["idx"].to(device), None, num_experts=E)
    rows = torch.ones((out.handle.num_recv_rows, H), dtype=torch.bfloat16, device=device)
    good = torch.zeros((T, H), dtype=torch.bfloat16, device=device)
    bad = [
        ("a list", [good, good], TypeError, "tuple of two"),
        ("three biases", (good, good, good), TypeError, "tuple of two"),
        ("not a tensor", (good, 1.0), TypeError, "must be a tensor"),
        ("wrong dtype", good.float(), TypeError, "x's dtype"),
        ("wrong shape", good[:-1], ValueError, "shape"),
        ("wrong width", torch.zeros((T, H + 8), dtype=torch.bfloat16, device=device), ValueError, "shape"),
        ("not contiguous", torch.zeros((H, T), dtype=torch.bfloat16, device=device).t(), ValueError, "contiguous"),
    ]
    if device != "cpu":
        bad.append(("wrong device", good.cpu(), ValueError, "is on"))
    errors = []
    for what, b, exc, words in bad:
        try:
            buf.combine(rows, out.handle, bias=b)
            errors.append(f"[rank {rank}] bias {what}: no error")
        except exc as e:
            if words not in str(e):
                errors.append(f"[rank {rank}] bias {what}: {type(e).__name__}: {e} (want {words!r})")
        except Exception as e:
            errors.append(f"[rank {rank}] bias {what}: {type(e).__name__} instead of {exc.__name__}: {e}")
    try:  # a flag read as true from a string would sum differently from the peers
        buf.combine(rows, out.handle, single_reduction="False")
        errors.append(f"[rank {rank}] single_reduction='False': no error")
    except TypeError as e:
        if "single_reduction must be a bool" not in str(e):
            errors.append(f"[rank {rank}] single_reduction='False': {e}")
    back = buf.combine(rows, out.handle, bias=(good + 1, good + 2)).x.float().cpu()
    L = E // R
    ranks = torch.tensor([len({e // L for e in row if e >= 0}) for row in me["idx"].tolist()], dtype=torch.float32)
    if not torch.equal(back, (ranks + 3).unsqueeze(1).expand(T, H)):
        errors.append(f"[rank {rank}] combine after the refusals: wrong sums")
    return errors
