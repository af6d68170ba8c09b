"""ModelRunner: the model, its KV cache and its adapter memory on one device; runs one
flattened batch per call and samples from it."""

from dataclasses import dataclass

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.adapter_memory import (
    adapter_memory_units,
    page_units,
    unit_elements,
)
from inference_service.engine.config import EngineConfig
from inference_service.engine.decode_graphs import DecodeGraphs
from inference_service.engine.sampler import SampleResult, SamplingBatch, sample
from inference_service.engine.scheduler import ScheduledChunk
from inference_service.engine.sequence import Sequence
from inference_service.model.decode_buffers import DecodeBuffers
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from inference_service.model.kv_cache import KVCache
from inference_service.model.model import LlamaModel
from inference_service.model.weights import load_weights
from kernels.lora_batch import PAGE_RANK, AdapterPages
from shared.model_config import LORA_TARGETS, ModelConfig
from shared.nonfinite import finite_rows


@dataclass(frozen=True)
class StepOutput:
    computed: list[ScheduledChunk]  # the chunks whose K/V are now in the cache
    sampled: list[Sequence]  # the sequences that drew a token, in `result` order
    result: SampleResult
    non_finite: list[Sequence]  # logits held NaN or Inf: nothing drawn, KV blocks zeroed


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.device = torch.device(config.device)
        self.lora_unit = unit_elements(self.model_config)
        self.lora_units = adapter_memory_units(config, self.model_config)
        self._page_widths = [n * self.lora_unit for n in page_units(self.model_config)]  # [targets]
        self.model = LlamaModel(
            self.model_config, self.lora_units, self.lora_unit, config.torch_dtype, self.device
        )
        load_weights(self.model, config.model)
        self.num_blocks = -(-config.kv_cache_tokens // config.block_size)  # blocks sequences may hold
        self.cache = KVCache(
            self.model_config.num_layers,
            self.num_blocks + 1,  # and the scratch block the padding rows of a decode graph write to
            config.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            config.torch_dtype,
            self.device,
        )
        self._adapters: dict[int, AdapterPages] = {}  # where each resident adapter's pages lie
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, self.decode_buffers(), capture=True)

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt plus output) one sequence may hold: the worker's limit or the model's."""
        return min(self.config.max_model_len, self.model_config.max_position_embeddings)

    def decode_buffers(self) -> DecodeBuffers:
        """Static inputs for decode steps of up to max_num_seqs sequences of up to max_model_len."""
        return DecodeBuffers(
            self.config.max_num_seqs,
            -(-self.max_model_len // self.config.block_size),
            self.config.block_size,
            self.num_blocks,  # the scratch block
            self.model_config.sliding_window,
            len(LORA_TARGETS),
            -(-self.config.max_lora_rank // PAGE_RANK),
            self.device,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Forward one step's chunks, then draw a token for each chunk that reaches its prompt's
        end. A row whose logits hold NaN or Inf (weights that overflow in the serving dtype)
        draws nothing, and its sequence's KV blocks are zeroed before anyone else gets them:
        attention multiplies masked positions by 0, and 0 x NaN is NaN."""
        inputs = [_input(c) for c in chunks]
        if self.graphs is not None and all(c.num_tokens == 1 for c in chunks):
            logits = self.graphs.run(inputs, self._adapters)  # [chunks, vocab]
        else:
            logits = self.forward(inputs)  # [chunks, vocab]
        finite = finite_rows(logits)  # [chunks]
        non_finite = [c.seq for c, ok in zip(chunks, finite, strict=True) if not ok]
        for seq in non_finite:
            self.cache.zero_blocks(seq.block_table)
        rows = [i for i, c in enumerate(chunks) if finite[i] and c.samples]
        sampled = [chunks[i].seq for i in rows]
        drawn = logits if len(rows) == len(chunks) else logits[rows]  # [rows, vocab]; decode: no copy
        result = _sample(sampled, drawn) if rows else SampleResult([], [])
        computed = [c for c, ok in zip(chunks, finite, strict=True) if ok]
        return StepOutput(computed, sampled, result, non_finite)

    @torch.inference_mode()
    def forward(
        self, seqs: list[SequenceInput], all_logits: bool = False, kernels: bool | None = None
    ) -> torch.Tensor:
        """Logits [sequences, vocab] for each sequence's last new token ([tokens, vocab] with
        all_logits), in fp32. kernels: the Triton kernels' path (default: on CUDA; on the CPU it
        runs in Triton's interpreter, for tests)."""
        batch = ForwardBatch.build(
            seqs,
            self.config.block_size,
            self.model_config.sliding_window,
            self.device,
            all_logits,
            self._adapters,
            kernels,
        )
        return self.model(batch, self.cache)

    @torch.inference_mode()
    def load_slot(self, slot: int, image: AdapterImage, pages: tuple[tuple[int, ...], ...]) -> None:
        """Copy an adapter's image into its pages of adapter memory (`pages`: per target, the
        first unit of each page) and serve it as `slot`: one copy per page, of every layer at
        once, in one multi-tensor launch, async from the host tier's page-locked memory. The
        image holds the zeros of rank rows past each module's rank, so nothing is zeroed."""
        pool, unit = self.model.lora_pool, self.lora_unit  # pool: [layers, units*unit]
        widths = self._page_widths
        _check_fits(image, pages, pool.shape[0], widths, self.config.max_lora_rank)
        targets = [pool[:, u * unit : u * unit + widths[t]] for t, units in enumerate(pages) for u in units]
        sources = [page for target_pages in image.pages for page in target_pages]  # [layers, width] each
        torch._foreach_copy_(targets, sources, non_blocking=True)
        self._adapters[slot] = AdapterPages(image.ranks, pages)

    def clear_slot(self, slot: int) -> None:
        """`slot` serves no adapter any more (its pages go back to the adapter memory)."""
        self._adapters.pop(slot, None)


def _check_fits(
    image: AdapterImage, pages: tuple[tuple[int, ...], ...], num_layers: int, widths: list[int], max_rank: int
) -> None:
    """Refuse an image the memory's layout cannot hold (a loader that skipped its checks): a
    rank past max_lora_rank (the step tables hold that many pages), or pages not shaped as
    this model's pages and the ones acquired for it."""
    for target, rank, image_pages, units, width in zip(
        LORA_TARGETS, image.ranks, image.pages, pages, widths, strict=True
    ):
        if rank > max_rank:
            raise ValueError(f"{target} has rank {rank}, above max_lora_rank {max_rank}")
        if image_pages.shape != (len(units), num_layers, width):
            raise ValueError(
                f"{target} pages are {tuple(image_pages.shape)}; the adapter memory holds "
                f"{(len(units), num_layers, width)}"
            )


def _input(chunk: ScheduledChunk) -> SequenceInput:
    seq = chunk.seq
    tokens = seq.token_ids[seq.num_computed : seq.num_computed + chunk.num_tokens]
    return SequenceInput(tokens, seq.num_computed, seq.block_table, seq.slot)


def _sample(seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
    """One token per sequence from its row of `logits` [seqs, vocab]."""
    # Only penalized rows read their history; building it costs O(length) per row.
    histories = [s.token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
    batch = SamplingBatch.build(
        [s.params for s in seqs], [s.generator for s in seqs], histories, logits.device
    )
    return sample(logits, batch)
