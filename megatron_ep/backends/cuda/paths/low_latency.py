"""The low-latency (decode) path of the cuda backend: csrc/low_latency/ through the
separate extension `megatron_ep._C_nvshmem` (NVSHMEM).

One kernel per direction on the caller's stream, no host sync after the first call, fixed
shapes (CUDA-graph capturable). With `return_recv_hook=True` a call launches only its send half
and returns a hook that launches the receive half later (communication overlaps compute with
no SM held). Calls alternate between two buffer sets, so two results whose receive half has not
run can be in flight; a third raises before anything is sent. On the device a sender also waits,
per receiver, until that receiver released the set after its previous receive half on it, so a
slow peer is never overwritten.

NVSHMEM is initialised once per process (megatron_ep/backends/cuda/nvshmem.py) from the first group that uses
it; the group must span every PE (nvshmem_malloc is collective).
The buffer is sized by `Buffer(..., low_latency=dict(...))` up front, or by the first call
(the largest of every rank's needs); later calls must fit, or raise naming what does not.

Not checked across ranks on the host (that would be a sync): each call's signature (op, seq,
dtype, hidden, top-k, experts, max_tokens_per_rank) travels as a hash in the count signals and
a receiver that gets a different one raises CallMismatchError at the next call/synchronize.
A rank whose host side fails before it launches its part of a call publishes the failure into
every peer's buffer (one word each, `publish`): their waits on it stop at once and raise
PeerFailedFatalError naming it (the buffer sets are then out of step: re-create the Buffer). A
rank that dies or hangs without publishing leaves its peers to time out (CommTimeoutError).
Sizing, freeing, error decoding and publication: the NVSHMEM paths' base, nvshmem_path.py.

The rank mask (`low_latency=dict(..., rank_mask=True)`, DeepEP's shrink mode, for elastic EP):
a rank masked here is skipped by this rank's kernels (nothing sent to it, nothing waited for,
its tokens count as 0 and its experts' slots drop out of the combine's sum, not renormalised),
and a wait that exceeds `mask_timeout_s` masks the peer it waited for instead of raising: the
others go on, exact for the remaining ranks. The mask is this rank's own (set, queried and
cleared on the current stream, no communication); `barrier()` is a GPU barrier over the ranks
this rank does not mask, which also restarts the buffer sets' bookkeeping on every rank, so a
rank unmasked everywhere before it rejoins. Such a buffer is sized up front (its first call
cannot be a collective that a stopped rank would never join).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ....core import output_hook as hooks
from ....core import protocol
from ..extension import load_nvshmem
from ....core.checks import FP8_BLOCK, MAX_LOW_LATENCY_BYTES, fail, tensor_version
from ....core.types import LowLatencyDispatchOutput, LowLatencyHandle
from ....core.replay import Replay, low_latency_combine_shape
from .nvshmem_path import NvshmemPath, signature_hash

LIMIT_BYTES = MAX_LOW_LATENCY_BYTES  # per rank, both sets (checks.py owns it)


def buffer_bytes(num_ranks: int, num_experts: int, max_tokens_per_rank: int, hidden: int, topk: int = 8,
                 use_fp8: bool = True) -> int:
    """Size hint: bytes of one rank's symmetric buffer, both sets (dispatch rows per (source rank,
    token), a 16-byte table entry per expert copy, combine slots per (token, top-k slot) and the
    combine's staging); from csrc/low_latency/layout.h."""
    return int(load_nvshmem().plan(num_ranks, num_experts, max_tokens_per_rank, hidden, topk, use_fp8)["total"])


@dataclass(slots=True)
class _LLState:
    src_slot: torch.Tensor  # [L, cap] int32: top-k slot of each row's token (its combine return slot)
    set: int
    # the dispatch carried the weights (merged combine): the tensor it was given and its version,
    # each row's weight [L, cap] and the row of each copy (source, token, slot) here [R, mt, K]
    weights: Optional[torch.Tensor] = None
    weights_version: Optional[int] = None
    row_w: Optional[torch.Tensor] = None
    pairs: Optional[torch.Tensor] = None

    def merges(self, topk_weights: torch.Tensor) -> bool:
        """The combine may use the dispatch's weights: it got the very tensor, unchanged since."""
        return (self.pairs is not None and topk_weights is self.weights
                and tensor_version(topk_weights) == self.weights_version)


class _RecvHook:
    """Launches a call's receive half on the current stream; once."""

    def __init__(self, path: "LowLatencyPath", set_: int, launch: Callable[[], None]):
        self.path, self.set, self._launch = path, set_, launch

    def __call__(self) -> None:
        fail(self._launch is not None, "this receive hook was already called", RuntimeError)
        launch, self._launch = self._launch, None
        self.path.unreceived[self.set] = None
        launch()


class LowLatencyPath(NvshmemPath):
    """`rt`: what the path needs of a runtime, over the whole group (group, rank, num_ranks,
    device, ranks_per_device, sm_count, timeout_s, new_outputs, budget)."""

    KIND = "low-latency"
    SIZE_UP_FRONT = "pass Buffer(..., low_latency=dict(...))"
    FIT_REMEDY = "size it up front with Buffer(..., low_latency=dict(num_experts=, max_tokens=, hidden=, topk=, fp8_only=))"
    SENDS = "its launch of"
    SIGNATURE = (": op, call sequence, dtype, hidden, topk, num_experts, max_tokens_per_rank, use_logfmt or the merged "
                 "combine (weights given at dispatch) differ")
    PENDING = protocol.Pending.LAUNCH

    def __init__(self, rt, capacity: Optional[dict] = None):
        super().__init__(rt.group, rt.rank, rt.num_ranks, rt.device, rt.timeout_s)
        self.rt = rt
        self.next_set = 0
        self.unreceived = [None, None]  # per set: the call whose receive hook was not called yet
        # the last dispatch's and combine's, for Buffer (megatron_ep/core/replay.py)
        self.dispatch_replay: Optional[Replay] = None
        self.combine_replay: Optional[Replay] = None
        self.num_blocks = rt.budget.blocks("latency", self.ext.MAX_BLOCKS)
        self.rank_mask = False
        self.mask_timeout_s = self.timeout_s  # the kernels' waits under the rank mask (host waits keep timeout_s)
        if capacity is not None:
            capacity = dict(capacity)
            unknown = sorted(set(capacity) - set(_DEFAULTS) - set(_MASK_OPTIONS))
            if unknown:
                raise TypeError(f"low_latency=dict(...) takes {sorted(_DEFAULTS) + sorted(_MASK_OPTIONS)}, got unknown keys "
                                f"{unknown}")
            self.rank_mask = bool(capacity.pop("rank_mask", False))
            mask_timeout = capacity.pop("mask_timeout_s", None)
            if mask_timeout is not None:
                if not (isinstance(mask_timeout, (int, float)) and mask_timeout > 0):
                    raise ValueError(f"mask_timeout_s must be a positive number of seconds, got {mask_timeout!r}")
                fail(self.rank_mask, "mask_timeout_s needs rank_mask=True")
                self.mask_timeout_s = float(mask_timeout)
            self._create(self._agree({**_DEFAULTS, **capacity, "rank_mask": self.rank_mask}))

    # ------------------------------------------------------------------------------ buffer
    def _merge(self, every: List[dict]) -> dict:
        masks = [bool(d.get("rank_mask", False)) for d in every]
        if not (all(masks) or not any(masks)):
            raise ValueError(f"rank_mask must be the same on every rank; ranks "
                             f"{[r for r, m in enumerate(masks) if m]} passed rank_mask=True, the others not")
        cap = {k: max(int(d[k]) for d in every) for k in ("num_experts", "max_tokens", "hidden", "topk")}
        cap["fp8_only"] = all(d["fp8_only"] for d in every)
        return cap

    def _plan(self, cap: dict) -> dict:
        R = self.num_ranks
        if R > self.ext.MAX_RANKS:
            raise ValueError(f"the low-latency path supports up to {self.ext.MAX_RANKS} ranks, got {R}")
        if cap["num_experts"] > protocol.MAX_EXPERTS:
            raise ValueError(f"num_experts={cap['num_experts']} exceeds {protocol.MAX_EXPERTS}")
        if cap["topk"] > protocol.MAX_TOPK:
            raise ValueError(f"topk={cap['topk']} exceeds {protocol.MAX_TOPK}")
        plan = self.ext.plan(R, cap["num_experts"], cap["max_tokens"], cap["hidden"], cap["topk"], cap["fp8_only"])
        if plan["total"] > LIMIT_BYTES:
            raise RuntimeError(f"the low-latency buffer would take {plan['total'] / 2**30:.2f} GiB per rank (num_experts={cap['num_experts']}, "
                               f"max_tokens_per_rank={cap['max_tokens']}, hidden={cap['hidden']}, topk={cap['topk']}), above the limit of "
                               f"{LIMIT_BYTES / 2**30:.2f} GiB (MEGATRON_EP_LL_MAX_BYTES); lower max_tokens_per_rank")
        return plan

    def _open(self, cap: dict, plan: dict, pes: list):
        return self.ext.LowLatencyBuffer(self.device.index, self.rank, pes, cap["num_experts"], cap["max_tokens"],
                                         cap["hidden"], cap["topk"], cap["fp8_only"],
                                         self.mask_timeout_s if self.rank_mask else self.timeout_s, self.rank_mask)

    @staticmethod
    def _need(num_experts: int, max_tokens: int, hidden: int, topk: int, fp8: bool) -> dict:
        return dict(num_experts=num_experts, max_tokens=max_tokens, hidden=hidden, topk=topk, fp8_only=fp8)

    def _short(self, need: dict, cap: dict) -> List[str]:
        short = [f"{name} {need[key]} > {cap[key]}" for name, key in (("num_experts", "num_experts"),
                                                                     ("max_tokens_per_rank", "max_tokens"),
                                                                     ("hidden", "hidden"), ("topk", "topk"))
                 if need[key] > cap[key]]
        if not need["fp8_only"] and cap["fp8_only"]:
            short.append("bf16 rows in a buffer sized for FP8 rows")
        return short

    def _sized_for(self, c: dict) -> str:
        return (f"num_experts={c['num_experts']}, max_tokens_per_rank={c['max_tokens']}, hidden={c['hidden']}, "
                f"topk={c['topk']}{', FP8 only' if c['fp8_only'] else ''}")

    def _free_set(self, call: protocol.Call) -> int:
        """The set this call uses (they alternate; `_launch` moves on only after a launch, so a
        call that raises before it leaves every rank on the same set)."""
        s = self.next_set
        held = self.unreceived[s]
        if held is not None:
            raise RuntimeError(f"{call.describe()}: two low-latency results whose receive hook was not called are in flight "
                               f"(calls #{self.unreceived[0]} and #{self.unreceived[1]}); a third call would overwrite one: call "
                               f"the hook of call #{held} first")
        return s

    # ------------------------------------------------------------------------------ errors
    def _op(self, op: int) -> str:
        return protocol.op_name(op, "low-latency call")

    def _where(self, err: dict) -> str:
        return f" (buffer set {err['set']})"

    def _waited(self, err: dict) -> str:
        me, s, e, peer = self.rank, err["set"], err["expert"], err["peer"]
        L = self.cap["num_experts"] // self.num_ranks if self.cap else 0
        return {
            0: f"waiting for rank {peer} to release low-latency buffer set {s} (its receive half of an earlier call on "
               f"that set has not run: a receive hook not called, or the rank stopped)",
            1: f"waiting for rank {peer}'s token count for local expert {e} (global expert {me * L + e}) in buffer set {s}",
            2: f"waiting for rank {peer}'s combined rows of expert {e} in buffer set {s}",
            3: f"waiting for rank {peer}'s merged combine rows in buffer set {s}",
            4: f"waiting for rank {peer} to enter the low-latency barrier",
        }.get(err["what"], f"waiting on rank {peer}")

    # ---------------------------------------------------------------------------- dispatch
    def dispatch(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
                 use_fp8: bool, round_scale: bool, return_recv_hook: bool = False,
                 topk_weights: Optional[torch.Tensor] = None, use_ue8m0: bool = False,
                 recv_stats: Optional[torch.Tensor] = None,
                 wait_stats: Optional[torch.Tensor] = None) -> LowLatencyDispatchOutput:
        rt = self.rt
        H, K = x.shape[1], topk_idx.shape[1]
        if x.dtype != torch.bfloat16:
            raise TypeError(f"the cuda low-latency dispatch takes bf16 x, got {x.dtype}")
        if x.device != rt.device:
            raise ValueError(f"x is on {x.device}, the buffer on {rt.device}")
        if not (use_fp8 or H % 8 == 0):
            raise ValueError(f"x: hidden size {H} must be a multiple of 8 for bf16 rows (16-byte copies)")
        if not (not use_fp8 or H % FP8_BLOCK == 0):
            raise ValueError(f"x: hidden size {H} must be a multiple of {FP8_BLOCK} for FP8")
        if self.buf is None or (num_experts, max_tokens_per_rank, H, K, use_fp8) not in self._fitted:  # (_fit's key)
            self._fit(self._need(num_experts, max_tokens_per_rank, H, K, use_fp8))
        out = self._send(call, x, topk_idx, num_experts, max_tokens_per_rank, use_fp8, round_scale, return_recv_hook,
                         topk_weights, use_ue8m0, recv_stats, wait_stats)
        if not hooks.active():  # (a test's output hook takes the full call)
            options = (num_experts, max_tokens_per_rank, use_fp8, round_scale, use_ue8m0, return_recv_hook)
            self.dispatch_replay = Replay(call.sig, self._replay_dispatch, x, topk_weights, topk_idx, options,
                                          (recv_stats, wait_stats))
        return out

    def _replay_dispatch(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor,
                         topk_weights: Optional[torch.Tensor], recv_stats: Optional[torch.Tensor],
                         wait_stats: Optional[torch.Tensor]) -> LowLatencyDispatchOutput:
        """A dispatch replayed (megatron_ep/core/replay.py): the shape and options of the last one, whose
        checks and fit passed (the buffer only grows), so only the send itself."""
        num_experts, max_tokens_per_rank, use_fp8, round_scale, use_ue8m0, return_recv_hook = \
            self.dispatch_replay.options
        return self._send(call, x, topk_idx, num_experts, max_tokens_per_rank, use_fp8, round_scale, return_recv_hook,
                          topk_weights, use_ue8m0, recv_stats, wait_stats)

    def _send(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
              use_fp8: bool, round_scale: bool, return_recv_hook: bool, topk_weights: Optional[torch.Tensor],
              use_ue8m0: bool, recv_stats: Optional[torch.Tensor],
              wait_stats: Optional[torch.Tensor]) -> LowLatencyDispatchOutput:
        """A checked dispatch that fits the buffer: its set, its one crossing, its handle."""
        rt = self.rt
        R, T, H, K = rt.num_ranks, x.shape[0], x.shape[1], topk_idx.shape[1]
        s = self._free_set(call)
        w = topk_weights.float().contiguous() if topk_weights is not None else None  # a no-op for fp32 weights
        sig = signature_hash(call)
        # one crossing allocates the outputs and launches (dispatch_call); a test's output hook sees
        # the outputs first, so with one set they are made without the launch
        first = [self.buf.dispatch_call(x, topk_idx, num_experts, use_fp8, round_scale, use_ue8m0, s, 0, sig, call.seq,
                                        max_tokens_per_rank, w, recv_stats, wait_stats, self.num_blocks, False)
                 ] if hooks.active() else []

        def launch(phases: int) -> None:
            if not first:  # the call's first launch (a receive hook's half comes later, on these outputs)
                first.append(self.buf.dispatch_call(x, topk_idx, num_experts, use_fp8, round_scale, use_ue8m0, s, phases,
                                                    sig, call.seq, max_tokens_per_rank, w, recv_stats, wait_stats,
                                                    self.num_blocks, True))
                return
            out_x, out_s, ue8m0, count, layout_range, packed, src, slot, row_w, pairs = first[0]
            self.buf.dispatch(x, topk_idx, num_experts, use_fp8, round_scale, s, phases, sig, call.seq, out_x, out_s, count,
                              layout_range, packed, src, slot, w, row_w, pairs, ue8m0, recv_stats, wait_stats,
                              self.num_blocks)

        if first:
            rt.new_outputs(first[0])  # test poisoning, on this stream, before any kernel writes them
        hook = self._launch(call, s, launch, return_recv_hook)
        out_x, out_s, ue8m0, count, layout_range, packed, src, slot, row_w, pairs = first[0]
        state = _LLState(slot, s, topk_weights, None if w is None else tensor_version(topk_weights), row_w, pairs)
        # (positional, in LowLatencyHandle's field order -- backend, num_ranks, rank, num_experts,
        # num_tokens, topk, max_tokens_per_rank, hidden, layout_range, packed_layout, src_token,
        # topk_idx, topk_idx_version, state, buffer_id, call_seq: keywords cost host time every
        # decode step; tests/unit/test_low_latency_path.py checks every field; Buffer sets topk_idx,
        # its version and buffer_id)
        handle = LowLatencyHandle("cuda", R, rt.rank, num_experts, T, K, max_tokens_per_rank, H, layout_range, packed, src,
                                  None, None, state, 0, call.seq)
        scales = ue8m0.transpose(1, 2) if use_ue8m0 else out_s
        return LowLatencyDispatchOutput((out_x, scales) if use_fp8 else out_x, count, handle, None, hook)

    # ----------------------------------------------------------------------------- combine
    def combine(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                wait_stats: Optional[torch.Tensor] = None, use_logfmt: bool = False):
        """y [T, H] bf16; with return_recv_hook, (y, hook): y is valid once the hook ran."""
        rt = self.rt
        fail(handle.backend == "cuda" and isinstance(handle.state, _LLState), "the handle is not from a cuda low-latency dispatch")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"the cuda low-latency combine takes bf16 expert outputs, got {x.dtype}")
        if x.device != rt.device:
            raise ValueError(f"x is on {x.device}, the buffer on {rt.device}")
        H = handle.hidden
        # combine rows are bf16 in any buffer
        if self.buf is None or (handle.num_experts, handle.max_tokens_per_rank, H, handle.topk, True) not in self._fitted:
            self._fit(self._need(handle.num_experts, handle.max_tokens_per_rank, H, handle.topk, True))
        sig = list(call.sig)  # (before the merge decision, which each call makes again)
        res = self._return(call, x, topk_idx, topk_weights, handle, return_recv_hook, out, wait_stats, use_logfmt)
        if out is None and not use_logfmt and not hooks.active():  # (a test's output hook takes the full call)
            self.combine_replay = Replay(sig, self._replay_combine, x, topk_weights, topk_idx,
                                         low_latency_combine_shape(handle, return_recv_hook), (wait_stats,))
        return res

    def _replay_combine(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: LowLatencyHandle, wait_stats: Optional[torch.Tensor]):
        """A combine replayed (megatron_ep/core/replay.py): a handle of the shape of the last one's (its
        dispatch's sizes: the buffer fits them), so only the return itself."""
        return self._return(call, x, topk_idx, topk_weights, handle, self.combine_replay.options[-1], None, wait_stats,
                            False)

    def _return(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, return_recv_hook: bool, out: Optional[torch.Tensor],
                wait_stats: Optional[torch.Tensor], use_logfmt: bool):
        """A checked combine that fits the buffer: its set, the merge decision, its one crossing."""
        rt = self.rt
        T, H = handle.num_tokens, handle.hidden
        s = self._free_set(call)
        # y: a given out (Buffer.low_latency_combine checked it), else made by combine_call -- or here,
        # where a test's output hook must see it before the launch
        if hooks.active():
            out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device) if out is None else out
            rt.new_outputs([out])
        weights = topk_weights.float().contiguous()  # a no-op for fp32 weights
        st: _LLState = handle.state
        merged = st.merges(topk_weights)  # else one row per copy, weighted here
        pairs, row_w = (st.pairs, st.row_w) if merged else (None, None)
        if merged:  # the receivers wait for one flag per rank: every rank must merge, or none
            call.set(variant=call.get("variant") | protocol.LL_COMBINE_MERGED)
        sig = signature_hash(call)
        made = [out]

        def launch(phases: int) -> None:  # one crossing; the first launch makes y unless given
            made[0] = self.buf.combine_call(x, handle.layout_range, handle.src_token, st.src_slot, topk_idx, weights,
                                            handle.num_experts, s, phases, sig, call.seq, made[0], pairs, row_w,
                                            wait_stats, use_logfmt, self.num_blocks)

        hook = self._launch(call, s, launch, return_recv_hook)
        return (made[0], hook) if return_recv_hook else made[0]

    # --------------------------------------------------------------------------- rank mask
    def _needs_mask(self, what: str) -> None:
        if not (self.buf is not None and self.rank_mask):
            raise RuntimeError(f"{what} needs the rank mask: Buffer(..., low_latency=dict(..., rank_mask=True))")

    def set_mask(self, rank: int, masked: bool) -> None:
        """Mask (or unmask) `rank` for this rank's later low-latency kernels (current stream)."""
        self._needs_mask("low_latency_mask")
        if not (isinstance(rank, int) and 0 <= rank < self.num_ranks):
            raise ValueError(f"rank must be an int in [0, {self.num_ranks}), got {rank!r}")
        self.raise_if_broken()
        self.buf.set_mask(rank, bool(masked))

    def mask_status(self, out: torch.Tensor) -> torch.Tensor:
        """out[r] = 1 where rank r is masked here (int32 [R] on this device; current stream)."""
        self._needs_mask("low_latency_mask_status")
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.int32 and out.numel() == self.num_ranks
                and out.device == self.device and out.is_contiguous()):
            raise ValueError(f"mask_status must be a contiguous int32 tensor of {self.num_ranks} elements on {self.device}")
        self.buf.query_mask(out)
        return out

    def clear_mask(self) -> None:
        self._needs_mask("low_latency_clear_mask")
        self.buf.clear_mask()

    def barrier(self) -> None:
        """Collective over the unmasked ranks, on the current stream: see the module docstring."""
        self._needs_mask("low_latency_barrier")
        held = [seq for seq in self.unreceived if seq is not None]
        if held:
            raise RuntimeError(f"low_latency_barrier: the receive hooks of calls {held} were not called; call them first")
        self.raise_if_broken()
        self.buf.barrier()
        self.next_set = 0  # every rank restarts at set 0 (the kernel reset the sets' counts)

    def _launch(self, call: protocol.Call, s: int, launch: Callable[[int], None], return_recv_hook: bool) -> Optional[_RecvHook]:
        if not return_recv_hook:
            call.sends(launch, self.ext.SEND | self.ext.RECV)
            self.next_set = 1 - s
            return None
        call.sends(launch, self.ext.SEND)
        self.next_set = 1 - s
        self.unreceived[s] = call.seq
        return _RecvHook(self, s, lambda: launch(self.ext.RECV))


_DEFAULTS = dict(num_experts=256, max_tokens=128, hidden=7168, topk=8, fp8_only=False)
# the rank mask's options, not capacity: rank_mask must be equal on every rank (checked in _merge),
# mask_timeout_s is each rank's own
_MASK_OPTIONS = ("rank_mask", "mask_timeout_s")
