"""One small case of each cuda path -- intranode, internode (two nodes of one rank), low-latency --
in one pool of two ranks: what scripts/gate/gpu_check.sh runs under compute-sanitizer (one pool
start-up under the tool instead of one per path). The same cases run in the paths' own suites."""

import cases
from case_lists import normal_cases
from distpool import flat
from gpu_pools import GPU_MARKS, run_alone
from test_cuda_low_latency import ll_cases_for

pytestmark = GPU_MARKS


def test_one_case_of_each_path():
    # the NVSHMEM heap sized for both NVSHMEM paths up front (the first user would size it for itself)
    errors = flat(run_alone(2, cases.run_one_case_of_each_path, normal_cases(2)[0], ll_cases_for(2)[0], timeout=600,
                            NVSHMEM_SYMMETRIC_SIZE="1G", NVSHMEM_DISABLE_NCCL="1", NVSHMEM_DISABLE_MNNVL="1"))
    assert not errors, "\n".join(errors[:20])
