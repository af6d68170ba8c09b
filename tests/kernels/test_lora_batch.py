from kernels.lora_batch import RUN_ROWS, TILE_ROWS, AdapterPages, LoraBatch, PageChunks

# three adapters on targets 0 and 1 of two targets: ranks 8 (1 page), 20 (3 pages), 0 on target 1
ADAPTERS = {
    0: AdapterPages((8, 8), ((10,), (50,))),
    1: AdapterPages((20, 20), ((12, 30, 14), (52, 60, 56))),
    2: AdapterPages((16, 0), ((40, 20), ())),
}


def _rows(work: PageChunks) -> tuple[list[int], list[int]]:
    """(gather, scatter) of the chunks, spelled out where they are a range of tokens."""
    if work.gather is None:
        tokens = list(range(work.first, work.first + work.chunks * work.rows))
        return tokens, tokens
    return work.gather.tolist(), work.scatter.tolist()


def test_page_chunks_give_every_token_each_page_of_its_adapter_once_grouped_by_page_count():
    slots = [1, 0, -1, 1, 1, 2, 1, 1, 2]  # adapter 1 (3 pages) has 5 tokens; 0 (1 page) 1; 2 (2 pages) 2
    batch = LoraBatch.build(slots, ADAPTERS)
    assert [work.pages for work in batch.rows[0]] == [1, 2, 3]  # one batched matmul pair per page count
    got: dict[int, list[int]] = {}
    for work in batch.rows[0]:
        units = work.units.tolist()
        gather, scatter = _rows(work)
        assert len(units) == work.chunks * work.pages and len(gather) == work.chunks * work.rows
        for i, (token, target) in enumerate(zip(gather, scatter, strict=True)):
            pages = units[i // work.rows * work.pages :][: work.pages]  # the row's chunk's pages
            assert pages == list(ADAPTERS[slots[target]].pages[0])  # in rank order
            if token == len(slots):  # padding: the zero row, added to a token of the same adapter
                continue
            assert token == target and token not in got
            got[token] = pages
    assert got == {t: list(ADAPTERS[s].pages[0]) for t, s in enumerate(slots) if s >= 0}
    adapter1 = batch.rows[0][2]
    assert adapter1.rows == 5 and adapter1.gather is not None  # tokens 0, 3, 4, 6, 7: not a range


def test_chunks_of_tokens_in_order_without_padding_are_a_range():
    batch = LoraBatch.build([-1, 2, 2, 0, 0], ADAPTERS)  # grouped by adapter, as the engine orders a step
    one_page, two_pages = batch.rows[0]
    assert (one_page.gather, one_page.first, one_page.rows) == (None, 3, 2)
    assert (two_pages.gather, two_pages.first, two_pages.units.tolist()) == (None, 1, [40, 20])
    # two one-page adapters, 4 and 3 tokens: chunks of 4, the last one padded with the zero row 7,
    # which follows token 6 as if it were a token: still not a range (it must read zeros, add nowhere)
    one_page = {0: ADAPTERS[0], 3: AdapterPages((8, 8), ((11,), (51,)))}
    padded = LoraBatch.build([0, 0, 0, 0, 3, 3, 3], one_page).rows[0][0]
    assert padded.gather.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and padded.scatter.tolist()[-1] == 4


def test_a_long_run_of_one_adapter_is_read_in_place_and_pads_no_one_else():
    # adapter 0's prefill chunk of RUN_ROWS tokens between decodes of adapter 3 (one page too)
    one_page = {0: ADAPTERS[0], 3: AdapterPages((8, 8), ((11,), (51,)))}
    slots = [3, *[0] * RUN_ROWS, 3, -1, 3]
    run, rest = LoraBatch.build(slots, one_page).rows[0]
    assert (run.gather, run.first, run.rows, run.units.tolist()) == (None, 1, RUN_ROWS, [10])
    assert rest.rows == 3 and rest.gather.tolist() == [0, RUN_ROWS + 1, RUN_ROWS + 3]
    # one token fewer is not a run: padded beside adapter 3's, as before
    (shared,) = LoraBatch.build([3, *[0] * (RUN_ROWS - 1), 3, -1, 3], one_page).rows[0]
    assert shared.gather is not None and shared.chunks * shared.rows >= RUN_ROWS + 2


def test_a_target_no_adapter_of_the_step_has_costs_nothing():
    batch = LoraBatch.build([2, -1, 2], ADAPTERS)
    assert batch.rows[0] is not None and batch.rows[1] is None
    assert LoraBatch.build([-1, -1], ADAPTERS).rows == (None, None)


def test_kernel_tiles_cover_every_lora_token_once_and_no_tile_is_empty():
    # a 40-token prefill on adapter 0, three decodes on adapters 1, 2 and 1, base-model tokens between
    slots = [0] * 40 + [-1, 1, 2, -1, 1]
    table = LoraBatch.build(slots, ADAPTERS, kernels=True).table
    assert table.num_tiles == 3 + 2  # 40 rows in tiles of 16, 16, 8; one tile per decode segment
    tokens, starts, lengths = table.tokens.tolist(), table.starts.tolist(), table.lengths.tolist()
    covered = []
    for segment, row in zip(table.tile_segments.tolist(), table.tile_rows.tolist(), strict=True):
        assert 0 <= row < lengths[segment]  # a tile starts inside its segment: never idle
        end = min(row + TILE_ROWS, lengths[segment])
        covered += tokens[starts[segment] + row : starts[segment] + end]
    assert sorted(covered) == [i for i, s in enumerate(slots) if s >= 0]
    assert table.ranks.tolist() == [[8, 20, 16], [8, 20, 0]]
    assert table.pages[0, 1].tolist() == [12, 30, 14] and table.max_rank == 24
