"""FP8 copies of the expert weights for DeepGEMM's FP8 GEMMs: the 128x128-block cast, and a cache
of it for weights that do not change.

DeepGEMM's FP8 grouped GEMMs take the weights as FP8 with one fp32 scale per 128x128 block
(`per_block_cast_to_fp8`). Casting them at every call costs more than the GEMM itself (on one
H200, fc1's cast at 32 local experts takes tens of milliseconds against 1.5 ms for its GEMM).
Where the weights do not change across calls (decode steps, the micro-batches between two
optimizer steps), the cast can be kept and reused:

    with fp8_weights.frozen():      # the caller promises: no weight changes inside
        for step in decode_steps: ...

Off by default, because torch cannot tell reliably whether a weight changed: Megatron's
optimizers write parameters through other tensors that share their memory (`param.data.copy_`,
the contiguous parameter buffers of its distributed optimizer), and such writes move neither the
parameter's version counter nor its data pointer. Inside `frozen()` (or with `enabled = True`,
`clear()` after every weight update) an entry is still dropped when the weight visibly changes:
* another tensor or view: entries hang off the weight's base tensor (weakly: they go with the
  parameter) and its view (storage offset, shape, strides, dtype);
* an in-place write through the weight or a view of it (its version counter, shared by views);
* new storage (`param.data = other`: its data pointer).
Never cached: weights under CUDA-graph capture (a cast made there belongs to the graph's memory
pool) and tensors without a version counter (inference-mode tensors). Memory: one FP8 copy (half
a bf16 weight) per weight tensor cast, until `clear()` (which `frozen()` calls at its end).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch

from ..core.fp8 import CAST_CHUNK_ELEMS, FP8_MAX

Fp8 = Tuple[torch.Tensor, torch.Tensor]


def per_block_cast_to_fp8(w: torch.Tensor, block: int = 128) -> Fp8:
    """w [G, N, K] -> (fp8 [G, N, K], scales [G, ceil(N/128), ceil(K/128)] fp32), 128x128 blocks:
    amax = max(|w|) of the block in fp32 (float64 rounded to fp32 first), floored at 1e-4, scale =
    amax / 448, fp8 = e4m3(w / scale), both fp32 divisions. The fp32 copy (zero-padded to whole
    blocks) is made for a bounded chunk of whole blocks at a time (experts, or 128-row groups of
    one expert), never for all of w."""
    G, N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    q = torch.empty((G, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((G, nb, kb), dtype=torch.float32, device=w.device)
    one = nb * block * kb * block  # one expert's padded elements
    gs = max(1, CAST_CHUNK_ELEMS // one) if one else G
    rows = nb * block if one <= CAST_CHUNK_ELEMS else block * max(1, CAST_CHUNK_ELEMS // (block * kb * block))
    for g0 in range(0, G, gs):
        g1 = min(G, g0 + gs)
        for r0 in range(0, max(N, 1), rows):
            r1 = min(N, r0 + rows)
            pn = -(r1 - r0) % block
            wp = torch.nn.functional.pad(w[g0:g1, r0:r1].float(), (0, kb * block - K, 0, pn))
            blocks = wp.view(g1 - g0, (r1 - r0 + pn) // block, block, kb, block)
            amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4)
            s = amax / FP8_MAX
            q[g0:g1, r0:r1] = (blocks / s).to(torch.float8_e4m3fn).view(g1 - g0, r1 - r0 + pn, kb * block)[:, :r1 - r0, :K]
            scale[g0:g1, r0 // block:r0 // block + blocks.shape[1]] = s.view(g1 - g0, -1, kb)
    return q, scale


enabled = False  # frozen() turns it on for a scope

# id(base) -> (weakref to base, {view key: (version, data_ptr, (fp8, scales))})
_entries: Dict[int, Tuple[weakref.ref, dict]] = {}


def _forget(base_id: int):
    return lambda _ref: _entries.pop(base_id, None)


def _version(w: torch.Tensor) -> Optional[int]:
    try:
        return w._version
    except RuntimeError:  # inference-mode tensors track no version
        return None


def fp8_weights(w: torch.Tensor) -> Fp8:
    """`per_block_cast_to_fp8(w)`, from the cache while `w` holds the values it was cast from."""
    version = _version(w)
    if not enabled or version is None or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return per_block_cast_to_fp8(w)
    base = w._base if w._base is not None else w
    view = (w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype)
    held = _entries.get(id(base))
    if held is None or held[0]() is not base:
        held = _entries[id(base)] = (weakref.ref(base, _forget(id(base))), {})
    views = held[1]
    hit = views.get(view)
    if hit is not None and hit[0] == version and hit[1] == w.data_ptr():
        return hit[2]
    cast = per_block_cast_to_fp8(w)
    views[view] = (version, w.data_ptr(), cast)
    return cast


@contextmanager
def frozen():
    """Reuse weight casts inside the scope (the caller's promise: no weight changes there); drop
    them at its end."""
    global enabled
    before = enabled
    enabled = True
    try:
        yield
    finally:
        enabled = before
        clear()


def clear() -> None:
    """Drop every cached cast (their memory goes back to torch's allocator)."""
    _entries.clear()


def cached_bytes() -> int:
    """Bytes the cached casts hold (FP8 data and scales)."""
    return sum(q.numel() * q.element_size() + s.numel() * s.element_size()
               for _, views in _entries.values() for _, _, (q, s) in views.values())
