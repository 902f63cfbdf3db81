"""DeepEP V1's Python API (deepseek-ai/DeepEP 567632d, `deep_ep`) on megatron_ep's kernels: code
written for DeepEP runs on ours. `Buffer`, `EventOverlap`, `Config`, `topk_idx_t`, and
`deep_ep.utils.EventHandle`. The normal mode is here; docs/deep-ep.md maps each DeepEP call to
ours and says what differs."""

import torch

from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's default build (TOPK_IDX_BITS=64)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
