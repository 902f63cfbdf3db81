"""DeepEP V1's Python API (deepseek-ai/DeepEP 567632d, `deep_ep`) on megatron_ep's kernels: code
written for DeepEP runs on ours. `Buffer`, `EventOverlap`, `Config`, `topk_idx_t`, and
`deep_ep.utils.EventHandle`. The normal mode is here; docs/deep-ep.md maps each DeepEP call to
ours and says what differs."""

import os

import torch

from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's default build (TOPK_IDX_BITS=64)

# The folder whose `deep_ep` package is this module: first on PYTHONPATH, unmodified `import
# deep_ep` code gets ours (`python -m megatron_ep.deep_ep --path` prints it).
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "SHIM_DIR", "topk_idx_t"]
