"""ModelRunner: the model, its KV cache and its adapter memory on one device; runs one
flattened batch per call and samples from it."""

import logging
from dataclasses import dataclass

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.host_tier import ReadyAdapter
from inference_service.engine.adapter_memory import adapter_memory_units, check_device_room
from inference_service.engine.config import EngineConfig
from inference_service.engine.decode_graphs import DecodeGraphs
from inference_service.engine.huge_pages import move_to_huge_pages
from inference_service.engine.kv_budget import bytes_per_block, check_fits, cpu_blocks, cuda_blocks, sized_by
from inference_service.engine.rank_group import RankGroup, RankReport
from inference_service.engine.sampler import SampleResult
from inference_service.engine.scheduler import ScheduledChunk
from inference_service.engine.sequence import Sequence
from inference_service.engine.sequence_sampling import sample_sequences
from inference_service.model.adapter_units import memory_targets, page_units, unit_elements
from inference_service.model.base_weight import serving_format, weight_bytes
from inference_service.model.collectives import Collectives
from inference_service.model.decode_buffers import DecodeBuffers
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from inference_service.model.kv_cache import KVCache
from inference_service.model.model import LlamaModel, model_bytes
from inference_service.model.moe import expert_weight_bytes
from inference_service.model.vocab_batch import VocabPages
from inference_service.model.weights import load_weights
from kernels.cpu_kernels import CpuKernels
from kernels.lora_batch import PAGE_RANK, AdapterPages
from shared.model_config import ModelConfig
from shared.nonfinite import finite_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    computed: list[ScheduledChunk]  # the chunks whose K/V are now in the cache
    sampled: list[Sequence]  # the sequences that drew a token, in `result` order
    result: SampleResult
    non_finite: list[Sequence]  # logits held NaN or Inf: nothing drawn, KV blocks zeroed


class ModelRunner:
    """Under tensor parallelism, one per rank, each running every step's forward together:
    `parallel` is this rank's part (its Shard) and the group the ranks exchange over; rank 0's
    runner tells the others (`followers`) what to do before each of its own model calls."""

    def __init__(
        self, config: EngineConfig, parallel: Collectives | None = None, followers: RankGroup | None = None
    ):
        self.config = config
        self.parallel = parallel or Collectives()
        self.followers = followers
        self.model_config = ModelConfig.from_dir(config.model)
        self.rank_config = self.parallel.shard.config(self.model_config)  # the shapes this rank holds
        self.device = torch.device(config.device)
        self.lora_unit = unit_elements(self.rank_config)
        self.lora_units = adapter_memory_units(config, self.rank_config)
        self._page_widths = [n * self.lora_unit for n in page_units(self.rank_config)]  # [targets, run]
        self.quantization = serving_format(self.model_config, config.quantization, config.model)
        if self.device.type == "cuda":
            self._check_device_room()
        self.model = LlamaModel(
            self.model_config,
            self.lora_units,
            self.lora_unit,
            config.torch_dtype,
            self.device,
            self.quantization,
            self.parallel,
        )
        load_weights(self.model, config.model)
        self.linear_weight_bytes = weight_bytes(self.model) + expert_weight_bytes(self.model)
        self.cpu_kernels = _cpu_kernels() if self.device.type == "cpu" else CpuKernels()
        self.model.pack(self.cpu_kernels.linear, self.cpu_kernels.lora)
        self._adapters: dict[int, AdapterPages] = {}  # where each resident adapter's pages lie
        self._vocab: dict[int, VocabPages] = {}  # and its vocabulary-side parts, if it has any
        self.num_blocks = self._kv_blocks()  # blocks sequences may hold
        # and the scratch block the padding rows of a decode graph write to
        self.cache = self._kv_cache(self.num_blocks + 1)
        if self.device.type == "cpu":
            log.info("Weights, adapter memory and KV cache: %s", move_to_huge_pages(self._tensors()))
        self.ranks = (RankReport(self.parallel.shard.rank, **self.memory_report()),)  # the others: start
        self.graphs = None
        # An MoE step's expert tiles depend on its routing (read on the host): no graph replays
        # it; nor one whose layers exchange with other ranks.
        eager = self.model_config.moe or self.parallel.size > 1
        if self.device.type == "cuda" and config.cuda_graphs and not eager:
            self.graphs = DecodeGraphs(self.model, self.cache, self.decode_buffers(), capture=True)

    @classmethod
    def start(cls, config: EngineConfig) -> "ModelRunner":
        """Rank 0's runner; under tensor parallelism, once the other ranks have started and
        built their parts too (or with the first one's error)."""
        if config.tensor_parallel_size == 1:
            return cls(config)
        followers = RankGroup(config)
        try:
            runner = cls(config, followers.parallel, followers)
        except Exception as e:
            raise followers.start_failure(e) from e
        followers.wait_ready()
        runner.ranks += tuple(followers.reports)
        return runner

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: its weights, its adapter memory, its KV cache."""
        model = self.model
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        weights += model.packed_bytes()
        pool = model.lora_pool.numel() * model.lora_pool.element_size()
        kv = 2 * self.cache.k.numel() * self.cache.k.element_size()
        return {"weight_bytes": weights - pool, "adapter_memory_bytes": pool, "kv_cache_bytes": kv}

    def _tensors(self) -> list[torch.Tensor]:
        """What this rank holds: the model's tensors (adapter memory among them) and the KV cache."""
        return [*self.model.tensors(), self.cache.k, self.cache.v]

    def close(self) -> None:
        """Stop the other ranks, if any."""
        if self.followers is not None:
            self.followers.stop()

    def abort(self) -> None:
        """Kill the other ranks, if any: the engine died, and one may be stuck in a collective."""
        if self.followers is not None:
            self.followers.kill()

    def _check_device_room(self) -> None:
        """Before anything is allocated: the weights, adapter memory and one request's KV cache
        must fit in --gpu-memory-utilization of the GPU, less what other processes hold."""
        free, total = torch.cuda.mem_get_info(self.device)
        config, model = self.config, self.rank_config
        budget = int(config.gpu_memory_utilization * total) - (total - free)
        weights = model_bytes(self.model_config, config.torch_dtype, self.quantization, self.parallel.shard)
        kv = -(-self.max_model_len // config.block_size) * bytes_per_block(model, config)
        check_device_room(config, model, weights, kv, budget)

    def _kv_blocks(self) -> int:
        """As --kv-cache-tokens says, or as memory allows; refused when one max_model_len request
        could not fit."""
        config = self.config
        if config.kv_cache_tokens:
            blocks = -(-config.kv_cache_tokens // config.block_size)
        elif self.device.type == "cuda":
            blocks = self.parallel.agree_min(self._profiled_cuda_blocks())  # every rank holds as many
        else:
            blocks = cpu_blocks(self.rank_config, config, self.max_model_len)
        check_fits(blocks, config, self.max_model_len, sized_by(config, self.device))
        return blocks

    def _kv_cache(self, num_blocks: int) -> KVCache:
        model = self.rank_config  # this rank's KV heads
        return KVCache(
            model.num_layers,
            num_blocks,
            self.config.block_size,
            model.num_kv_heads,
            model.head_dim,
            self.config.torch_dtype,
            self.device,
        )

    def _profiled_cuda_blocks(self) -> int:
        """The blocks left in --gpu-memory-utilization of the GPU once the weights and adapter
        memory are in place and a step's activations have peaked. CUDA graphs are captured after
        the cache exists (they hold its addresses), so their pools come from what utilization
        leaves over."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        per_block = bytes_per_block(self.rank_config, self.config)
        return cuda_blocks(total, free, reserved, peak, self.config.gpu_memory_utilization, per_block)

    @torch.inference_mode()
    def profile_step(self) -> torch.Tensor:
        """The largest step's forward: one prompt of max_num_batched_tokens tokens (no longer
        than max_model_len), on a cache of just its blocks, freed after."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.config.block_size)
        cache = self._kv_cache(blocks)
        seq = SequenceInput([0] * tokens, 0, list(range(blocks)))
        batch = ForwardBatch.build(
            [seq], self.config.block_size, self.model_config.sliding_window, self.device
        )
        return self.model(batch, cache)  # [1, vocab]

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
            len(self.model_config.lora_targets),
            -(-self.config.max_lora_rank // PAGE_RANK),
            self.device,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Forward one step's chunks, then draw a token for each chunk that reaches its last
        token. A row whose logits hold NaN or Inf (weights that overflow in the serving dtype)
        draws nothing; the caller zeroes the blocks its sequence computed."""
        inputs = [_input(c) for c in chunks]
        eager = any(c.seq.slot in self._vocab for c in chunks)  # no graph reads vocabulary-side parts
        if self.graphs is not None and not eager and all(c.num_tokens == 1 for c in chunks):
            logits = self.graphs.run(inputs, self._adapters)  # [chunks, vocab]
        else:
            logits = self.forward(inputs)  # [chunks, vocab]
        finite = finite_rows(logits)  # [chunks]
        non_finite = [c.seq for c, ok in zip(chunks, finite, strict=True) if not ok]
        rows = [i for i, c in enumerate(chunks) if finite[i] and c.samples]
        sampled = [chunks[i].seq for i in rows]
        drawn = logits if len(rows) == len(chunks) else logits[rows]  # [rows, vocab]; decode: no copy
        result = (
            sample_sequences(sampled, drawn, self.cpu_kernels.token_mask) if rows else SampleResult([], [])
        )
        computed = [c for c, ok in zip(chunks, finite, strict=True) if ok]
        return StepOutput(computed, sampled, result, non_finite)

    @torch.inference_mode()
    def forward(
        self, seqs: list[SequenceInput], all_logits: bool = False, kernels: bool | None = None
    ) -> torch.Tensor:
        """Logits [sequences, vocab] for each sequence's last new token ([tokens, vocab] with
        all_logits), in fp32. kernels: the Triton kernels' path (default: on CUDA; on the CPU it
        runs in Triton's interpreter, for tests)."""
        if self.followers is not None:
            self.followers.forward(seqs, all_logits, kernels)
        batch = ForwardBatch.build(
            seqs,
            self.config.block_size,
            self.model_config.sliding_window,
            self.device,
            all_logits,
            self._adapters,
            kernels,
            self._vocab,
            self.parallel.shard.vocab(self.model_config.vocab_size),
            self.cpu_kernels,
        )
        return self.model(batch, self.cache)

    @torch.inference_mode()
    def load_slot(
        self,
        slot: int,
        image: AdapterImage,
        pages: tuple[tuple[int, ...], ...],
        source: ReadyAdapter | None = None,
    ) -> None:
        """Copy an adapter's image into its pages of adapter memory (`pages`: per target, the
        first unit of each page) and serve it as `slot`: one copy per page, of every layer at
        once, in one multi-tensor launch, async from the host tier's page-locked memory. The
        image holds the zeros of rank rows past each module's rank, so nothing is zeroed.
        Under tensor parallelism `source` names the blob the other ranks take their parts from."""
        pool, unit = self.model.lora_pool, self.lora_unit  # pool: [layers, units*unit]
        widths = self._page_widths
        image.check_fits(
            pages, memory_targets(self.rank_config), pool.shape[0], widths, self.config.max_lora_rank
        )
        if self.followers is not None:  # checked first: a rank that fails a load ends the engine
            if source is None or source.blob is None:
                raise ValueError(
                    "the other tensor-parallel ranks need the adapter's blob; its loader gave none"
                )
            self.followers.load(slot, source.name, source.digest, source.blob, pages)
        targets = [pool[:, u * unit : u * unit + widths[t]] for t, units in enumerate(pages) for u in units]
        sources = [page for target_pages in image.pages for page in target_pages]  # [layers, width] each
        torch._foreach_copy_(targets, sources, non_blocking=True)
        self._adapters[slot] = AdapterPages(image.ranks, pages[:-1])
        if image.vocab is not None:
            self._vocab[slot] = VocabPages(pages[-1][0] * unit, image.vocab)

    def clear_slot(self, slot: int) -> None:
        """`slot` serves no adapter any more (its pages go back to the adapter memory)."""
        if self.followers is not None:
            self.followers.clear(slot)
        self._adapters.pop(slot, None)
        self._vocab.pop(slot, None)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Wipe KV blocks a failed sequence may have filled with NaN or Inf, on every rank."""
        if self.followers is not None:
            self.followers.zero_blocks(blocks)
        self.cache.zero_blocks(blocks)


def _cpu_kernels() -> CpuKernels:
    """The compiled CPU kernels, each where it could be built (how, logged): where one could not,
    its torch path runs."""
    kernels, how = CpuKernels.load()
    log.info("CPU kernels: %s", how)
    return kernels


def _input(chunk: ScheduledChunk) -> SequenceInput:
    seq = chunk.seq
    tokens = seq.token_ids[seq.num_computed : seq.num_computed + chunk.num_tokens]
    return SequenceInput(tokens, seq.num_computed, seq.block_table, seq.slot)
