"""Megatron-LM's own token-dispatcher tests (`TestFlexDispatcher`, its deepep cases) with
Megatron's own `_DeepepManager` on megatron_ep.deep_ep and our CUDA kernels: 8 virtual ranks of
one GPU under MPS, through tests/support/run_megatron_tests.py --deep-ep --gpu, on the Megatron-LM tree
MEGATRON_LM_DIR (scripts/env/megatron_lm_tree.sh, which exports the test files beside megatron/).
The gate's `e2e` mode runs it after tests/megatron/test_megatron_lm.py. The same run on CPU processes (the
torch backend) is `python tests/support/run_megatron_tests.py <tree> --deep-ep` (docs/deep-ep.md)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"),
                                 reason="needs a Megatron-LM tree: MEGATRON_LM_DIR (scripts/env/megatron_lm_tree.sh)")]

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_FILE = "tests/unit_tests/transformer/moe/test_token_dispatcher.py"


@pytest.mark.limit(600)
def test_megatrons_flex_dispatcher_tests_on_our_deep_ep_kernels():
    tree = os.environ["MEGATRON_LM_DIR"]
    if not os.path.isfile(os.path.join(tree, TEST_FILE)):
        pytest.skip(f"{tree} has no {TEST_FILE}: make the tree again with scripts/env/megatron_lm_tree.sh")
    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "support", "run_megatron_tests.py"), tree, "--deep-ep", "--gpu",
                        "-k", "TestFlexDispatcher and deepep", "--timeout", "540"],
                       capture_output=True, text=True, timeout=580)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"Megatron's TestFlexDispatcher on megatron_ep.deep_ep failed:\n{out[-8000:]}"
    summaries = [ln for ln in r.stdout.splitlines() if ln.startswith("rank ")]
    assert len(summaries) == 8 and all(" passed" in ln for ln in summaries), "\n".join(summaries)
