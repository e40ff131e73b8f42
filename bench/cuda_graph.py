"""One CUDA graph capture for the benchmarks that time replays (no host time in them)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured into a CUDA graph after three warm-up calls on a side stream (which compile and allocate off
    the capture, and let autograd run its backward on that stream); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
