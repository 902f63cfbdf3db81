"""Debugging hooks shared by both backends (tests use them; nothing in the library sets them)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

_output_hook: Optional[Callable[[torch.Tensor], None]] = None


def set_output_hook(fn: Optional[Callable[[torch.Tensor], None]]) -> None:
    """Call `fn` on every receive buffer and output tensor a backend allocates during a call,
    before anything writes it: tests fill outputs with garbage this way (an unwritten row shows),
    or raise from it on one rank (an allocation that fails mid-call)."""
    global _output_hook
    _output_hook = fn


def active() -> bool:
    """Whether an output hook is set: it then writes the outputs first, on the caller's stream."""
    return _output_hook is not None


def current() -> Optional[Callable[[torch.Tensor], None]]:
    """The output hook, or None (the cuda backend's one-crossing calls apply it themselves)."""
    return _output_hook


def new_outputs(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
    """Apply the output hook; True when it ran (a cuda caller's stream must then wait for it)."""
    if _output_hook is None:
        return False
    for t in tensors:
        if t is not None:
            _output_hook(t)
    return True
