"""DeepEP's Python API (`deep_ep`) on megatron_ep's kernels: code written for DeepEP runs on ours.
V1 (deepseek-ai/DeepEP 567632d): `Buffer`, `EventOverlap`, `Config`, `topk_idx_t`, and
`deep_ep.utils.EventHandle`; V2 (dd758ca): `ElasticBuffer` and `EPHandle`. docs/deep-ep.md maps
each DeepEP call to ours and says what differs."""

import os

import torch

from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's default build (TOPK_IDX_BITS=64)

# The folder whose `deep_ep` package is this module: first on PYTHONPATH, unmodified `import
# deep_ep` code gets ours (`python -m megatron_ep.deep_ep --path` prints it).
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "SHIM_DIR", "topk_idx_t"]
