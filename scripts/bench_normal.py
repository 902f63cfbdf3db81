"""Benchmark of the normal path: intranode, or internode on virtual nodes with --ranks-per-node
(a script, not a test).

R processes, each with the training shape: T tokens, hidden H, top-K of E experts (uniform
random routing), bf16 and FP8 dispatch, bf16 combine. Rank r runs on GPU r % (GPUs visible):
one process per GPU when there are enough GPUs, else virtual ranks sharing a GPU (run those
under MPS, docs/design.md §5). A gloo group is the control group (barriers, IPC-handle exchange); our
kernels and DeepEP's move the data themselves.

Measured in the same run, at every SM count of --num-sms (a comma list: an SM sweep):
  ours     megatron_ep's cuda backend (public API; phase timings and the notify kernel alone
           through two marked internal hooks, "n/a" when those are missing)
  deepep   DeepEP V1's intranode kernels at the same SM count (`deep_ep.Buffer.set_num_sms`),
           if `deep_ep` imports (built on the GPU machine from a fetched snapshot, never part
           of this repository)
and once (no SM knob: NCCL picks its own channels):
  nccl     what Megatron-core's alltoall dispatcher does (MoEAlltoAllTokenDispatcher, non-fused
           path, no Transformer Engine): one row per (token, expert) pair permuted by expert
           (`moe_utils.permute`: index_select), count all-gather + device-to-host sync,
           `all_to_all_single` of rows and probs, `sort_chunks_by_idxs` into local-expert order;
           combine = the reverse sort, the reverse all-to-all and `unpermute` (bf16 scatter_add_,
           as Megatron does). Also the same all-to-all over the rank-major rows ours and DeepEP
           send (one row per (token, rank) pair), the all-to-alls alone, and FP8-byte variants
           (uint8 rows of H + H/128*4 bytes). Needs one GPU per process (NCCL refuses several
           ranks on one GPU): "skipped (virtual ranks)" otherwise. Uses megatron-core's own
           moe_utils when it imports, else a copy of 0.16.1's non-fused code.
  copy     a plain device copy of the bytes this rank receives (the HBM roofline on one GPU)
  permute  an index_select of the received rows into the expert-major layout
Each op is timed two ways with CUDA events: "us" = median of --iters isolated calls (all ranks
released together by a gloo barrier), "us loop" = mean over --iters calls back to back (the
ops' own handshakes keep the ranks in step). Ops whose input must be refreshed before each call
(zero-copy combine) have only the isolated figure. GB/s is DeepEP's accounting: received rows x
row bytes / loop time (rows from the rank itself included; Megatron's rows for its own ops).

With --ranks-per-node: a "model check" per SM count -- megatron_ep.tools.model's exact per-link bytes
of this run's routing (equal to the bench's own RDMA count and to the rows delivered, or the run
fails), and a time check: per-SM rates of the RDMA hop, the intranode stage and the local reorder,
calibrated on one op's phase marks per direction (bf16 cached rank-major dispatch; rank-major
combine), predict the other ops from the exact rows (FP8, with notify, expert-major), and those
of the first SM count predict the others; plus the SM split if the two copy stages were fused.
Below --ranks the intranode path runs too (its per-SM rate, for context).

Output: a console table per SM count, the NCCL table, baseline checks (the NCCL paths deliver
exactly our rows), and a markdown table for docs/performance.md (--markdown FILE also writes it).

    python3 scripts/bench_normal.py --ranks 2 --num-sms 8,16,24            # 2 GPUs, one rank each
    python3 scripts/bench_normal.py --ranks 4 --num-sms 8,16,24            # one GPU under MPS
    python3 scripts/bench_normal.py --smoke                                # CPU: checks the script
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's megatron_ep, the bench package beside this file

from bench import normal  # noqa: E402
from bench.model_check import model_check  # noqa: E402,F401  (tests/tools/test_model.py calls it through this file)


def parse(argv=None):
    return normal.parse(argv, description=__doc__)


def main():
    normal.main(parse())


if __name__ == "__main__":
    main()
