"""Argument checks, in the spirit of TORCH_CHECK: every public call validates its inputs here
and raises TypeError (wrong kind or dtype) or ValueError (wrong shape or value) naming the
argument, before any communication or kernel runs."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import envs
from .protocol import FP8_BLOCK, MAX_ALIGNMENT, MAX_TOPK  # one owner: csrc/common/protocol.h
from .types import Activation, EventOverlap

FP8_DTYPE = torch.float8_e4m3fn
ACT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
WEIGHT_DTYPES = (torch.float32, torch.float64)
# Upper bounds that keep every count in the int32 the kernels index with, and far above any
# model: a value past them is a mistake, reported here rather than as an allocator's error.
MAX_NUM_EXPERTS = 1 << 20
MAX_ROWS = (1 << 31) - 1
# the fixed receive area of one low-latency call per rank, both buffer sets (both backends; MEGATRON_EP_LL_MAX_BYTES)
MAX_LOW_LATENCY_BYTES = envs.integer("MEGATRON_EP_LL_MAX_BYTES", 32 << 30, minimum=1)


def fail(cond: bool, msg: str, exc=ValueError) -> None:
    if not cond:
        raise exc(msg)


def check_int(name: str, value, minimum: int = 0, maximum: Optional[int] = None) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not (maximum is None or value <= maximum):
        raise ValueError(f"{name}={value} is above {maximum}")
    return value


def check_bool(name: str, value, allow_none: bool = False) -> Optional[bool]:
    """A flag must be a bool (a string such as "False" is not: it would read as true)."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise TypeError(f"{name} must be a bool{' or None' if allow_none else ''}, got {type(value).__name__} {value!r}")
    return value


def check_event(name: str, event) -> None:
    """None or an EventOverlap (what an asynchronous call returns as `.event`)."""
    if not (event is None or isinstance(event, EventOverlap)):
        raise TypeError(f"{name} must be an EventOverlap (the .event of an "
                        f"asynchronous call) or None, got {type(event).__name__}")


def is_fp8_tuple(x) -> bool:
    return isinstance(x, tuple)


def check_activation(name: str, x: Activation, allowed=ACT_DTYPES) -> Tuple[int, int, bool]:
    """Validate x (tensor or fp8 tuple); returns (T, H, is_fp8)."""
    if is_fp8_tuple(x):
        if len(x) != 2:
            raise TypeError(f"{name}: an FP8 input is a tuple (x_fp8 [T, H], scales [T, H/128]), got {len(x)} items")
        data, scales = x
        if not (isinstance(data, torch.Tensor) and isinstance(scales, torch.Tensor)):
            raise TypeError(f"{name}: FP8 tuple items must be tensors")
        if data.dtype != FP8_DTYPE:
            raise TypeError(f"{name}[0] must be {FP8_DTYPE}, got {data.dtype}")
        if scales.dtype != torch.float32:
            raise TypeError(f"{name}[1] (scales) must be torch.float32, got {scales.dtype}")
        if data.dim() != 2:
            raise ValueError(f"{name}[0] must be 2-D [T, H], got shape {tuple(data.shape)}")
        T, H = data.shape
        if H < 1:
            raise ValueError(f"{name} has hidden size 0: rows need at least one channel")
        if H % FP8_BLOCK != 0:
            raise ValueError(f"{name}: hidden size {H} must be a multiple of {FP8_BLOCK} for FP8")
        if tuple(scales.shape) != (T, H // FP8_BLOCK):
            raise ValueError(f"{name}[1] (scales) must have shape {(T, H // FP8_BLOCK)}, got {tuple(scales.shape)}")
        if not (data.is_contiguous() and scales.is_contiguous()):
            raise ValueError(f"{name}: FP8 data and scales must be contiguous")
        if data.device != scales.device:
            raise ValueError(f"{name}: FP8 data and scales are on different devices")
        return T, H, True
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, or a tuple (x_fp8 [T, H], scales [T, H/128]) for FP8, "
                        f"got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in allowed]}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} has hidden size 0: rows need at least one channel")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return x.shape[0], x.shape[1], False


def act_device(x: Activation) -> torch.device:
    return x[0].device if is_fp8_tuple(x) else x.device


def check_topk_idx(topk_idx, num_tokens: int, device: torch.device) -> int:
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be torch.int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D [T, K], got shape {tuple(topk_idx.shape)}")
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {num_tokens} tokens")
    fail(topk_idx.shape[1] >= 1, "topk_idx must have at least one column (K >= 1)")
    fail(topk_idx.is_contiguous(), "topk_idx must be contiguous")
    if topk_idx.device != device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but x is on {device}")
    return topk_idx.shape[1]


def check_topk_weights(topk_weights, num_tokens: int, topk: int, device: torch.device, allowed=WEIGHT_DTYPES) -> None:
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
    if topk_weights.dtype not in allowed:
        raise TypeError(f"topk_weights must have dtype in {[str(d) for d in allowed]}, got {topk_weights.dtype}")
    if topk_weights.dim() != 2:
        raise ValueError(f"topk_weights must be 2-D [T, K], got shape {tuple(topk_weights.shape)}")
    if topk_weights.shape[0] != num_tokens:
        raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows but x has {num_tokens} tokens")
    if topk_weights.shape[1] != topk:
        raise ValueError(f"K mismatch: topk_idx has K={topk} but topk_weights has {topk_weights.shape[1]} columns")
    fail(topk_weights.is_contiguous(), "topk_weights must be contiguous")
    if topk_weights.device != device:
        raise ValueError(f"topk_weights is on {topk_weights.device} but x is on {device}")


NO_BIAS = (None, None)


def check_bias(bias, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
    """A combine's `bias`: None, a tensor, or a tuple of two, each [T, H] of x's dtype and device,
    contiguous (the fp32 sum of a token starts at them). Returns (bias0, bias1), None where absent."""
    if bias is None:
        return NO_BIAS
    if isinstance(bias, torch.Tensor):
        parts = (bias,)
    elif isinstance(bias, tuple) and len(bias) == 2:
        parts = bias
    else:
        raise TypeError(f"bias must be None, a tensor or a tuple of two tensors, got "
                        f"{type(bias).__name__}{f' of {len(bias)}' if isinstance(bias, (tuple, list)) else ''}")
    for i, b in enumerate(parts):
        name = "bias" if len(parts) == 1 else f"bias[{i}]"
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(b).__name__}")
        if b.dtype != dtype:
            raise TypeError(f"{name} must have x's dtype {dtype}, got {b.dtype}")
        if tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"{name} must have shape {(num_tokens, hidden)} (the dispatch's tokens, x's hidden), "
                             f"got {tuple(b.shape)}")
        if b.device != device:
            raise ValueError(f"{name} is on {b.device} but x is on {device}")
        fail(b.is_contiguous(), f"{name} must be contiguous")
    return (parts[0], parts[1] if len(parts) == 2 else None)


def check_alignment(alignment) -> int:
    check_int("expert_alignment", alignment, 1)
    if alignment > MAX_ALIGNMENT:
        raise ValueError(f"expert_alignment={alignment} is above {MAX_ALIGNMENT}: every expert segment would "
                         f"carry up to that many zero rows")
    return alignment


def check_num_experts(num_experts, num_ranks: int) -> int:
    check_int("num_experts", num_experts, 1, MAX_NUM_EXPERTS)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the group size {num_ranks}")
    return num_experts


# Buffer(check_inputs=...) as a level (DispatchRequest.check_ids carries it to the backends)
IDS_UNCHECKED, IDS_CHECKED_FREE, IDS_CHECKED = 0, 1, 2


def check_inputs_level(value) -> int:
    """Buffer(check_inputs=...): True checks the expert ids' values in every call that takes new
    ids (where no kernel reads them anyway, at the cost of a device->host sync), "no_sync" only
    where no sync is added (the cuda intranode path's notify; the torch backend, whose dispatch
    syncs for its counts anyway), False nowhere."""
    if value is True:
        return IDS_CHECKED
    if value is False:
        return IDS_UNCHECKED
    if value == "no_sync":
        return IDS_CHECKED_FREE
    raise TypeError(f"check_inputs must be True, False or 'no_sync', got {value!r}")


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _id_out_of_range(v: int, num_experts: int) -> str:
    return (f"topk_idx contains {v}; expert ids must be >= -1 (-1 marks an unused slot)" if v < -1 else
            f"topk_idx contains expert id {v} >= num_experts={num_experts}")


def _id_repeated(topk_idx: torch.Tensor, row: int) -> str:
    return f"topk_idx row {row} names the same expert twice: {topk_idx[row].tolist()}"


def check_topk_values(topk_idx: torch.Tensor, num_experts: int, previous_event=None) -> None:
    """Range and duplicate checks; costs one device->host sync on GPU, skipped under graph capture.
    `previous_event`: the ids are ready there (maybe on another stream), so the host waits for it."""
    if topk_idx.numel() == 0 or capturing():
        return
    if getattr(previous_event, "event", None) is not None:
        previous_event.event.synchronize()
    if (topk_idx.is_cuda and topk_idx.dtype == torch.int64 and topk_idx.is_contiguous()
            and topk_idx.shape[1] <= MAX_TOPK):
        from ..backends.cuda import extension  # (only for CUDA tensors: this module stays backend-neutral)

        if extension.available():
            # the same rule in one kernel (csrc/intranode/layout.cu launch_check_ids): one launch, one sync
            slot = extension.load().first_bad_id(topk_idx=topk_idx, num_experts=num_experts)
            if slot >= 0:
                raise bad_slot_error(topk_idx, slot, num_experts)
            return
    parts = [topk_idx.min(), topk_idx.max()]
    if topk_idx.shape[1] > 1:
        s = topk_idx.sort(dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
        parts.append(torch.where(dup.any(), dup.int().argmax(), -1))  # the first repeating row, or -1
    lo, hi, *rest = torch.stack(parts).tolist()  # one sync for every figure
    fail(lo >= -1, _id_out_of_range(lo, num_experts))
    fail(hi < num_experts, _id_out_of_range(hi, num_experts))
    if rest and rest[0] >= 0:
        raise ValueError(_id_repeated(topk_idx, rest[0]))


def bad_slot_error(topk_idx: torch.Tensor, slot: int, num_experts: int) -> ValueError:
    """The error for topk_idx's first bad slot (token * K + k) a kernel found: an id out of range,
    or an expert an earlier slot of its token names (check_topk_values's wording)."""
    K = topk_idx.shape[1]
    v = int(topk_idx[slot // K, slot % K])
    if v < -1 or v >= num_experts:
        return ValueError(_id_out_of_range(v, num_experts))
    return ValueError(_id_repeated(topk_idx, slot // K))


def check_token_limit(num_tokens: int, limit: Optional[int], what: str = "max_tokens_per_rank") -> None:
    if limit is not None:
        if num_tokens > limit:
            raise ValueError(f"x has {num_tokens} tokens, more than the buffer was sized for ({what}={limit})")


def check_low_latency_capacity(max_tokens_per_rank, num_experts: int, hidden: int, elem_bytes: int) -> int:
    """max_tokens_per_rank fixes the receive area, [E_local, R * max_tokens_per_rank, H] on every
    rank (E * max_tokens_per_rank * H elements): bounded before anything is allocated."""
    check_int("max_tokens_per_rank", max_tokens_per_rank, 1, MAX_ROWS)
    nbytes = num_experts * max_tokens_per_rank * hidden * elem_bytes
    if nbytes > MAX_LOW_LATENCY_BYTES:
        raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: the receive area of {num_experts} experts x "
                         f"{max_tokens_per_rank} tokens x hidden {hidden} would take {nbytes / 2**30:.1f} GiB per rank, above "
                         f"{MAX_LOW_LATENCY_BYTES >> 30} GiB")
    return max_tokens_per_rank


def tensor_version(t: torch.Tensor) -> Optional[int]:
    """t's in-place version counter; None for inference-mode tensors, which keep none (an
    inference tensor changed in place between dispatch and combine goes unnoticed)."""
    try:
        return t._version
    except RuntimeError:
        return None


def check_same_routing(topk_idx: torch.Tensor, dispatched: Optional[torch.Tensor], version: Optional[int],
                       may_sync: bool = True) -> None:
    """A low-latency combine must get the routing its dispatch got: the same tensor unchanged, or
    equal values (compared with one host sync: only when `may_sync`; skipped under graph capture)."""
    if dispatched is None or (topk_idx is dispatched and tensor_version(topk_idx) == version):
        return
    if not may_sync or capturing():
        return
    if tuple(topk_idx.shape) != tuple(dispatched.shape):
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)} but its dispatch got {tuple(dispatched.shape)}")
    diff = topk_idx != dispatched
    if bool(diff.any()):
        row = int(diff.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"topk_idx differs from the routing its dispatch got (row {row}: {topk_idx[row].tolist()} vs "
                         f"{dispatched[row].tolist()}): a low-latency combine returns the rows of that dispatch")


def routing_inputs_error(routing_map, probs, num_experts: int) -> Optional[str]:
    """What is wrong with a Megatron manager's (routing_map, probs) before anything is derived
    from them: kinds, dtypes and shapes only (no host sync, so torch.compile-safe), or None."""
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
        kind = routing_map.dtype if isinstance(routing_map, torch.Tensor) else type(routing_map).__name__
        return f"routing_map must be a torch.bool [tokens, {num_experts}] map of the routed experts, got {kind}"
    if routing_map.dim() == 0 or routing_map.numel() % num_experts:
        return f"routing_map has shape {tuple(routing_map.shape)}; it must be [tokens, {num_experts}]"
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        kind = probs.dtype if isinstance(probs, torch.Tensor) else type(probs).__name__
        return f"probs must be a floating-point tensor shaped like routing_map, got {kind}"
    if tuple(probs.shape) != tuple(routing_map.shape):  # [E, T] for [T, E] has the right size, every value misplaced
        return f"probs has shape {tuple(probs.shape)} but routing_map has {tuple(routing_map.shape)}: they must match"
    return None


def routing_tokens_error(hidden_states, routing_map) -> Optional[str]:
    """A manager's dispatch: the hidden states must be the tokens its routing map routes."""
    if routing_map is None:
        return None
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        what = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        return f"hidden_states must be a 2-D [tokens, hidden] tensor, got {what}"
    if hidden_states.shape[0] != routing_map.shape[0]:
        return (f"hidden_states has {hidden_states.shape[0]} tokens but the routing_map given to setup_metadata has "
                f"{routing_map.shape[0]} rows: they must be the same tokens")
    return None


def check_capacity_factor(name: str, value) -> Optional[float]:
    """None (off) or a finite number > 0: NaN, inf, 0 and negative factors are refused (0 and
    negative ones used to switch the budget off silently)."""
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise TypeError(f"{name} must be a number, got "
                        f"{type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (or unset), got {value}")
    return float(value)


def check_stats(name: str, stats, length: int, dtype: torch.dtype, device: torch.device, what: str) -> None:
    """A statistics tensor a call adds to: [length] of dtype, contiguous, on the call's device."""
    if stats is None:
        return
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"{name} must be a tensor")
    if stats.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {stats.dtype}")
    if tuple(stats.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one entry per {what}), got {tuple(stats.shape)}")
    if not stats.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if stats.device != device:
        raise ValueError(f"{name} is on {stats.device}, x on {device}")
