"""`import deep_ep` served by megatron_ep.deep_ep (DeepEP V1's Python API on our kernels).

Put this folder's parent on PYTHONPATH (its path: `python -m megatron_ep.deep_ep --path`).
Importing it says, once per process on stderr (rank 0), which implementation is in use, and
names a DeepEP install later on the path that it shadows."""

import importlib.machinery
import os
import sys

from megatron_ep.deep_ep import SHIM_DIR, Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, topk_idx_t
from megatron_ep.deep_ep import buffer, elastic, utils

_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != SHIM_DIR]
_real = importlib.machinery.PathFinder.find_spec("deep_ep", _rest)

sys.modules[__name__ + ".utils"] = utils
sys.modules[__name__ + ".buffer"] = buffer
sys.modules[__name__ + ".elastic"] = elastic

if os.environ.get("RANK", "0") == "0":
    shadowed = f"; it shadows the DeepEP at {os.path.dirname(_real.origin)}" if _real is not None and _real.origin else ""
    print(f"deep_ep: megatron_ep's implementation (megatron_ep.deep_ep){shadowed}", file=sys.stderr, flush=True)

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "topk_idx_t"]
