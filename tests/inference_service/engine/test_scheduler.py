"""The scheduler alone, held to its rules: FCFS admission under max_num_seqs, the token budget
(long prompts chunked, running sequences first) and the KV cache (blocks taken as sequences grow,
strict FCFS on memory, preemption of the newest when a running sequence cannot grow, the prefix
cache); at most max_loras adapters in a step, activations only for digests not resident; a load
never makes anyone wait; and the drain rule's starvation bound. A workload over adapter
popularity (distinct, uniform, skewed, identical, as punica's kernel tests) checks every
invariant after every step.

No engine, no model: a real AdapterMemory and BlockManager, a fake host tier, and `Rig.run`
doing the engine's part of a step as Engine._step_locked, _emit and _finish do. Prompts are
distinct unless a test gives the tokens, so blocks are shared only where a test means them to be.
"""

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.host_tier import ReadyAdapter, Version
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.config import EngineConfig
from inference_service.engine.scheduler import Schedule, Scheduler
from inference_service.engine.sequence import Sequence, Status
from inference_service.sampling import SamplingParams

BLOCK_SIZE = 4
PAGE_UNITS = (1,) * 7  # a unit per page of every target: memory of N units holds N one-page adapters


def _image(rank: int) -> AdapterImage:
    """An image the scheduler sizes only: rank `rank` on q_proj, ceil(rank / 8) pages of one
    layer of width 1."""
    pages = [torch.zeros(-(-rank // 8) if t == 0 else 0, 1, 1) for t in range(7)]
    return AdapterImage((rank,) + (0,) * 6, tuple(pages))


class FakeHost:
    """What the scheduler asks of HostTier: get(name, digest) is that version ready (digest None:
    the name's current one), or None while it loads. A name not ready starts loading when first
    asked and lands `load_steps` collects later (None: only when the test calls install). Every
    version installed stays gettable by its digest until evicted, as the real tier keeps the
    versions requests are bound to."""

    def __init__(self, ready: tuple[str, ...], load_steps: int | None, ranks: dict[str, int]):
        self.ranks = ranks  # adapter name -> its rank on q_proj (default 8: one page)
        self._ready: dict[str, ReadyAdapter] = {}
        self._versions: dict[Version, ReadyAdapter] = {}
        self._loading: dict[str, int | None] = {}
        for name in ready:
            self.install(name)
        self.load_steps = load_steps
        self.held: Counter[str] = Counter()  # name -> waiting requests that use it
        self.arrivals: Counter[str] = Counter()  # name -> requests that arrived for it
        self.bound: Counter[Version] = Counter()  # version -> unfinished requests bound to it

    def hold(self, name: str, digest: str | None = None) -> None:
        self.arrivals[name] += 1
        self.keep(name, digest)

    def keep(self, name: str, digest: str | None = None) -> None:
        self.held[name] += 1
        self.get(name, digest)

    def release(self, name: str) -> None:
        self.held[name] -= 1
        assert self.held[name] >= 0, f"{name} released more often than held"

    def bind(self, version: Version) -> None:
        self.bound[version] += 1

    def unbind(self, version: Version) -> None:
        self.bound[version] -= 1
        assert self.bound[version] >= 0, f"{version} unbound more often than bound"

    def get(self, name: str, digest: str | None = None) -> ReadyAdapter | None:
        ready = self._versions.get(Version(name, digest)) if digest else self._ready.get(name)
        if ready is None:
            self._loading.setdefault(name, self.load_steps)
        return ready

    def collect(self) -> None:
        for name, left in list(self._loading.items()):
            if left == 0:
                self.install(name)
            elif left is not None:
                self._loading[name] = left - 1

    def evict(self, name: str) -> None:
        """The host tier dropped the adapter: the next get starts its load again."""
        del self._versions[self._ready.pop(name).version]

    def install(self, name: str, digest: str | None = None) -> None:
        """The load lands; a new digest is the name re-registered with new weights."""
        self._loading.pop(name, None)
        ready = ReadyAdapter(name, digest or f"digest-{name}", self._image(name))
        self._ready[name] = self._versions[ready.version] = ready

    def _image(self, name: str) -> AdapterImage:
        return _image(self.ranks.get(name, 8))

    def digest(self, name: str) -> str:
        return self._ready[name].digest

    def current(self, name: str | None) -> str | None:
        """What the engine binds a new request to: the loader's digest of the name, known here
        once its first load landed."""
        return self._ready[name].digest if name in self._ready else None

    def digests(self) -> set[str]:
        return {ready.digest for ready in self._ready.values()}


@dataclass
class Rig:
    scheduler: Scheduler
    slots: AdapterMemory
    blocks: BlockManager
    host: FakeHost
    added: int = 0

    def add(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        adapter: str | None = None,
        tokens: list[int] | None = None,
    ) -> Sequence:
        """A request of `tokens` (default: prompt_len tokens no other request has), bound to its
        adapter's current content as Engine.submit binds it."""
        self.added += 1
        prompt = tokens or [self.added * 1000 + i for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        seq = Sequence(request_id, prompt, params, adapter, self.host.current(adapter))
        self.scheduler.add(seq)
        return seq

    def schedule(self) -> Schedule:
        """Engine._step_locked up to the schedule: finished loads land first."""
        self.host.collect()
        return self.scheduler.schedule()

    def run(self, schedule: Schedule) -> None:
        """The rest of Engine._step_locked: each chunk reaching its prompt's end draws a token
        (any id: no stop ids or eos here), the scheduler postprocesses the step, and a sequence
        at max_tokens finishes (_emit); a refused sequence fails."""
        for seq, _ in schedule.refused:
            self.scheduler.finish(seq, "error")
        sampled = [(c.seq, len(c.seq.token_ids)) for c in schedule.chunks if c.samples]
        self.scheduler.postprocess(schedule.chunks, sampled)
        for seq, _ in sampled:
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")

    def step(self) -> Schedule:
        schedule = self.schedule()
        self.run(schedule)
        return schedule

    def drain(self, max_steps: int = 500) -> None:
        """Step until nothing waits or runs."""
        for _ in range(max_steps):
            if not (self.scheduler.waiting or self.scheduler.running):
                return
            self.step()
        raise AssertionError(f"requests still waiting or running after {max_steps} steps")


def _rig(
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 64,
    max_loras: int = 2,
    num_blocks: int = 64,
    ready: tuple[str, ...] = (),
    load_steps: int | None = None,
    ranks: dict[str, int] | None = None,
    prefix_caching: bool = True,
) -> Rig:
    """max_loras: units of adapter memory, so max_loras adapters of rank 8 fit (`ranks` sets an
    adapter's rank: rank 16 takes two units)."""
    slots, blocks = AdapterMemory(max_loras, PAGE_UNITS), BlockManager(num_blocks, prefix_caching)
    host = FakeHost(ready, load_steps, ranks or {})
    config = EngineConfig(
        "unused: the scheduler reads only its limits",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
    )
    scheduler = Scheduler(config, blocks, slots, host)
    return Rig(scheduler, slots, blocks, host)


def _chunks(schedule: Schedule) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in schedule.chunks]


def _activations(schedule: Schedule) -> list[tuple[int, str]]:
    return [(slot, ready.digest) for slot, ready in schedule.activations]


# --- FCFS, max_num_seqs and the token budget ----------------------------------------------------


def test_admits_in_arrival_order_up_to_max_num_seqs():
    rig = _rig(max_num_seqs=2)
    for name in ("a", "b", "c"):
        rig.add(name, 3, 2)
    assert _chunks(rig.step()) == [("a", 3), ("b", 3)]
    assert _chunks(rig.step()) == [("a", 1), ("b", 1)]  # both reach max_tokens and finish
    assert _chunks(rig.step()) == [("c", 3)]


def test_long_prompt_is_split_over_steps_by_the_token_budget():
    rig = _rig(max_num_batched_tokens=8)
    seq = rig.add("long", 20, 2)
    assert [_chunks(rig.step()) for _ in range(3)] == [[("long", 8)], [("long", 8)], [("long", 4)]]
    assert len(seq.output_token_ids) == 1  # the step that ends the prompt samples the first token
    assert _chunks(rig.step()) == [("long", 1)]
    assert seq.finish_reason == "length"


def test_last_admitted_prompt_takes_what_is_left_and_the_next_waits():
    rig = _rig(max_num_batched_tokens=10)
    for name in ("a", "b", "c", "d"):
        rig.add(name, 4, 5)
    assert _chunks(rig.step()) == [("a", 4), ("b", 4), ("c", 2)]  # d waits: the budget is spent
    assert _chunks(rig.step()) == [("a", 1), ("b", 1), ("c", 2), ("d", 4)]


def test_running_sequences_take_the_budget_before_a_new_prompt():
    rig = _rig(max_num_batched_tokens=8)
    rig.add("a", 2, 10)
    rig.add("b", 2, 10)
    assert _chunks(rig.step()) == [("a", 2), ("b", 2)]
    rig.add("long", 20, 1)
    assert _chunks(rig.step()) == [("a", 1), ("b", 1), ("long", 6)]
    assert _chunks(rig.step()) == [("a", 1), ("b", 1), ("long", 6)]


# --- the KV cache -------------------------------------------------------------------------------


def test_a_sequence_takes_a_block_at_each_block_boundary_and_gives_them_back_at_finish():
    rig = _rig(num_blocks=10)
    seq = rig.add("a", 5, 7)  # at most 11 positions computed: 3 blocks of 4, none reserved ahead
    held = []
    for _ in range(7):
        schedule = rig.schedule()
        held.append(len(seq.block_table))  # what the step's positions need, no more
        rig.run(schedule)
    assert held == [2, 2, 2, 2, 3, 3, 3]  # positions 5, then 6, ..., 11
    assert seq.finish_reason == "length" and seq.block_table == [] and rig.blocks.num_free == 10


def test_strict_fcfs_on_memory_a_small_request_does_not_overtake_a_big_one():
    rig = _rig(num_blocks=8)
    rig.add("first", 16, 8)  # 4 blocks for its prompt, 6 by its end
    big = rig.add("big", 20, 8)  # 5 blocks for its prompt: at most 4 free while `first` runs
    rig.add("small", 2, 2)  # 1 block would fit, but it is behind `big`
    for _ in range(8):
        assert {name for name, _ in _chunks(rig.step())} == {"first"}
    assert big.status is Status.WAITING
    assert _chunks(rig.step()) == [("big", 20), ("small", 2)]


def test_when_a_running_sequence_cannot_grow_the_newest_is_preempted_and_resumes_first():
    rig = _rig(max_num_seqs=2, num_blocks=4, prefix_caching=False)
    old, new = rig.add("old", 4, 12), rig.add("new", 4, 12)  # 1 block each, 4 by their ends
    rig.step()
    later = rig.add("later", 2, 2)  # max_num_seqs: waits behind the running two
    for _ in range(4):
        assert _chunks(rig.step()) == [("old", 1), ("new", 1)]  # position 4 took both last blocks

    schedule = rig.step()  # position 8: old needs a third block, and none is free

    assert _chunks(schedule) == [("old", 1)]
    assert (new.status, new.block_table, new.slot, new.num_computed) == (Status.WAITING, [], -1, 0)
    assert list(rig.scheduler.waiting) == [new, later] and rig.scheduler.stats().preemptions == 1
    rig.drain()
    assert (old.preemptions, new.preemptions) == (0, 1)
    assert [len(s.output_token_ids) for s in (old, new, later)] == [12, 12, 2]


def test_a_preempted_sequence_is_computed_again_from_its_first_token_and_draws_on():
    rig = _rig(max_num_seqs=2, num_blocks=4, prefix_caching=False)
    rig.add("old", 4, 12)
    new = rig.add("new", 4, 12)
    for _ in range(6):
        rig.step()  # new is preempted in the sixth, with 4 prompt tokens and 5 drawn
    drawn = list(new.output_token_ids)
    while new.status is Status.WAITING:
        schedule = rig.step()
    assert _chunks(schedule) == [("new", 9)]  # every token it had, its last one's logits drawing the next
    assert new.output_token_ids[:5] == drawn and len(new.output_token_ids) == 6


def test_a_step_that_preempted_admits_nobody():
    """The victim waits for its adapter (the host tier dropped it meanwhile), so `later` could
    take the blocks it gave back at once; it gets them a step later, when the running ones have
    had their growth."""
    rig = _rig(max_num_seqs=2, num_blocks=4, ready=("a",), prefix_caching=False)
    rig.add("old", 4, 12)
    new = rig.add("new", 4, 12, "a")
    rig.step()
    later = rig.add("later", 2, 2)
    for _ in range(4):
        rig.step()
    rig.host.evict("a")

    assert _chunks(rig.step()) == [("old", 1)]  # new preempted; later not admitted in that step
    assert new.status is Status.WAITING and later.status is Status.WAITING
    assert _chunks(rig.step()) == [("old", 1), ("later", 2)]


def test_the_oldest_running_sequence_is_never_preempted_and_everyone_finishes():
    rig = _rig(max_num_seqs=4, num_blocks=6, prefix_caching=False)
    seqs = [rig.add(f"s{i}", 6, 14) for i in range(4)]  # 5 blocks each by the end: room for one
    oldest = seqs[0]
    for _ in range(200):
        if not (rig.scheduler.waiting or rig.scheduler.running):
            break
        rig.step()
        if oldest.status is not Status.FINISHED:
            assert oldest.preemptions == 0 and oldest is rig.scheduler.running[0]
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 14 for s in seqs)
    assert rig.scheduler.stats().preemptions > 0 and rig.blocks.num_free == 6


# --- the prefix cache ---------------------------------------------------------------------------

SHARED = list(range(100, 113))  # 13 tokens: 3 full blocks, then one token


def _finished(rig: Rig, request_id: str, tokens: list[int], adapter: str | None = None) -> Sequence:
    seq = rig.add(request_id, len(tokens), 1, adapter, tokens)
    rig.drain()
    return seq


def test_a_prompt_seen_before_starts_after_its_cached_full_blocks():
    rig = _rig()
    first = _finished(rig, "first", SHARED)
    assert first.cached_tokens == 0
    again = rig.add("again", len(SHARED), 1, tokens=SHARED)
    assert _chunks(rig.step()) == [("again", 1)]  # 12 positions from the cache, 1 computed
    assert again.cached_tokens == 12
    stats = rig.scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (26, 12)


def test_the_last_prompt_token_is_always_computed_even_when_its_block_is_cached():
    rig = _rig()
    aligned = SHARED[:12]  # exactly 3 full blocks
    _finished(rig, "first", aligned)
    again = rig.add("again", 12, 1, tokens=aligned)
    assert _chunks(rig.step()) == [("again", 4)]  # its last block computed again, for the logits
    assert again.cached_tokens == 8


@pytest.mark.parametrize(
    ("first", "then"),
    [("a", "b"), (None, "a"), ("a", None)],
    ids=["another-adapter", "base-then-adapter", "adapter-then-base"],
)
def test_the_same_tokens_under_other_weights_share_no_block(first, then):
    rig = _rig(ready=("a", "b"))
    _finished(rig, "first", SHARED, first)
    other = rig.add("other", len(SHARED), 1, then, SHARED)
    assert _chunks(rig.step()) == [("other", 13)] and other.cached_tokens == 0


def test_a_re_registered_adapter_never_meets_its_old_blocks():
    rig = _rig(ready=("a",))
    _finished(rig, "first", SHARED, "a")
    rig.host.install("a", digest="digest-a-v2")  # the same name, new weights
    other = rig.add("other", len(SHARED), 1, "a", SHARED)
    assert _chunks(rig.step()) == [("other", 13)] and other.cached_tokens == 0


def test_running_sequences_share_their_prefix_blocks_until_the_last_one_ends():
    rig = _rig(num_blocks=8)
    first = rig.add("first", len(SHARED), 6, tokens=SHARED)
    rig.step()  # its 3 full blocks are cached once computed
    second = rig.add("second", len(SHARED), 2, tokens=SHARED)
    rig.step()
    assert second.block_table[:3] == first.block_table[:3] and second.cached_tokens == 12
    assert rig.blocks.num_free == 8 - 5  # 3 shared, and each its own fourth
    rig.step()  # second finishes: the shared blocks stay with first
    assert second.status is Status.FINISHED and rig.blocks.num_free == 8 - 4
    rig.drain()
    assert rig.blocks.num_free == 8 and rig.scheduler.stats().kv_blocks_cached == 4  # first's full ones


def test_cached_blocks_are_evicted_least_recently_used_first():
    rig = _rig(num_blocks=4)
    one, two = list(range(200, 205)), list(range(300, 305))  # 1 full block each, then a token
    _finished(rig, "one", one)
    _finished(rig, "two", two)  # two's full block is used after one's
    rig.add("big", 12, 1)  # 3 new blocks: the 2 never used, then the least recently used cached one...
    rig.drain()
    again_two = rig.add("again-two", 5, 1, tokens=two)
    again_one = rig.add("again-one", 5, 1, tokens=one)
    rig.step()
    assert (again_two.cached_tokens, again_one.cached_tokens) == (4, 0)  # ...and one's, the oldest


def test_a_preempted_sequence_resumes_from_its_cached_blocks():
    rig = _rig(max_num_seqs=2, num_blocks=5)
    rig.add("old", 4, 12)
    new = rig.add("new", 4, 12)
    for _ in range(6):
        rig.step()  # new is preempted in the sixth, its 2 full blocks cached
    hits = rig.scheduler.stats().prefix_cache_hits
    while new.status is Status.WAITING:
        schedule = rig.step()
    assert _chunks(schedule)[-1][0] == "new"
    assert rig.scheduler.stats().prefix_cache_hits > hits
    assert new.cached_tokens == 0  # usage counts its first admission's


# --- adapters and slots -------------------------------------------------------------------------


def test_at_most_max_loras_distinct_adapters_run_in_a_step():
    rig = _rig(max_loras=2, ready=("a", "b", "c"))
    rig.add("a1", 4, 3, "a")
    rig.add("b1", 4, 3, "b")
    c1 = rig.add("c1", 4, 3, "c")
    assert _chunks(rig.step()) == [("a1", 4), ("b1", 4)]
    assert c1.status is Status.WAITING
    rig.step()
    rig.step()  # a1 and b1 finish: both slots idle
    assert _chunks(rig.step()) == [("c1", 4)]


def test_activation_only_when_the_digest_is_not_resident():
    rig = _rig(max_loras=2, ready=("a",))
    a1, a2 = rig.add("a1", 4, 2, "a"), rig.add("a2", 4, 2, "a")
    ((slot, digest),) = _activations(rig.step())  # one copy serves both requests
    assert digest == "digest-a" and a1.slot == a2.slot == slot
    rig.drain()
    a3 = rig.add("a3", 4, 2, "a")
    assert _activations(rig.step()) == [] and a3.slot == slot  # still resident in its idle slot
    rig.drain()
    rig.host.install("a", digest="digest-a-v2")  # re-registered: new weights, new digest
    a4 = rig.add("a4", 4, 2, "a")
    assert _activations(rig.step()) == [(a4.slot, "digest-a-v2")]


def test_the_least_recently_used_idle_slot_is_the_one_evicted():
    rig = _rig(max_loras=2, ready=("a", "b", "c"))
    rig.add("a1", 4, 1, "a")
    ((slot_a, _),) = _activations(rig.step())  # a1 finishes in its first step: a's slot idle
    rig.add("b1", 4, 1, "b")
    ((slot_b, _),) = _activations(rig.step())  # b's slot idle too, used after a's
    rig.add("c1", 4, 1, "c")
    assert _activations(rig.step()) == [(slot_a, "digest-c")]
    rig.add("b2", 4, 1, "b")
    assert _activations(rig.step()) == []  # b kept slot_b
    assert slot_a != slot_b


def test_base_model_requests_need_no_slot():
    rig = _rig(max_loras=1, ready=("a", "b"))
    rig.add("a1", 4, 3, "a")
    b1 = rig.add("b1", 4, 3, "b")  # the one slot is a's
    base = rig.add("base", 4, 3)
    assert _chunks(rig.step()) == [("a1", 4), ("base", 4)]
    assert base.slot == -1 and b1.status is Status.WAITING


def test_a_request_whose_adapter_is_loading_is_skipped_and_later_ones_are_admitted():
    rig = _rig(num_blocks=4, ready=("a",))
    cold = rig.add("cold", 8, 4, "cold")  # 3 blocks; asking for `cold` starts its load
    rig.add("warm", 4, 4, "a")  # 2 blocks
    rig.add("base", 4, 4)  # 2 blocks: with warm's, the whole cache
    assert _chunks(rig.step()) == [("warm", 4), ("base", 4)]  # not even memory waits for a load
    assert cold.status is Status.WAITING
    rig.host.install("cold")  # landed, but warm and base grow into every block until they finish
    assert [_chunks(rig.step()) for _ in range(3)] == [[("warm", 1), ("base", 1)]] * 3
    assert _chunks(rig.step()) == [("cold", 8)]


def test_finish_frees_a_sequence_mid_prompt_and_drops_a_waiting_one():
    rig = _rig(max_num_batched_tokens=4, max_loras=1, num_blocks=8, ready=("a",))
    running = rig.add("running", 10, 2, "a")  # its first chunk of 4 takes a block
    waiting = rig.add("waiting", 2, 2, "a")
    assert _chunks(rig.step()) == [("running", 4)]  # the budget is spent: `waiting` waits
    rig.scheduler.finish(waiting, "abort")
    rig.scheduler.finish(running, "abort")
    assert rig.blocks.num_free == 8 and rig.slots.active == 0
    assert running.slot == -1 and running.block_table == [] and running.finish_reason == "abort"
    assert _chunks(rig.step()) == []


def test_unfinished_sequences_are_found_by_request_id_until_they_finish():
    rig = _rig(max_num_batched_tokens=4, num_blocks=8)
    first, second = rig.add("first", 2, 2), rig.add("second", 2, 2)
    rig.step()
    assert rig.scheduler.get("first") is first and rig.scheduler.sequences == [first, second]
    rig.scheduler.finish(first, "abort")
    rig.scheduler.finish(first, "stop")  # a second finish (an abort racing a stop) changes nothing
    assert first.finish_reason == "abort" and rig.blocks.num_free == 8 - 1
    assert rig.scheduler.get("first") is None and rig.scheduler.sequences == [second]


# --- the starvation bound -----------------------------------------------------------------------

STREAM_STEPS, C_ARRIVES, STREAM_MAX_TOKENS = 30, 10, 4
# The drained slot's newest sequence was admitted before `c` arrived; every prompt fits one step,
# so that sequence finishes within STREAM_MAX_TOKENS steps and `c` takes its slot the step after.
STARVATION_BOUND = STREAM_MAX_TOKENS


def test_a_waiting_adapter_is_admitted_within_a_bound_despite_a_steady_stream():
    """Both slots stay busy with a new request for `a` and one for `b` every step; `c` arrives at
    step C_ARRIVES. The least recently acquired busy slot (a's) is drained: nobody new joins it,
    `b` keeps being served, and `c` gets the slot. Without the drain rule `c` waits as long as
    the stream lasts."""
    rig = _rig(max_loras=2, ready=("a", "b", "c"))
    admitted = None
    for step in range(STREAM_STEPS):
        if step == C_ARRIVES:
            rig.add("c", 4, STREAM_MAX_TOKENS, "c")
        a = rig.add(f"a{step}", 4, STREAM_MAX_TOKENS, "a")
        b = rig.add(f"b{step}", 4, STREAM_MAX_TOKENS, "b")
        scheduled = {name for name, _ in _chunks(rig.step())}
        if step < C_ARRIVES:
            assert rig.slots.active == 2  # the stream keeps every slot busy
        elif admitted is None and "c" in scheduled:
            admitted = step
        elif admitted is None:  # c waits: a's slot drains, b's serves on
            assert a.status is Status.WAITING and b.request_id in scheduled
    assert admitted is not None and admitted - C_ARRIVES <= STARVATION_BOUND
    rig.drain()
    assert rig.blocks.num_free == 64 and rig.slots.active == 0


def test_an_adapter_bigger_than_any_busy_one_is_admitted_within_the_bound():
    """Memory of 4 units, `a` and `b` at rank 16 take 2 each and stay busy with a steady stream;
    `c` at rank 32 needs all 4. Both busy adapters drain (nobody joins either), and `c` runs
    within the bound; draining one at a time would leave `c` waiting as long as the stream."""
    rig = _rig(max_loras=4, ready=("a", "b", "c"), ranks={"a": 16, "b": 16, "c": 32})
    admitted = None
    for step in range(STREAM_STEPS):
        if step == C_ARRIVES:
            rig.add("c", 4, STREAM_MAX_TOKENS, "c")
        rig.add(f"a{step}", 4, STREAM_MAX_TOKENS, "a")
        rig.add(f"b{step}", 4, STREAM_MAX_TOKENS, "b")
        if "c" in {name for name, _ in _chunks(rig.step())} and admitted is None:
            admitted = step
    assert admitted is not None and admitted - C_ARRIVES <= STARVATION_BOUND + 1
    rig.drain()
    assert rig.slots.active == 0


def test_small_adapters_share_a_step_in_the_memory_of_few_big_ones():
    """The adapters of a step are as many as fit: 4 units hold 4 rank-8 adapters or 1 rank-32."""
    rig = _rig(max_loras=4, ready=("a", "b", "c", "d", "big"), ranks={"big": 32})
    for name in ("a", "b", "c", "d"):
        rig.add(name, 4, 8, name)
    assert {name for name, _ in _chunks(rig.step())} == {"a", "b", "c", "d"}
    rig.add("big", 4, 8, "big")
    rig.step()
    assert rig.scheduler.get("big").status is Status.WAITING  # no room until they finish
    rig.drain()
    assert rig.slots.activations == 5


def test_an_adapter_larger_than_all_adapter_memory_is_refused_and_drains_nobody():
    """Memory of 2 units; `huge` at rank 32 needs 4, more than the empty memory holds. Its
    requests fail at once, naming the sizes, and `a`'s requests behind it keep being admitted:
    draining `a` for an adapter that can never fit would stall everyone."""
    rig = _rig(max_loras=2, ready=("a", "huge"), ranks={"huge": 32})
    rig.add("a0", 4, 8, "a")
    rig.step()
    huge = rig.add("huge", 4, 8, "huge")
    rig.add("a1", 4, 8, "a")
    schedule = rig.step()
    assert [seq for seq, _ in schedule.refused] == [huge] and huge.finish_reason == "error"
    assert "adapter 'huge' needs 4 bytes of adapter memory; this worker has 2" in str(schedule.refused[0][1])
    assert "a1" in {name for name, _ in _chunks(schedule)}
    rig.drain()
    assert rig.slots.active == 0 and not rig.host.held["huge"]


# --- a workload over adapter popularity ---------------------------------------------------------

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_LORAS, NUM_BLOCKS = 6, 16, 3, 40
NUM_REQUESTS, LAST_ARRIVAL, MAX_STEPS = 48, 30, 1000


def _adapter(popularity: str, i: int, rng: random.Random) -> str:
    if popularity == "distinct":
        return f"lora{i}"
    if popularity == "uniform":
        return f"lora{i % 4}"
    if popularity == "skewed":  # Zipf, alpha 2, over 6 adapters: lora0 two requests in three
        names = [f"lora{k}" for k in range(6)]
        return rng.choices(names, weights=[1 / (k + 1) ** 2 for k in range(6)])[0]
    return "lora0"  # identical


def _workload(popularity: str) -> list[tuple[int, str, int, int, str]]:
    """(arrival step, request id, prompt length, max_tokens, adapter), in arrival order."""
    rng = random.Random(17)
    requests = [
        (
            rng.randrange(LAST_ARRIVAL),
            f"r{i}",
            rng.randint(1, 40),
            rng.randint(1, 12),
            _adapter(popularity, i, rng),
        )
        for i in range(NUM_REQUESTS)
    ]
    return sorted(requests, key=lambda r: r[0])


def _check_state(rig: Rig, schedule: Schedule | None = None) -> None:
    """After a schedule (its chunks' positions have blocks) or after the step ran."""
    running = rig.scheduler.running
    scheduled = {id(c.seq): c.num_tokens for c in schedule.chunks} if schedule else {}
    assert len(running) <= MAX_NUM_SEQS
    assert len({s.adapter for s in running if s.adapter}) <= MAX_LORAS
    for seq in running:
        expected = rig.slots.resident(seq.digest) if seq.adapter else -1
        assert seq.slot == expected
        positions = seq.num_computed + scheduled.get(id(seq), 0)
        assert len(seq.block_table) == -(-positions // BLOCK_SIZE)  # no block taken ahead of need
    assert rig.slots.active == len({s.slot for s in running if s.slot >= 0})
    held = {block for s in running for block in s.block_table}  # shared prefixes count once
    assert rig.blocks.num_free + len(held) == rig.blocks.num_blocks
    assert all(not s.block_table and s.slot == -1 for s in rig.scheduler.waiting)
    waiting_names = Counter(s.adapter for s in rig.scheduler.waiting if s.adapter)
    assert +rig.host.held == waiting_names  # the host tier keeps what waiting requests name
    bound = Counter(Version(s.adapter, s.digest) for s in rig.scheduler.sequences if s.digest)
    assert +rig.host.bound == bound  # and the versions unfinished requests are bound to
    assert all(s.digest for s in running if s.adapter)  # bound by the time it runs


def _check_schedule(rig: Rig, schedule: Schedule, resident_before: set[str]) -> None:
    assert sum(c.num_tokens for c in schedule.chunks) <= MAX_NUM_BATCHED_TOKENS
    assert len({id(c.seq) for c in schedule.chunks}) == len(schedule.chunks)
    for c in schedule.chunks:  # never a token the sequence does not have yet
        assert c.seq.status is Status.RUNNING and c.num_tokens >= 1
        assert c.seq.num_computed + c.num_tokens <= len(c.seq.token_ids)
    for slot, ready in schedule.activations:
        assert ready.digest not in resident_before and rig.slots.resident(ready.digest) == slot


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "skewed", "identical"])
def test_workload_keeps_every_invariant_after_every_step(popularity):
    rig = _rig(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_LORAS, NUM_BLOCKS, load_steps=2)
    requests, seqs = _workload(popularity), []
    for step in range(MAX_STEPS):
        seqs += [rig.add(rid, p, m, a) for at, rid, p, m, a in requests if at == step]
        if step >= LAST_ARRIVAL and not (rig.scheduler.waiting or rig.scheduler.running):
            break
        resident_before = {d for d in rig.host.digests() if rig.slots.resident(d) is not None}
        schedule = rig.schedule()
        _check_state(rig, schedule)
        _check_schedule(rig, schedule, resident_before)
        rig.run(schedule)
        _check_state(rig)
    else:
        pytest.fail(f"requests still waiting or running after {MAX_STEPS} steps")
    assert len(seqs) == NUM_REQUESTS
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == s.params.max_tokens for s in seqs)
    assert rig.blocks.num_free == NUM_BLOCKS and rig.slots.active == 0
    adapters = {adapter for *_, adapter in requests}
    assert rig.slots.activations >= len(adapters)  # each copied in once, more if evicted between uses
    if popularity in ("distinct", "identical"):  # evicted between uses only around a preemption
        assert rig.slots.activations <= len(adapters) + rig.scheduler.stats().preemptions


def test_a_new_adapter_takes_the_idle_slot_no_waiting_request_uses():
    rig = _rig(max_num_seqs=1, max_loras=2, ready=("a", "b", "c"))
    for rid, adapter in (("b1", "b"), ("a1", "a")):
        rig.add(rid, 2, 1, adapter)
        rig.drain()  # b, then a, each ran and left its slot idle; b's is the least recently used
    rig.add("b2", 2, 1, "b")  # waits behind c: max_num_seqs is 1
    rig.add("c1", 2, 1, "c")
    rig.scheduler.waiting.rotate(1)  # c1 first

    schedule = rig.schedule()

    assert [ready.name for _, ready in schedule.activations] == ["c"]
    assert rig.slots.resident("digest-b") is not None  # kept for b2 although its slot was older...
    assert rig.slots.resident("digest-a") is None  # ...because nobody waits for a


def test_stats_name_the_adapters_of_running_and_of_waiting_requests_once_each_oldest_first():
    rig = _rig(max_num_seqs=3, max_loras=2, ready=("a", "b", "c"))
    for rid, adapter in (("b1", "b"), ("base", None), ("a1", "a"), ("b2", "b"), ("c1", "c")):
        rig.add(rid, 2, 5, adapter)
    assert rig.scheduler.stats().waiting_adapters == ("b", "a", "c")

    rig.step()  # b1, base and a1 run: max_num_seqs is 3

    stats = rig.scheduler.stats()
    assert (stats.running_adapters, stats.waiting_adapters) == (("b", "a"), ("b", "c"))
