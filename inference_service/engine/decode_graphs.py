"""DecodeGraphs: decode-only steps replayed from CUDA graphs, one per batch-size bucket.

A step of n decodes runs in the smallest bucket >= n: its inputs are written into the static
DecodeBuffers (the rows past n are padding) and the bucket's graph is replayed, so the step pays
one launch instead of several hundred. Every graph serves any mix of adapters: the LoRA kernels
launch one program per row and skip the tiles the step does not use, and adapter memory changes
in place between replays. Prefill and mixed steps run eagerly. Without capture (the CPU, where
Triton runs in its interpreter) the same buffers and batches run eagerly: the logic is the one
tested.
"""

from collections.abc import Mapping

import torch

from inference_service.model.decode_buffers import DecodeBuffers
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from inference_service.model.kv_cache import KVCache
from inference_service.model.model import LlamaModel
from kernels.lora_batch import AdapterPages


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_rows (and max_rows itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 16))
    return [*sizes, max_rows]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, cache: KVCache, buffers: DecodeBuffers, capture: bool):
        self._model, self._cache, self._buffers = model, cache, buffers
        self.buckets = buckets(buffers.max_rows)
        self._batches = {rows: buffers.batch(rows) for rows in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output, [rows, vocab]
        if capture:
            self._capture()

    def run(self, seqs: list[SequenceInput], adapters: Mapping[int, AdapterPages]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of a decode step (one new token per sequence), in fp32;
        adapters[s]: where the adapter of handle s lies in adapter memory."""
        rows = next(b for b in self.buckets if b >= len(seqs))
        self._buffers.fill(seqs, adapters)
        if rows in self._graphs:
            self._graphs[rows].replay()
            return self._logits[rows][: len(seqs)]
        return self._forward(self._batches[rows])[: len(seqs)]

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._model(batch, self._cache)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all graphs in one memory pool: smaller ones reuse its blocks."""
        self._buffers.fill([], {})  # every row padding: captures touch the scratch block only
        pool = None
        for rows in reversed(self.buckets):
            batch = self._batches[rows]
            self._forward(batch)  # compiles the kernels and warms the allocator before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[rows] = self._forward(batch)
            pool = graph.pool()
            self._graphs[rows] = graph
        torch.cuda.synchronize()
