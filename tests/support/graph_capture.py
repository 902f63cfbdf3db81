"""One CUDA-graph capture for the GPU cases: warm-up calls on a side stream first (the caching
allocator's first blocks and each kernel's first launch must not happen inside the capture), then
the capture on the caller's stream."""

from __future__ import annotations

import torch


def captured(step, *args, warmups: int = 1):
    """(graph, what step(*args) returned during the capture): step runs `warmups` times eagerly on a
    side stream, the caller's stream waits for them, then one call is captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)
    return graph, out
