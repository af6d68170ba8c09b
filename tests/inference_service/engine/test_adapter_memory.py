"""AdapterMemory and the layout that sizes it: what fits, where pages go, what is evicted."""

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.adapter_memory import (
    AdapterMemory,
    SlotStats,
    adapter_bytes,
    check_device_room,
    memory_units,
    page_units,
    slot_memory,
    unit_elements,
)
from inference_service.engine.config import EngineConfig
from inference_service.engine.kv_budget import bytes_per_block
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.model import model_bytes
from inference_service.model.shard import Shard
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter
from tests.conftest import build_peft_adapter
from tests.model_shapes import QWEN3_30B_A3B_CONFIG

SMOLLM2 = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
)
SMOLLM2_PAGES = (6, 4, 4, 6, 11, 11, 11)
QV_RANK8 = (1, 0, 1, 0, 0, 0, 0)
QV_RANK64 = (8, 0, 8, 0, 0, 0, 0)
ALL_RANK64 = (8,) * 7


def _units(need: tuple[int, ...]) -> int:
    return sum(n * size for n, size in zip(need, SMOLLM2_PAGES, strict=True))


def test_smollm2_unit_divides_every_page():
    assert unit_elements(SMOLLM2) == 1536
    assert page_units(SMOLLM2) == (*SMOLLM2_PAGES, 1)  # then the vocabulary side's run: a unit a page


QWEN3_30B_A3B = ModelConfig.from_dict(QWEN3_30B_A3B_CONFIG)


def test_an_expert_targets_page_holds_every_experts_rank_rows():
    """q, k, v, o, router, then gate, up, down of all 128 experts: a page of an expert target is
    128 expert-sized pages, so an adapter on the experts takes 128 times a dense layer's bytes."""
    assert unit_elements(QWEN3_30B_A3B) == 8 * 128  # gcd(6144, 2560, 2176, 2816) = 128
    assert page_units(QWEN3_30B_A3B) == (48, 20, 20, 48, 17, 128 * 22, 128 * 22, 128 * 22, 1)
    down_rank8 = (0, 0, 0, 0, 0, 0, 0, 1, 0)
    assert adapter_bytes(QWEN3_30B_A3B, down_rank8, torch.bfloat16) == 48 * 128 * 8 * (768 + 2048) * 2
    rank16 = slot_memory(QWEN3_30B_A3B, 1, 16, torch.bfloat16)
    assert rank16 == 48 * 2 * 8 * (6144 + 2560 * 2 + 6144 + 2176 + 3 * 128 * 2816) * 2


H100_BYTES = 80 << 30  # nominal; nothing else on the GPU


def test_adapter_memory_that_does_not_fit_beside_the_weights_is_refused_at_start_naming_the_bytes():
    """Qwen3-30B-A3B in bfloat16: 61 GB of weights. Four rank-64 adapters on every module take 27 GB,
    past 0.9 of an 80 GiB GPU with them; four rank-16 ones (6.8 GB) fit, and so do two rank-64 ones."""
    weights = model_bytes(QWEN3_30B_A3B, torch.bfloat16)
    assert weights == 61_064_245_504
    config = EngineConfig("m", dtype="bfloat16", max_lora_rank=64)
    kv = 4096 // config.block_size * bytes_per_block(QWEN3_30B_A3B, config)  # one 4,096-token request
    budget = int(0.9 * H100_BYTES)

    with pytest.raises(InvalidArgument) as refused:
        check_device_room(config, QWEN3_30B_A3B, weights, kv, budget)

    for part in (
        "base weights (61,064,245,504 bytes)",
        "adapter memory (27,056,406,528 bytes: --max-loras 4 adapters of --max-lora-rank 64)",
        "need 88,523,305,216 bytes, more than the 77,309,411,328 bytes --gpu-memory-utilization 0.9",
        "room for 2 adapters of max_lora_rank 64 on every module (6,764,101,632 bytes each in bfloat16)",
    ):
        assert part in str(refused.value)
    check_device_room(replace(config, max_lora_rank=16), QWEN3_30B_A3B, weights, kv, budget)
    check_device_room(replace(config, max_loras=2), QWEN3_30B_A3B, weights, kv, budget)
    with pytest.raises(InvalidArgument, match=r"\(27,056,406,528 bytes: --adapter-memory 27,056,406,528\)"):
        check_device_room(replace(config, adapter_memory=27_056_406_528), QWEN3_30B_A3B, weights, kv, budget)


@pytest.mark.gpu
def test_on_cuda_adapter_memory_past_the_gpu_is_refused_before_anything_is_allocated(tiny_models):
    total, allocated = torch.cuda.mem_get_info()[1], torch.cuda.memory_allocated()
    config = EngineConfig(str(tiny_models["llama"]), device="cuda", adapter_memory=total)
    with pytest.raises(InvalidArgument, match=f"bytes: --adapter-memory {total:,}\\)"):
        ModelRunner(config)
    assert torch.cuda.memory_allocated() == allocated


def test_adapter_bytes_scale_with_rank_and_targets():
    small = adapter_bytes(SMOLLM2, (*QV_RANK8, 0), torch.bfloat16)
    assert small == 30 * (6 + 4) * 1536 * 2
    assert 8 * small == adapter_bytes(SMOLLM2, (*QV_RANK64, 0), torch.bfloat16)
    assert adapter_bytes(SMOLLM2, (*QV_RANK8, 0), torch.float32) == 2 * small


def test_slot_memory_holds_exactly_that_many_full_adapters():
    memory = slot_memory(SMOLLM2, 4, 64, torch.bfloat16)
    assert memory == 4 * adapter_bytes(SMOLLM2, (*ALL_RANK64, 0), torch.bfloat16)
    assert memory_units(SMOLLM2, memory, torch.bfloat16) == 4 * _units(ALL_RANK64)
    assert memory_units(SMOLLM2, memory - 1, torch.bfloat16) == 4 * _units(ALL_RANK64) - 1
    assert slot_memory(SMOLLM2, 1, 12, torch.bfloat16) == slot_memory(SMOLLM2, 1, 16, torch.bfloat16)


@pytest.mark.parametrize("need, count", [(ALL_RANK64, 2), (QV_RANK64, 10), (QV_RANK8, 84)])
def test_the_memory_of_two_rank64_adapters_holds_more_smaller_ones(need, count):
    units = memory_units(SMOLLM2, slot_memory(SMOLLM2, 2, 64, torch.float16), torch.float16)
    memory = AdapterMemory(units, SMOLLM2_PAGES)
    for i in range(count):
        assert memory.can_acquire(f"a{i}", need)
        memory.acquire(f"a{i}", need)
    assert not memory.can_acquire("one more", need)
    assert memory.stats().bytes_used == count * _units(need)


def test_fits_only_what_the_empty_memory_holds():
    memory = AdapterMemory(_units(ALL_RANK64), SMOLLM2_PAGES)
    assert memory.fits(ALL_RANK64)
    assert not memory.fits((8, 8, 8, 8, 8, 8, 9))
    assert not AdapterMemory(10, SMOLLM2_PAGES).fits((0, 0, 0, 0, 1, 0, 0))


def test_a_resident_adapter_is_shared_and_pages_list_every_target_in_rank_order():
    memory = AdapterMemory(100, SMOLLM2_PAGES)
    assert memory.acquire("a", (2, 0, 1, 0, 0, 0, 0)) == (0, True)
    assert memory.acquire("a", (2, 0, 1, 0, 0, 0, 0)) == (0, False)
    assert memory.pages(0) == ((0, 6), (), (12,), (), (), (), ())
    assert memory.stats() == SlotStats(1, 0, 1, 16, 100)


def test_eviction_prefers_idle_adapters_waiting_requests_do_not_use_then_lru():
    need = (1, 0, 0, 0, 0, 0, 0)
    memory = AdapterMemory(18, SMOLLM2_PAGES)  # three 6-unit pages
    for digest in "abc":
        memory.acquire(digest, need)
    for slot in (0, 1, 2):  # a is least recently used
        memory.release(slot)
    assert memory.acquire("d", need, keep=frozenset("a")) == (1, True)  # b: the oldest not kept
    assert memory.resident("b") is None and memory.resident("a") == 0
    memory.release(1)
    assert memory.acquire("e", need, keep=frozenset("acd")) == (0, True)  # all kept: plain LRU
    assert memory.resident("a") is None
    assert memory.stats().evictions == 2


def test_fragmented_free_units_coalesce_as_idle_adapters_go():
    memory = AdapterMemory(28, (4, 11))
    for i in range(7):  # seven 4-unit pages fill the memory: a0 at 0, a1 at 4, ...
        memory.acquire(f"a{i}", (1, 0))
    for slot in (0, 2, 4, 6, 1, 3, 5):
        memory.release(slot)
    # Evicting a0, a2, a4 frees 12 units in 4-unit holes; a6 and a1 must go too before [0, 12) is one run.
    slot, activate = memory.acquire("big", (0, 1))
    assert activate and memory.pages(slot) == ((), (0,))
    assert memory.stats().evictions == 5
    assert {f"a{i}" for i in range(7) if memory.resident(f"a{i}") is not None} == {"a3", "a5"}


def test_busy_adapters_are_never_evicted():
    memory = AdapterMemory(12, SMOLLM2_PAGES)
    memory.acquire("a", (1, 0, 0, 0, 0, 0, 0))
    memory.acquire("b", (1, 0, 0, 0, 0, 0, 0))
    assert not memory.can_acquire("c", (1, 0, 0, 0, 0, 0, 0))
    memory.release(1)
    assert memory.can_acquire("c", (1, 0, 0, 0, 0, 0, 0))
    assert memory.acquire("c", (1, 0, 0, 0, 0, 0, 0)) == (1, True)
    assert memory.resident("a") == 0 and memory.drain_for((1, 0, 0, 0, 0, 0, 0)) == {0}


def test_a_vacated_slot_is_reused_only_after_its_references_are_released():
    need = (1, 0, 0, 0, 0, 0, 0)
    memory = AdapterMemory(18, SMOLLM2_PAGES)  # three 6-unit pages
    memory.acquire("a", need)
    memory.acquire("a", need)
    memory.vacate(0)
    assert memory.resident("a") is None and memory.stats().bytes_used == 0
    assert memory.pages(0) == ((),) * 7
    assert memory.acquire("b", need) == (1, True)
    memory.release(0)
    assert memory.acquire("c", need) == (2, True)  # slot 0 still has a holder
    memory.release(0)
    assert memory.stats().active == 2 and memory.stats().evictions == 0
    assert memory.acquire("a", need) == (0, True)
    assert memory.pages(0) == ((12,), (), (), (), (), (), ())


NEED = st.tuples(*[st.integers(0, 3)] * 7).filter(any)
DIGESTS = st.sampled_from([f"d{i}" for i in range(8)])


class RandomOperations(RuleBasedStateMachine):
    """Random acquire / release / vacate sequences, checked against what must stay resident:
    pages disjoint and inside the memory, busy adapters never evicted, evictions in order."""

    @initialize(units=st.integers(40, 160), needs=st.lists(NEED, min_size=8, max_size=8))
    def start(self, units: int, needs: list[tuple[int, ...]]):
        self.memory = AdapterMemory(units, SMOLLM2_PAGES)
        self.needs = {f"d{i}": need for i, need in enumerate(needs)}
        self.held: list[int] = []  # one slot per reference a running request holds
        self.resident: dict[str, int] = {}  # what must be resident, and where
        self.idle: list[str] = []  # resident and unused, least recently used first

    @rule(digest=DIGESTS, keep=st.frozensets(DIGESTS))
    def acquire(self, digest: str, keep: frozenset[str]):
        need = self.needs[digest]
        before = self._snapshot()
        able = self.memory.can_acquire(digest, need)
        assert self._snapshot() == before
        if not self.held:  # every resident adapter is idle: evicting them all leaves one free run
            assert able == self.memory.fits(need)
        if not able:
            with pytest.raises(MemoryError):
                copy.deepcopy(self.memory).acquire(digest, need, keep)
            return
        slot, activate = self.memory.acquire(digest, need, keep)
        assert activate == (digest not in self.resident)
        gone = [d for d in self.resident if self.memory.resident(d) is None]
        order = [d for d in self.idle if d not in keep] + [d for d in self.idle if d in keep]
        assert set(gone) == set(order[: len(gone)])  # the first idle adapters of the eviction order
        for d in gone:
            del self.resident[d]
        self.idle = [d for d in self.idle if d not in gone and d != digest]
        self.resident[digest] = slot
        self.held.append(slot)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 63))
    def release(self, index: int):
        slot = self.held.pop(index % len(self.held))
        self.memory.release(slot)
        digest = next((d for d, s in self.resident.items() if s == slot), None)
        if digest is not None and slot not in self.held:
            self.idle.append(digest)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 63))
    def vacate(self, index: int):
        slot = self.held[index % len(self.held)]
        self.memory.vacate(slot)
        self.resident = {d: s for d, s in self.resident.items() if s != slot}

    @invariant()
    def resident_pages_are_disjoint_inside_the_memory_and_counted(self):
        taken: set[int] = set()
        for digest, slot in self.resident.items():
            assert self.memory.resident(digest) == slot
            pages = self.memory.pages(slot)
            assert tuple(len(p) for p in pages) == self.needs[digest]
            for size, starts in zip(SMOLLM2_PAGES, pages, strict=True):
                for start in starts:
                    units = set(range(start, start + size))
                    assert not units & taken and start >= 0 and start + size <= self.memory.units
                    taken |= units
        assert self.memory.stats().bytes_used == len(taken)
        assert self.memory.stats().active == len(set(self.held))

    def _snapshot(self) -> tuple:
        slots = sorted(set(self.held) | set(self.resident.values()))
        return (
            self.memory.stats(),
            [self.memory.pages(s) for s in slots],
            self.memory.drain_for((1,) + (0,) * 6),
        )


RandomOperations.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_random_operations = RandomOperations.TestCase


@pytest.mark.parametrize("rank", [8, 40])
def test_a_tensor_parallel_rank_accounts_for_its_part_of_an_adapter(rank, tiny_models, tmp_path):
    """Adapter memory on a rank holds that rank's part, and its accounting (page units of the
    rank's shapes) is exactly the bytes of that part's image: less than one device's. Fully
    sharded holds least from rank 8N on: below it, a column layer's part of the rank rows still
    fills a whole page, beside every rank's B rows for its outputs."""
    model = ModelConfig.from_dir(tiny_models["llama"])
    folder = build_peft_adapter(
        tiny_models["llama"], tmp_path / "a", 3, r=rank, lora_alpha=2 * rank, target_modules="all-linear"
    )
    weights = load_peft_adapter("a", folder, model, 64, torch.float32)
    held = []
    for shard in (Shard(0, 1), Shard(0, 2), Shard(0, 2, fully_sharded=True)):
        image = AdapterImage.of(weights, model, torch.float32, shard)
        rank_model = shard.config(model)
        memory = AdapterMemory.for_model(4096, rank_model, torch.float32)
        assert memory.bytes_for(image.need) == sum(p.numel() * p.element_size() for p in image.pages)
        held.append(memory.bytes_for(image.need))
    one, split, fully = held
    assert (fully < split < one) if rank >= 16 else (split < fully < one)
