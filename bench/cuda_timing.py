"""Timing on a CUDA device: medians of CUDA-event timings, CUDA-graph replays without Python's
launch cost, and the device's copy bandwidth, the yardstick of memory-bound kernels."""

import statistics

import torch


def cuda_seconds(fn, repeats: int = 20) -> float:
    """Median seconds of fn() on the GPU, timed with CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def graph_seconds(fn, calls: int = 20) -> float:
    """Median GPU seconds of one fn() inside a CUDA graph of `calls` calls: no launch overhead."""
    fn()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_seconds(graph.replay) / calls


def copy_bandwidth() -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_seconds(lambda: dst.copy_(src))  # read + write
