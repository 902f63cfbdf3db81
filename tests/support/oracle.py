"""Test inputs and an independent, dense, single-process oracle of docs/design.md §2.

Written separately from the backends on purpose: plain Python loops over (source rank, token,
slot), no shared helpers, so a bug in the backends cannot be mirrored here. Every rank builds
the same global inputs from one seed, then checks its own part of the result.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def _routing(g, T, E, K, R, pattern, p_drop):
    L = E // R
    idx = torch.full((T, K), -1, dtype=torch.int64)
    for t in range(T):
        if pattern == "one_expert":
            chosen = [pattern_expert(E)]
        elif pattern == "hot":  # one expert takes about half of the tokens
            rest = torch.randperm(E, generator=g)[: min(K, E)].tolist()
            hot = pattern_expert(E)
            if torch.rand((), generator=g) < 0.5 and hot not in rest:
                rest[0] = hot
            chosen = rest
        elif pattern == "node_limited":  # DeepSeek-V3 style: experts of 2 of 4 expert groups (nodes)
            groups = torch.randperm(4, generator=g)[:2].tolist()
            pool = [gr * (E // 4) + i for gr in groups for i in range(E // 4)]
            chosen = [pool[i] for i in torch.randperm(len(pool), generator=g)[: min(K, len(pool))].tolist()]
        elif pattern == "first_rank":  # every token's copies on rank 0 (a static budget's worst case)
            chosen = torch.randperm(L, generator=g)[: min(K, L)].tolist()
        elif pattern == "same_rank":
            r = int(torch.randint(R, (1,), generator=g))
            chosen = (r * L + torch.randperm(L, generator=g)[: min(K, L)]).tolist()
        else:
            chosen = torch.randperm(E, generator=g)[: min(K, E)].tolist()
        row = chosen + [-1] * (K - len(chosen))
        row = [e if torch.rand((), generator=g) >= p_drop else -1 for e in row]
        perm = torch.randperm(K, generator=g).tolist()
        idx[t] = torch.tensor([row[p] for p in perm])
    return idx


def pattern_expert(E):
    return (7 * E) // 11  # a fixed, not-first, not-last expert


def make_inputs(seed: int, R: int, E: int, K: int, H: int, Ts, dtype: str = "bf16",
                pattern: str = "random", p_drop: float = 0.2):
    """Global inputs: a list over source ranks of dicts x / idx / w (x is a tuple for fp8)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(R):
        T = Ts[s]
        base = torch.randn((T, H), generator=g)
        if dtype == "fp8":
            x = ((base * 40).clamp(-448, 448).to(FP8), torch.rand((T, H // 128), generator=g) + 0.01)
        elif dtype == "fp64":
            x = base.double()
        else:
            x = base.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
        idx = _routing(g, T, E, K, R, pattern, p_drop)
        w = torch.rand((T, K), generator=g) + 0.5
        w = torch.where(idx >= 0, w, torch.zeros_like(w))
        out.append({"x": x, "idx": idx, "w": w})
    return out


def split_x(x):
    return (x[0], x[1]) if isinstance(x, tuple) else (x, None)


# ------------------------------------------------------------------------------- dispatch
def expected_rank_major(inputs, r, R, E):
    """Rows for receiving rank r, in (source rank, source token) order."""
    L = E // R
    xs, ss, idxs, ws, src = [], [], [], [], []
    tpe = [0] * L
    for s, inp in enumerate(inputs):
        data, scales = split_x(inp["x"])
        idx, w = inp["idx"], inp["w"]
        for t in range(idx.shape[0]):
            local = [k for k in range(idx.shape[1]) if idx[t, k] >= 0 and idx[t, k] // L == r]
            if not local:
                continue
            xs.append(data[t])
            if scales is not None:
                ss.append(scales[t])
            li = [int(idx[t, k]) - r * L if k in local else -1 for k in range(idx.shape[1])]
            idxs.append(li)
            ws.append([float(w[t, k]) if k in local else 0.0 for k in range(idx.shape[1])])
            src.append((s, t))
            for k in local:
                tpe[int(idx[t, k]) - r * L] += 1
    K = inputs[0]["idx"].shape[1]
    H = split_x(inputs[0]["x"])[0].shape[1]
    like = split_x(inputs[0]["x"])
    x = torch.stack(xs) if xs else like[0].new_zeros((0, H))
    sc = (torch.stack(ss) if ss else like[1].new_zeros((0, H // 128))) if like[1] is not None else None
    return {
        "x": x, "scales": sc,
        "idx": torch.tensor(idxs, dtype=torch.int64).view(-1, K),
        "w": torch.tensor(ws, dtype=torch.float32).view(-1, K),
        "tokens_per_expert": torch.tensor(tpe, dtype=torch.int64),
        "src": src,
    }


def expected_expert_major(inputs, r, R, E, align):
    """Rows for rank r grouped by local expert, then (source rank, token); zero-padded segments."""
    L = E // R
    segs = [[] for _ in range(L)]
    for s, inp in enumerate(inputs):
        idx = inp["idx"]
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0 and e // L == r:
                    segs[e - r * L].append((s, t, k))
    data0, scales0 = split_x(inputs[0]["x"])
    H = data0.shape[1]
    xs, ss, ws, re, src = [], [], [], [], []
    padded = []
    for e in range(L):
        for (s, t, k) in segs[e]:
            data, scales = split_x(inputs[s]["x"])
            xs.append(data[t])
            if scales is not None:
                ss.append(scales[t])
            ws.append(float(inputs[s]["w"][t, k]))
            re.append(e)
            src.append((s, t, k))
        n = len(segs[e])
        pad = (-n) % align
        padded.append(n + pad)
        for _ in range(pad):
            xs.append(data0.new_zeros(H))
            if scales0 is not None:
                ss.append(scales0.new_zeros(H // 128))
            ws.append(0.0)
            re.append(-1)
            src.append(None)
    return {
        "x": torch.stack(xs) if xs else data0.new_zeros((0, H)),
        "scales": (torch.stack(ss) if ss else scales0.new_zeros((0, H // 128))) if scales0 is not None else None,
        "w": torch.tensor(ws, dtype=torch.float32),
        "row_expert": torch.tensor(re, dtype=torch.int32),
        "tokens_per_expert": torch.tensor(padded, dtype=torch.int64),
        "src": src,
    }


# -------------------------------------------------------------------------------- combine
def expected_combine(inp, s, R, E, permute, scale, bias):
    """y for source rank s when every expert (permute) or every receiving rank (rank-major)
    maps a row v to v * scale[i] + bias[i]; fp64."""
    L = E // R
    data, _ = split_x(inp["x"])
    idx = inp["idx"]
    T, H = data.shape
    y = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        v = data[t].double()
        if permute:
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    y[t] += v * scale[e] + bias[e]
        else:
            for d in sorted({int(e) // L for e in idx[t].tolist() if e >= 0}):
                y[t] += v * scale[d] + bias[d]
    return y


def num_destinations(inp, R, E, permute):
    """Round trip of all-ones: distinct destination ranks (rank-major) or valid slots."""
    L = E // R
    out = []
    for row in inp["idx"].tolist():
        valid = [e for e in row if e >= 0]
        out.append(len(valid) if permute else len({e // L for e in valid}))
    return torch.tensor(out, dtype=torch.float64)


def bits(t):
    """A view for bit-exact comparison of any dtype."""
    return (t if t.dim() else t.reshape(1)).contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------- low latency
def fp8_cast(x):
    """Independent per-token, per-128-channel e4m3 cast (the contract's formula)."""
    T, H = x.shape
    q = torch.empty((T, H), dtype=FP8)
    s = torch.empty((T, H // 128), dtype=torch.float32)
    for b in range(H // 128):
        blk = x[:, b * 128:(b + 1) * 128].float()
        amax = torch.maximum(blk.abs().max(dim=1).values, torch.tensor(1e-4))
        scale = amax / 448.0
        q[:, b * 128:(b + 1) * 128] = (blk / scale.unsqueeze(1)).to(FP8)
        s[:, b] = scale
    return q, s


def expected_low_latency(inputs, r, R, E, max_tokens, use_fp8):
    L = E // R
    cap = R * max_tokens
    H = inputs[0]["x"].shape[1]
    xs = torch.zeros((L, cap, H), dtype=FP8 if use_fp8 else inputs[0]["x"].dtype)
    ss = torch.zeros((L, cap, H // 128), dtype=torch.float32) if use_fp8 else None
    count = torch.zeros(L, dtype=torch.int32)
    layout = torch.zeros((L, R, 2), dtype=torch.int32)
    src = torch.full((L, cap), -1, dtype=torch.int32)
    casts = [fp8_cast(inp["x"]) if use_fp8 else None for inp in inputs]
    for e in range(L):
        n = 0
        for s, inp in enumerate(inputs):
            begin = n
            for t in range(inp["idx"].shape[0]):
                if (r * L + e) in inp["idx"][t].tolist():
                    if use_fp8:
                        xs[e, n] = casts[s][0][t]
                        ss[e, n] = casts[s][1][t]
                    else:
                        xs[e, n] = inp["x"][t]
                    src[e, n] = t
                    n += 1
            layout[e, s, 0], layout[e, s, 1] = begin, n - begin
        count[e] = n
    return {"x": xs, "scales": ss, "count": count, "layout_range": layout, "src_token": src}
