"""notify's row positions with token groups (csrc/intranode/notify.cu), emulated on the CPU step by
step the way its three kernels compute them -- the chunk plan of csrc/ipc/region_layout.h (read
through megatron_ep._protocol, so a change there shows here), per-chunk prefixes inside a block,
block prefixes inside a group, bases from every rank's per-group counts -- and compared with a
stable sort by (destination expert or rank, token group, source rank, token). This checks the
arithmetic only; the GPU tests (tests/cuda/test_cuda_intranode.py, tests/cuda/test_cuda_internode.py)
check the kernels themselves against the torch backend."""

import itertools
import random

import pytest

from megatron_ep import _protocol as P  # the scratch geometry too, not only what megatron_ep.core.protocol re-exports

WARPS = P.NOTIFY_WARPS


def pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def chunk_span(T: int, plan: dict, w: int):
    """notify.cu's chunk_span: warp w's token group and its tokens [t_begin, t_end)."""
    per_group = plan["chunks"] // plan["groups"]
    g, j = divmod(w, per_group)
    Tg = T // plan["groups"]
    first = g * Tg
    return g, first + min(Tg, j * plan["chunk"]), first + min(Tg, j * plan["chunk"] + plan["chunk"])


def valid_ids(ids, E):
    return [e for e in ids if 0 <= e < E]  # other ids count as unused slots


def emulate_notify(idx_per_rank, E: int, G: int, align: int, worst=None):
    """Every rank's slot positions [T][K] and rank positions [T][R] as the kernels hand them out,
    and what the exchange reports per rank (counts, padded totals, dropped rows)."""
    R = len(idx_per_rank)
    L, cols = E // R, E + R
    worst = worst or [0] * R
    ranks = []
    for idx in idx_per_rank:  # pass 1 (count kernel), then the exchange's first half
        T = len(idx)
        plan = P.notify_plan(T, G)
        assert plan["groups"] == G and plan["blocks"] % G == 0 and plan["chunks"] == plan["blocks"] * WARPS
        assert plan["scratch_rows"] <= P.NOTIFY_SCRATCH_ROWS
        counts = []
        for w in range(plan["chunks"]):
            _, t0, t1 = chunk_span(T, plan, w)
            c = [0] * cols
            for t in range(t0, t1):
                ids = valid_ids(idx[t], E)
                for e in ids:
                    c[e] += 1
                for d in {e // L for e in ids}:
                    c[E + d] += 1
            counts.append(c)
        prefix, btot = [], []  # scratch rows: chunk prefixes in their block, block totals
        for b in range(plan["blocks"]):
            run = [0] * cols
            for v in range(WARPS):
                prefix.append(run)
                run = [x + y for x, y in zip(run, counts[b * WARPS + v])]
            btot.append(run)
        per_group = plan["blocks"] // G
        bprefix, group_e, group_r = [None] * plan["blocks"], [], []
        for g in range(G):  # block totals -> prefixes inside the group; the group's totals published
            run = [0] * cols
            for b in range(g * per_group, (g + 1) * per_group):
                bprefix[b] = run
                run = [x + y for x, y in zip(run, btot[b])]
            group_e.append(run[:E])
            group_r.append(run[E:])
        ranks.append(dict(idx=idx, T=T, plan=plan, prefix=prefix, bprefix=bprefix, group_e=group_e, group_r=group_r))

    for rank, me in enumerate(ranks):  # the exchange's second half, on each rank
        col_e = [[sum(ranks[s]["group_e"][g][e] for s in range(R)) for e in range(E)] for g in range(G)]
        col_r = [[sum(ranks[s]["group_r"][g][d] for s in range(R)) for d in range(R)] for g in range(G)]
        tot = [sum(col_e[g][e] for g in range(G)) for e in range(E)]
        incl = list(itertools.accumulate(pad(t, align) for t in tot))
        seg = [incl[e] - pad(tot[e], align) - (incl[e // L * L - 1] if e // L * L > 0 else 0) for e in range(E)]
        base = []
        for g in range(G):
            row = [seg[e] + sum(col_e[h][e] for h in range(g)) + sum(ranks[s]["group_e"][g][e] for s in range(rank))
                   for e in range(E)]
            row += [sum(col_r[h][d] for h in range(g)) + sum(ranks[s]["group_r"][g][d] for s in range(rank))
                    for d in range(R)]
            base.append(row)
        W = worst[rank]
        n_mine = sum(col_r[g][rank] for g in range(G))
        dropped = 0
        for le in range(L):
            e = rank * L + le
            dropped += max(0, seg[e] + tot[e] - max(seg[e], W)) if W else 0
        me.update(base=base, tot=tot, seg=seg, n_mine=n_mine, dropped_perm=dropped,
                  dropped_rank=max(0, n_mine - W) if W else 0,
                  m_mine=incl[rank * L + L - 1] - (incl[rank * L - 1] if rank else 0))

    for me in ranks:  # pass 2 (positions kernel)
        T, idx, plan = me["T"], me["idx"], me["plan"]
        K = len(idx[0]) if T else 0
        slot_pos = [[-1] * K for _ in range(T)]
        rank_pos = [[-1] * R for _ in range(T)]
        for w in range(plan["chunks"]):
            g, t0, t1 = chunk_span(T, plan, w)
            b = w // WARPS
            run = [x + y + z for x, y, z in zip(me["prefix"][w], me["bprefix"][b], me["base"][g])]
            for t in range(t0, t1):
                for k, e in enumerate(idx[t]):
                    if 0 <= e < E:
                        slot_pos[t][k] = run[e]
                        run[e] += 1
                for d in sorted({e // L for e in valid_ids(idx[t], E)}):
                    rank_pos[t][d] = run[E + d]
                    run[E + d] += 1
        me.update(slot_pos=slot_pos, rank_pos=rank_pos)
    return ranks


def sorted_positions(idx_per_rank, E: int, G: int, align: int):
    """The intended order: per destination, a stable sort by (expert or rank, group, source rank,
    token); expert segments padded to `align`, starting at 0 in each destination rank."""
    R = len(idx_per_rank)
    L = E // R
    group = lambda s, t: t // (len(idx_per_rank[s]) // G)  # noqa: E731
    slot = [[[-1] * len(ids) for ids in idx] for idx in idx_per_rank]
    rank = [[[-1] * R for _ in idx] for idx in idx_per_rank]
    for d in range(R):
        off = 0
        for e in range(d * L, (d + 1) * L):
            rows = sorted((group(s, t), s, t, k) for s, idx in enumerate(idx_per_rank) for t, ids in enumerate(idx)
                          for k, x in enumerate(ids) if x == e)
            for i, (_, s, t, k) in enumerate(rows):
                slot[s][t][k] = off + i
            off += pad(len(rows), align)
        rows = sorted((group(s, t), s, t) for s, idx in enumerate(idx_per_rank) for t, ids in enumerate(idx)
                      if any(d * L <= x < (d + 1) * L for x in ids))
        for i, (_, s, t) in enumerate(rows):
            rank[s][t][d] = i
    return slot, rank


def routing(rng, T: int, K: int, E: int, hot: int = -1, unused: float = 0.2):
    """T tokens of K distinct ids (or -1, or an id >= E: unused slots); `hot` takes most tokens."""
    idx = []
    for _ in range(T):
        ids = rng.sample(range(E), K)
        if hot >= 0 and hot not in ids and rng.random() < 0.8:
            ids[rng.randrange(K)] = hot
        ids = [-1 if rng.random() < unused else e for e in ids]
        if rng.random() < 0.05:
            ids[rng.randrange(K)] = E + rng.randrange(3)  # out of range: counts as unused
        idx.append(ids)
    return idx


CASES = [  # R, E, K, G, align, tokens per rank (multiples of G; 0: an empty rank), hot expert
    (1, 4, 2, 1, 1, [37], -1),
    (2, 8, 3, 1, 4, [100, 0], 3),
    (2, 8, 3, 2, 1, [64, 18], -1),
    (2, 4, 2, 4, 8, [40, 0], 1),
    (4, 16, 4, 3, 2, [9, 30, 0, 3], 5),
    (4, 8, 2, 4, 16, [600, 1204, 8, 0], 0),  # several blocks per group
    (8, 16, 4, 2, 1, [16, 2, 40, 6, 0, 30, 2, 10], 15),
    (8, 32, 8, 8, 4, [64, 8, 0, 128, 16, 24, 8, 8], 9),
    (2, 8, 2, 2, 1, [4000, 3000], 2),  # a group's blocks capped: chunks longer than the minimum
    (3, 6, 2, 5, 2, [20, 5, 0], -1),
]


@pytest.mark.parametrize("R, E, K, G, align, tokens, hot", CASES)
def test_positions_follow_group_order(R, E, K, G, align, tokens, hot):
    rng = random.Random(hash((R, E, G, tuple(tokens))) & 0xFFFF)
    idx_per_rank = [routing(rng, T, K, E, hot) for T in tokens]
    ranks = emulate_notify(idx_per_rank, E, G, align)
    slot, rank = sorted_positions(idx_per_rank, E, G, align)
    L = E // R
    for s, me in enumerate(ranks):
        assert me["slot_pos"] == slot[s], f"expert-major positions of rank {s}"
        assert me["rank_pos"] == rank[s], f"rank-major positions of rank {s}"
    for d, me in enumerate(ranks):  # what does not depend on the groups: the per-expert totals
        real = [sum(1 for idx in idx_per_rank for ids in idx for x in ids if x == e) for e in range(E)]
        assert me["tot"] == real
        assert me["n_mine"] == sum(1 for r in rank for row in r if row[d] >= 0)
        assert me["m_mine"] == sum(pad(real[e], align) for e in range(d * L, (d + 1) * L))


@pytest.mark.parametrize("R, E, K, G, align, tokens, hot", CASES[4:8])
def test_worst_case_drops_are_the_rows_past_it(R, E, K, G, align, tokens, hot):
    """With num_worst_tokens W the rows delivered are those at positions < W: the exchange's
    drop counts (unchanged by the groups) are the real rows at W or past it in the group order."""
    rng = random.Random(7 + G)
    idx_per_rank = [routing(rng, T, K, E, hot) for T in tokens]
    worst = [rng.randrange(1, 40) for _ in range(R)]
    ranks = emulate_notify(idx_per_rank, E, G, align, worst)
    L = E // R
    for d, me in enumerate(ranks):
        W = worst[d]
        past_slots = sum(1 for r in ranks for row, ids in zip(r["slot_pos"], r["idx"]) for p, x in zip(row, ids)
                         if p >= W and d * L <= x < (d + 1) * L)
        past_rows = sum(1 for r in ranks for row in r["rank_pos"] if row[d] >= W)
        assert me["dropped_perm"] == past_slots
        assert me["dropped_rank"] == past_rows


@pytest.mark.parametrize("N, Pn, mt, L, K, align", [(2, 2, 8, 2, 2, 1), (3, 2, 12, 1, 2, 4), (4, 1, 6, 2, 3, 2),
                                                   (2, 4, 20, 2, 4, 8)])
def test_intranode_stage_delivers_the_contract_order(N, Pn, mt, L, K, align):
    """The internode path's intranode stage: forwarder p of node m holds, at row n * mt + t, token t
    of source rank (n, p) (node-local ids, -1 past that source's T or off node m); with one token
    group per source node, every destination's rows come in the contract's order: (expert or
    rank, global source rank n * P + p, token)."""
    rng = random.Random(N * 100 + Pn * 10 + mt)
    R, E = N * Pn, N * Pn * L
    T = [rng.choice([0, mt // 2, mt - 1, mt]) for _ in range(R)]
    glob = [routing(rng, T[r], K, E, hot=rng.randrange(E), unused=0.1) for r in range(R)]
    for m in range(N):  # node m's intranode stage
        first, E_node = m * Pn * L, Pn * L
        fwd = []
        for p in range(Pn):
            rows = [[-1] * K for _ in range(N * mt)]
            for n in range(N):
                for t, ids in enumerate(glob[n * Pn + p]):
                    rows[n * mt + t] = [x - first if first <= x < first + E_node else -1 for x in ids]
            fwd.append(rows)
        ranks = emulate_notify(fwd, E_node, N, align)
        for q in range(Pn):  # destination rank (m, q): the contract's rows, in its order
            off = 0
            for le in range(L):
                e = first + q * L + le
                rows = [(s, t, k) for s in range(R) for t, ids in enumerate(glob[s]) for k, x in enumerate(ids) if x == e]
                for i, (s, t, k) in enumerate(rows):  # already sorted by (source rank, token)
                    n, p = divmod(s, Pn)
                    assert ranks[p]["slot_pos"][n * mt + t][k] == off + i
                off += pad(len(rows), align)
            lo, hi = first + q * L, first + (q + 1) * L
            rows = [(s, t) for s in range(R) for t, ids in enumerate(glob[s]) if any(lo <= x < hi for x in ids)]
            for i, (s, t) in enumerate(rows):
                n, p = divmod(s, Pn)
                assert ranks[p]["rank_pos"][n * mt + t][q] == i


def old_plan(T: int) -> dict:
    """The plan before token groups (one group): what G = 1 must still give."""
    max_chunks = (P.MAX_NOTIFY_BLOCKS - 1) // (WARPS + 1) * WARPS
    chunks = min(max(-(-T // 16), 1), max_chunks)
    blocks = -(-chunks // WARPS)
    chunks = blocks * WARPS
    return dict(blocks=blocks, chunks=chunks, chunk=max(-(-T // chunks), 1))


def test_plan_fits_the_scratch_and_covers_every_token():
    for T in list(range(0, 300)) + [1000, 4095, 4096, 4097, 8192, 28672, 65536, 10**6]:
        plan = P.notify_plan(T, 1)
        assert {k: plan[k] for k in ("blocks", "chunks", "chunk")} == old_plan(T), T
    for G in range(1, P.MAX_TOKEN_GROUPS + 1):
        for Tg in (0, 1, 7, 16, 128, 129, 1000, 4096, 65536):
            plan = P.notify_plan(G * Tg, G)
            assert plan["groups"] == G and plan["blocks"] % G == 0 and plan["blocks"] >= G
            assert plan["chunks"] == plan["blocks"] * WARPS
            assert plan["scratch_rows"] == plan["chunks"] + plan["blocks"] + G <= P.NOTIFY_SCRATCH_ROWS
            assert plan["chunks"] // G * plan["chunk"] >= Tg  # a group's chunks cover its tokens
            spans = [chunk_span(G * Tg, plan, w) for w in range(plan["chunks"])]
            covered = [t for _, a, b in spans for t in range(a, b)] if Tg <= 1000 else None
            if covered is not None:
                assert covered == list(range(G * Tg))  # each token once, in order
                assert all(a // Tg == g for g, a, b in spans if b > a)  # no chunk straddles a group


def test_token_groups_limit_is_the_protocols():
    from megatron_ep.core import protocol

    assert protocol.MAX_TOKEN_GROUPS == P.MAX_TOKEN_GROUPS and protocol.notify_plan(64, 4) == P.notify_plan(64, 4)
    assert P.NOTIFY_SCRATCH_ROWS == max(P.MAX_NOTIFY_BLOCKS, P.MAX_TOKEN_GROUPS * (WARPS + 2))
    try:  # the internode path takes one group per node
        from megatron_ep.backends.cuda.extension import load_nvshmem

        assert load_nvshmem().INTERNODE_MAX_NODES <= P.MAX_TOKEN_GROUPS
    except RuntimeError:
        pass  # _C_nvshmem is not built here
