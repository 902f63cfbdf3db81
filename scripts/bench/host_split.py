"""`bench host --phases`, its second part: a call's host time outside the extension's own steps,
split into the crossings' boundary (the arguments' conversion in, the results' out: the Python
side of each crossing less the steps the extension timed), the freeing of the call's outputs (what
the next call's assignment, or the loop dropping them, costs), and the rest (the Python around the
crossings and the torch calls that reach the CUDA runtime). Which part to cut first depends on it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

# the intranode path's one-crossing entries (the internode path composes them), and the layout's
CROSSINGS = ("notify_call", "dispatch_first_call", "dispatch_call", "combine_call")


def crossings(buf) -> List[Tuple[object, str]]:
    """(owner, name) of each extension entry a call of `buf` (our Buffer, the one inside
    megatron_ep.deep_ep's too) crosses through, where a wrapper can time it from the Python side;
    [] for DeepEP's own Buffer and the torch backend."""
    if not hasattr(buf, "_backend"):
        return []
    impl = buf._backend()
    kernels = getattr(getattr(impl, "path", None), "kernels", None)
    ext = getattr(getattr(impl, "rt", None), "ext", None)
    out = [(kernels, n) for n in CROSSINGS if kernels is not None and hasattr(kernels, n)]
    return out + ([(ext, "layout")] if ext is not None and hasattr(ext, "layout") else [])


@contextmanager
def timed(entries: List[Tuple[object, str]], spent: list) -> Iterator[None]:
    """Within the block each entry is wrapped: spent[0] += its ns from the Python side, spent[1] += 1."""
    clock = time.perf_counter_ns
    saved = [(owner, name, getattr(owner, name)) for owner, name in entries]
    for owner, name, entry in saved:
        def wrapper(*args, _entry=entry, **kw):
            t = clock()
            try:
                return _entry(*args, **kw)
            finally:
                spent[0] += clock() - t
                spent[1] += 1
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, entry in saved:
            setattr(owner, name, entry)


def _wrapper_ns(n: int = 2000) -> float:
    """What timed()'s wrapper adds to one crossing, ns (a builtin wrapped against the same builtin)."""
    class Owner:
        entry = staticmethod(max)

    spent = [0, 0]
    clock = time.perf_counter_ns
    t = clock()
    for _ in range(n):
        Owner.entry(1, 2)
    bare = clock() - t
    with timed([(Owner, "entry")], spent):
        t = clock()
        for _ in range(n):
            Owner.entry(1, 2)
        wrapped = clock() - t
    return max(0.0, (wrapped - bare) / n)


def split(fn: Callable, buf, calls: int, steps_us: Callable[[Callable], Optional[float]], sync: Callable,
          outside_us: Optional[float]) -> str:
    """Two more loops of `calls` calls of `fn` on `buf` (our Buffer, or DeepEP's own; collective:
    every rank runs them): one with the crossings wrapped (their Python-side time, against the
    extension's steps in the same loop, `steps_us(loop)` µs per call, or None where it times none),
    one keeping every output, whose freeing is then timed alone. `outside_us`: the host time outside
    the steps, from the plain loop."""
    entries = crossings(buf)
    spent = [0, 0]
    boundary = None
    if entries:
        def loop():
            for _ in range(calls):
                fn()
        with timed(entries, spent):
            inside = steps_us(loop)
        sync()
        per_call = spent[1] / calls
        if inside is not None:
            boundary = spent[0] / calls / 1e3 - inside - per_call * _wrapper_ns() / 1e3
    kept = [fn() for _ in range(calls)]
    sync()
    t = time.perf_counter()
    del kept
    freed = (time.perf_counter() - t) / calls * 1e6
    parts = [f"the outputs freed {freed:.1f}"]
    if boundary is not None:
        parts.insert(0, f"the crossings' boundary {boundary:.1f} ({spent[1] / calls:.1f} crossings per call: "
                        f"arguments in, results out)")
        if outside_us is not None:
            parts.append(f"the rest (Python, the CUDA runtime's queries) {outside_us - boundary - freed:.1f}")
    return "outside the steps, µs per call: " + ", ".join(parts)
