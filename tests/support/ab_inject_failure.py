"""torchrun entry point for tests/tools/test_ab_throughput.py: scripts/ab_throughput.py with one
backend made to fail on one rank only.

AB_FAIL_BACKEND (a dispatcher: alltoall | deepep | hybridep) raises on rank AB_FAIL_RANK at step
AB_FAIL_STEP, after the step's collectives (so the other ranks are not left inside one): the
script must agree on the failure over all ranks, report that rank's error on rank 0, keep
running the other backends and exit non-zero. AB_SKEW_BACKEND (optional) scales that
backend's loss by 1.01 on every rank: its step-0 loss check must fail.
"""

import os
import sys

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts"))

import ab_throughput  # noqa: E402

FAIL_BACKEND = os.environ["AB_FAIL_BACKEND"]
FAIL_RANK = int(os.environ.get("AB_FAIL_RANK", "1"))
FAIL_STEP = int(os.environ.get("AB_FAIL_STEP", "1"))
SKEW_BACKEND = os.environ.get("AB_SKEW_BACKEND")


def failing(step_fn):
    def step(state, index):
        out = step_fn(state, index)
        if state.args.dispatcher == SKEW_BACKEND:
            out = (out[0] * 1.01, out[1])
        if state.args.dispatcher == FAIL_BACKEND and index == FAIL_STEP and dist.get_rank() == FAIL_RANK:
            raise RuntimeError(f"injected failure: {FAIL_BACKEND} step {index} rank {FAIL_RANK}")
        return out

    return step


ab_throughput.layer_step = failing(ab_throughput.layer_step)
ab_throughput.train_moe.run_step = failing(ab_throughput.train_moe.run_step)

if __name__ == "__main__":
    sys.exit(ab_throughput.main())
