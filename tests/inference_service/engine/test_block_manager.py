"""BlockManager and block hashes: a hash names one (parent, adapter content, tokens) and nothing
else; blocks are reference-counted, a freed block keeps its hash until a new block needs it,
least recently used first; a failed sequence's blocks leave the cache."""

from inference_service.engine.block_manager import ROOT, BlockManager, adapter_key, block_hash, chain

DIGEST = "sha256:" + "ab" * 32


def test_a_hash_names_its_parent_adapter_and_tokens_and_nothing_else():
    base, lora = adapter_key(None), adapter_key(DIGEST)
    tokens = [1, 2, 3, 4]
    h = block_hash(ROOT, base, tokens)
    assert h == block_hash(ROOT, base, list(tokens))
    others = [
        block_hash(ROOT, lora, tokens),  # the same tokens under an adapter
        block_hash(ROOT, adapter_key("sha256:" + "cd" * 32), tokens),  # under other weights
        block_hash(h, base, tokens),  # after another block
        block_hash(ROOT, base, [1, 2, 3, 5]),
        block_hash(ROOT, base, [1, 2, 3 + (1 << 32), 4]),  # ids differ above 32 bits
    ]
    assert len({h, *others}) == 1 + len(others)


def test_an_adapter_key_cannot_pass_for_the_base_model_or_spill_into_the_tokens():
    """Tagged and length-prefixed: no digest text makes an adapter key equal the base model's,
    and no adapter key and tokens read as another key and other tokens."""
    assert adapter_key(None) != adapter_key("")
    tokens = [7] * 4
    a = block_hash(ROOT, adapter_key(DIGEST), tokens)
    b = block_hash(ROOT, adapter_key(DIGEST + "\x07"), tokens[:3])
    assert a != b


def test_chain_extends_the_hashes_it_is_given():
    tokens = list(range(10))
    whole = chain(tokens, 4, adapter_key(None), [])
    assert len(whole) == 2 and whole[1] == block_hash(whole[0], adapter_key(None), [4, 5, 6, 7])
    assert chain(tokens, 4, adapter_key(None), whole[:1]) == whole


def test_a_freed_named_block_is_cached_until_a_new_block_needs_it():
    blocks = BlockManager(3)
    table = blocks.allocate(2)
    blocks.name(table[0], b"h0")
    blocks.free(table)
    assert (blocks.num_free, blocks.num_cached_free) == (3, 1)
    assert blocks.cached_prefix([b"h0", b"h1"]) == [table[0]]

    assert table[0] not in blocks.allocate(2)  # the unnamed ones go first
    assert blocks.cached_prefix([b"h0"]) == [table[0]]
    blocks.allocate(1)  # then the cached one: its hash goes
    assert blocks.cached_prefix([b"h0"]) == [] and blocks.num_cached_free == 0


def test_held_blocks_are_shared_by_reference_count():
    blocks = BlockManager(2)
    (block,) = blocks.allocate(1)
    blocks.name(block, b"h")
    blocks.take([block])  # a second sequence hit it
    blocks.free([block])
    assert blocks.num_free == 1  # still held by the first
    blocks.free([block])
    assert (blocks.num_free, blocks.num_cached_free) == (2, 1)
    blocks.take(blocks.cached_prefix([b"h"]))  # a hit revives a free cached block
    assert (blocks.num_free, blocks.num_cached_free) == (1, 0)


def test_a_second_copy_of_a_cached_block_stays_unnamed():
    blocks = BlockManager(2)
    first, second = blocks.allocate(2)
    blocks.name(first, b"h")
    blocks.name(second, b"h")  # computed at the same time by another request
    assert blocks.cached_prefix([b"h"]) == [first]
    blocks.free([first, second])
    assert blocks.num_cached_free == 1


def test_forget_drops_the_hashes_and_returns_the_blocks_no_one_else_holds():
    blocks = BlockManager(3)
    mine, shared = blocks.allocate(2)
    blocks.name(mine, b"m")
    blocks.name(shared, b"s")
    blocks.take([shared])
    assert blocks.forget([mine, shared]) == [mine]
    assert blocks.cached_prefix([b"m"]) == [] and blocks.cached_prefix([b"s"]) == []


def test_without_prefix_caching_nothing_is_named_or_shared():
    blocks = BlockManager(2, prefix_caching=False)
    (block,) = blocks.allocate(1)
    blocks.name(block, b"h")
    blocks.free([block])
    assert blocks.cached_prefix([b"h"]) == [] and blocks.num_cached_free == 0
