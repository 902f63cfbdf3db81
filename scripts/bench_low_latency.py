"""Benchmark of the low-latency (decode) path (a script, not a test).

R processes, decode shape: T tokens per rank (a comma list, default 128,32,1), hidden 7168, top-8
of 256 experts (uniform random routing, distinct experts per token), FP8 dispatch (--bf16-dispatch: bf16 rows), bf16 combine.
Rank r runs on GPU r % (GPUs visible): one process per GPU when there are enough GPUs, else
virtual ranks sharing a GPU (run those under MPS, docs/design.md §5). Each implementation runs in its own
set of processes (DeepEP and ours both start NVSHMEM, once per process):

  ours     megatron_ep's cuda low-latency path (public API): dispatch, combine, dispatch+combine,
           and dispatch+combine with recv hooks (send half, then the hook), each captured as a
           CUDA graph of --loop back-to-back calls (GPU time, no Python launch overhead; the
           kernels' own signals keep the ranks in step)
  torch    the torch backend's low-latency path over NCCL (eager: it syncs with the host)
  nccl     all_to_all_single of the same messages (one FP8 message of H + H/128*4 + 16 bytes per
           valid (token, expert), 2H bf16 bytes back), splits known in advance (eager)
  deepep   DeepEP V1's low-latency kernels, if `deep_ep` imports (never part of this repository):
           eager loops of the same four calls (its graph capture failed here; the table marks
           these rows "eager": at 1-32 tokens they include its host launch overhead)
torch, nccl and deepep need one GPU per process (NCCL refuses several ranks on one GPU).

Kernel time (ours and deepep): the kernels of about --kernel-iters calls under torch.profiler (ours:
replays of the CUDA graphs above; deepep: eager calls), median per kernel (DeepEP's own
accounting), with the hook's send and receive halves apart.

Each figure is the median over --reps repetitions of (time of --loop back-to-back calls) / loop,
timed with CUDA events after --warmup calls. GB/s is DeepEP's accounting per rank: valid
(token, expert) pairs x (H + H/128*4 + 16) bytes for dispatch, x 2H for combine, / time.

    python3 scripts/bench_low_latency.py --ranks 2 --markdown /tmp/ll.md   # 2 GPUs, one rank each
    python3 scripts/bench_low_latency.py --ranks 4                         # one GPU under MPS
    python3 scripts/bench_low_latency.py --smoke                           # CPU: checks the script
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's megatron_ep, the bench package beside this file

from bench import low_latency  # noqa: E402


def parse(argv=None):
    return low_latency.parse(argv, description=__doc__.split("\n")[0])


def main():
    sys.exit(low_latency.main(parse()))


if __name__ == "__main__":
    main()
