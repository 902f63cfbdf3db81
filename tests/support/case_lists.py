"""The case matrix of the normal path, shared by the CPU suite and the GPU virtual-rank suite.

Covers: -1 slots, an empty rank, uneven T, all tokens to one expert, several experts of one
rank per token, K from 1 to 9, E/R in {1, 4, 32}, H in {128, 7168}, alignment in {1, 16, 128},
bf16 / fp32 / FP8, worst-case sized outputs.
"""

from __future__ import annotations

import torch


def _token_counts(seed: int, R: int, t_max: int, empty_rank: bool = True):
    g = torch.Generator().manual_seed(seed)
    Ts = torch.randint(0, t_max + 1, (R,), generator=g).tolist()
    if R > 1 and empty_rank:
        Ts[(seed % (R - 1)) + 1] = 0
    if sum(Ts) == 0:
        Ts[0] = t_max
    return Ts


def normal_cases(R: int, t_max: int = 24, big_t_max: int = 10):
    spec = [
        # (E/R, K, H, align, dtype, pattern, p_drop)
        (4, 4, 128, 1, "bf16", "random", 0.2),
        (4, 6, 256, 16, "fp8", "random", 0.2),
        (32, 8, 7168, 128, "bf16", "random", 0.1),
        (1, 2, 7168, 1, "fp8", "random", 0.3),
        (4, 3, 128, 16, "bf16", "one_expert", 0.0),
        (32, 9, 128, 128, "bf16", "same_rank", 0.2),
        (1, 1, 128, 1, "bf16", "random", 0.0),
        (4, 5, 384, 16, "fp32", "random", 0.3),
        (1, 9, 128, 16, "bf16", "random", 0.1),
        (4, 4, 128, 1, "bf16", "random", 1.0),  # every slot -1
        (32, 2, 128, 1, "fp8", "same_rank", 0.0),
    ]
    cases = []
    for i, (epr, K, H, align, dtype, pattern, p_drop) in enumerate(spec):
        seed = 1000 * R + i
        Ts = _token_counts(seed, R, big_t_max if H >= 7168 else t_max)
        cases.append(dict(seed=seed, E=epr * R, K=K, H=H, align=align, dtype=dtype, pattern=pattern, p_drop=p_drop, Ts=Ts))
    # worst-case sized outputs (the CUDA-graph mode), and a case where only one rank has tokens
    seed = 1000 * R + 50
    Ts = _token_counts(seed, R, t_max)
    E, K, align = 4 * R, 4, 16
    worst = sum(Ts) * min(K, E // R) + (E // R) * align
    cases.append(dict(seed=seed, E=E, K=K, H=256, align=align, dtype="bf16", pattern="random", p_drop=0.2, Ts=Ts, worst=worst))
    # num_worst_tokens below what arrives: the rows past it are dropped and counted
    seed = 1000 * R + 52
    Ts = _token_counts(seed, R, t_max, empty_rank=False)
    cases.append(dict(seed=seed, E=4 * R, K=4, H=256, align=4, dtype="bf16", pattern="random", p_drop=0.1, Ts=Ts,
                      worst=max(1, sum(Ts) // 3)))
    Ts = [0] * R
    Ts[R - 1] = t_max
    cases.append(dict(seed=1000 * R + 51, E=4 * R, K=3, H=128, align=1, dtype="bf16", pattern="random", p_drop=0.2, Ts=Ts))
    return cases


# Seeds of tests/cases.fuzz_config that once failed on the GPU: each runs first in test_fuzz.
FUZZ_REGRESSIONS: list = [
    # R = 8: E 16, K 6, H 256, fp32, worst-case sized (388 rows), on a buffer sized for H 7168 bf16.
    # The sizing merges row widths by bytes: the sync-free call fits the buffer's 14336-byte rows,
    # which a sizing that paired the largest hidden size with the largest element size (7168 x 4
    # bytes) would refuse.
    800000,
]
