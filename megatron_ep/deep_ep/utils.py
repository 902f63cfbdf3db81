"""DeepEP's event types (deep_ep.utils): EventHandle, an event recorded on a stream, and
EventOverlap, what every call returns and takes as `previous_event`."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.types import EventOverlap as _OurEvent


class EventHandle:
    """A CUDA event recorded on the current stream when made (DeepEP's deep_ep_cpp.EventHandle).
    In a process that has not initialized CUDA (CPU gloo ranks) no stream has queued work to
    order against, so it holds no event (`event` None) and `current_stream_wait()` does
    nothing: callers such as Megatron's fused_a2a run unchanged there."""

    def __init__(self, event: Optional["torch.cuda.Event"] = None):
        if event is None and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's EventOverlap: `event` (an EventHandle, or None for a call that finished on the
    caller's stream), `extra_tensors` kept alive with it; `current_stream_wait()` and `with`."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def from_ours(ev: Optional[_OurEvent]) -> EventOverlap:
    """megatron_ep's EventOverlap (async calls) as DeepEP's; none -> EventOverlap(None)."""
    if ev is None or ev.event is None:
        return EventOverlap(None)
    return EventOverlap(EventHandle(ev.event))


def to_ours(ev: Optional[EventOverlap]) -> Optional[_OurEvent]:
    """A DeepEP `previous_event` as megatron_ep's (None, or one holding no CUDA event: None)."""
    handle = getattr(ev, "event", None)
    return None if handle is None or handle.event is None else _OurEvent(handle.event)
