"""Make megatron-core (0.16 / 0.19, without TransformerEngine) train on CPU with gloo.

Used by train_moe.py only when no GPU is present (`apply`), and by the Megatron tests while a
case runs (`patched`); nothing here is needed on GPUs.
* `moe_utils.te_general_gemm` is referenced without TE (NameError) -> None: router gating
  falls back to torch.mm;
* the router and RoPE put tensors on `torch.cuda.current_device()` -> "cpu";
* the alltoall dispatcher's D2H side stream and events -> no-op stand-ins, and its splits are
  handed to all_to_all_single as numpy (as it does for GPU tensors) instead of CPU tensors;
* Megatron's CUDA RNG tracker forks a CUDA RNG around dropout -> a no-op context (dropout is 0
  in the recipe anyway).
"""

from __future__ import annotations

import contextlib

import torch


class _NoEvent:
    def synchronize(self):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass


class _NoStream:
    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NoEvent()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


def _patches():
    """(object, attribute, replacement) for every patch except the RNG tracker's."""
    import megatron.core.transformer.moe.moe_utils as mu
    import megatron.core.transformer.moe.token_dispatcher as td

    stream = _NoStream()
    orig_move = td.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return [
        (mu, "te_general_gemm", None),
        (td, "maybe_move_tensor_to_cpu", move),
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "current_stream", lambda *a, **k: stream),
        (torch.cuda, "Stream", lambda *a, **k: stream),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "Event", lambda *a, **k: _NoEvent()),
    ]


@contextlib.contextmanager
def patched():
    """The patches for the duration of a block, then the originals back (test harnesses)."""
    patches = _patches()
    saved = [(obj, name, obj.__dict__.get(name, getattr(obj, name, None))) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def apply() -> None:
    """The patches for good, plus a no-op RNG-tracker fork (the recipe on CPU)."""
    import megatron.core.tensor_parallel.random as tp_random

    for obj, name, value in _patches():
        setattr(obj, name, value)
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
