"""Causal attention over a flattened batch of prefill chunks and decode tokens, reading and
writing the paged KV cache, with the per-step metadata it needs: on CUDA the Triton kernels read
the cache through block tables, elsewhere SDPA in torch runs over gathered blocks."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from inference_service.model.kv_cache import KVCache
from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.cpu_prefill_attention import CpuPrefillAttention, CpuPrefillStep
from kernels.paged_decode_attention import paged_decode_attention
from kernels.prefill_attention import prefill_attention, prefill_tiles


@dataclass(frozen=True)
class SequenceChunk:
    """The new tokens of one sequence in this step: they follow `cached` tokens already in the
    blocks of `block_table` and sit at [token_start, token_start + num_tokens) of the batch."""

    block_table: list[int]
    cached: int
    num_tokens: int
    token_start: int


# Query rows per SDPA call of a prefill chunk on the CPU. Torch's CPU flash kernel skips no work
# under its causal mask at these lengths (its key blocks are 512 wide), so a chunk attends in pieces
# of this many queries, each to the keys up to its own last: a 512-token chunk does 56% of the
# products, in 0.72 of one call's time (2 cores, fp32 and bf16).
PIECE_ROWS = 64


@dataclass(frozen=True)
class PrefillPiece:
    """Queries [rows] of a prefill chunk against the keys at positions [keys.start, keys.stop)."""

    rows: slice  # rows of the flattened batch
    keys: slice  # positions in the sequence
    mask: torch.Tensor | None  # [rows, keys] bool; None = causal, the rows' positions being the keys'


@dataclass(frozen=True)
class PrefillAttention:
    blocks: torch.Tensor  # [blocks] holding positions [0, context)
    context: int  # cached + new tokens
    pieces: tuple[PrefillPiece, ...]


@dataclass(frozen=True)
class SdpaPath:
    """The torch path (CPU): sequences with one new token are decoded together, by the compiled
    kernel that reads the cache in place where there is one, else in one padded SDPA call over
    their gathered blocks; the others (prefill chunks) attend by the compiled prefill kernel where
    there is one, else one sequence at a time, in SDPA calls over their gathered blocks."""

    prefills: tuple[PrefillAttention, ...]  # for SDPA: none with cpu_prefills
    # [decodes, max_blocks] block tables, each padded with its own first block: masked positions
    # still enter SDPA's product (0 x NaN = NaN), so padding never reads another sequence's blocks
    decode_blocks: torch.Tensor
    decode_contexts: torch.Tensor  # [decodes] int64: cached + 1
    sliding_window: int | None
    decode_kernel: CpuDecodeAttention | None
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_blocks * block_size] bool; None with the kernel
    cpu_prefills: CpuPrefillStep | None = None  # the step's prefill chunks, when the kernel takes them

    @classmethod
    def build(
        cls,
        prefills: list[SequenceChunk],
        decodes: list[SequenceChunk],
        block_size: int,
        window: int | None,
        device: torch.device | str,
        decode_kernel: CpuDecodeAttention | None = None,
        prefill_kernel: CpuPrefillAttention | None = None,
    ) -> "SdpaPath":
        width = max((len(c.block_table) for c in decodes), default=0)
        in_place = prefill_kernel is not None and bool(prefills)
        return cls(
            prefills=() if in_place else tuple(_prefill(c, block_size, window, device) for c in prefills),
            cpu_prefills=_cpu_prefills(prefill_kernel, prefills, block_size) if in_place else None,
            decode_blocks=_long(
                [c.block_table + c.block_table[:1] * (width - len(c.block_table)) for c in decodes],
                device,
            ),
            decode_contexts=_long([c.cached + 1 for c in decodes], device),
            sliding_window=window,
            decode_kernel=decode_kernel,
            decode_mask=None if decode_kernel else _decode_mask(decodes, width * block_size, window, device),
        )


@dataclass(frozen=True)
class KernelPath:
    """The Triton kernels' path (CUDA): one varlen prefill_attention launch for every prefill
    chunk, one paged_decode_attention launch for every decode. Block tables are cut to the blocks
    holding each context and padded with block 0, which the kernels never read."""

    decode_tables: torch.Tensor  # [decodes, max_blocks] int32
    decode_contexts: torch.Tensor  # [decodes] int32: cached + 1
    prefill_tables: torch.Tensor  # [prefills, max_blocks] int32
    query_starts: torch.Tensor  # [prefills] int32: each chunk's first row of the flattened batch
    query_lens: torch.Tensor  # [prefills] int32
    prefill_contexts: torch.Tensor  # [prefills] int32: cached + new tokens
    tiles: torch.Tensor  # [tiles, 2] int32: prefill_attention's work list
    sliding_window: int | None

    @classmethod
    def build(
        cls,
        prefills: list[SequenceChunk],
        decodes: list[SequenceChunk],
        block_size: int,
        window: int | None,
        device: torch.device | str,
    ) -> "KernelPath":
        query_lens = [c.num_tokens for c in prefills]
        contexts = [c.cached + c.num_tokens for c in prefills]
        return cls(
            decode_tables=_block_tables(decodes, block_size, device),
            decode_contexts=_int32([c.cached + 1 for c in decodes], device),
            prefill_tables=_block_tables(prefills, block_size, device),
            query_starts=_int32([c.token_start for c in prefills], device),
            query_lens=_int32(query_lens, device),
            prefill_contexts=_int32(contexts, device),
            tiles=prefill_tiles(query_lens, contexts, device),
            sliding_window=window,
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and used by every layer; `path` holds
    the inputs of the path this step's device runs."""

    positions: torch.Tensor  # [tokens] position of every new token in its sequence
    cache_slots: torch.Tensor  # [tokens] flat cache index (block * block_size + offset) to write it to
    decode_tokens: torch.Tensor  # [decodes] rows of the flattened batch
    path: SdpaPath | KernelPath

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        sliding_window: int | None,
        device: torch.device | str,
        kernels: bool | None = None,
        decode_kernel: CpuDecodeAttention | None = None,
        prefill_kernel: CpuPrefillAttention | None = None,
    ) -> "AttentionMetadata":
        """kernels: take the Triton kernels' path (default: on CUDA) rather than SDPA's, on which
        decode_kernel and prefill_kernel (where given) decode and prefill."""
        positions, slots = _positions_and_slots(chunks, block_size)
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        if kernels is None:
            kernels = torch.device(device).type == "cuda"
        if kernels:
            path = KernelPath.build(prefills, decodes, block_size, sliding_window, device)
        else:
            path = SdpaPath.build(
                prefills, decodes, block_size, sliding_window, device, decode_kernel, prefill_kernel
            )
        return cls(
            positions=torch.from_numpy(positions).to(device),
            cache_slots=torch.from_numpy(slots).to(device),
            decode_tokens=_long([c.token_start for c in decodes], device),
            path=path,
        )


def _positions_and_slots(chunks: list[SequenceChunk], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every new token's position, and the flat cache index it is written to: vectorized per
    chunk, so a long prefill costs numpy's time, not a Python loop's."""
    spans = [np.arange(c.cached, c.cached + c.num_tokens, dtype=np.int64) for c in chunks]
    blocks = [
        np.asarray(c.block_table, dtype=np.int64)[span // block_size]
        for c, span in zip(chunks, spans, strict=True)
    ]
    positions = np.concatenate([np.zeros(0, np.int64), *spans])
    return positions, np.concatenate([np.zeros(0, np.int64), *blocks]) * block_size + positions % block_size


def _long(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _int32(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _block_tables(chunks: list[SequenceChunk], block_size: int, device) -> torch.Tensor:
    tables = [c.block_table[: -(-(c.cached + c.num_tokens) // block_size)] for c in chunks]
    width = max((len(t) for t in tables), default=0)
    return _int32([t + [0] * (width - len(t)) for t in tables], device).view(len(tables), width)


def _cpu_prefills(
    kernel: CpuPrefillAttention, prefills: list[SequenceChunk], block_size: int
) -> CpuPrefillStep:
    starts, lens = [c.token_start for c in prefills], [c.num_tokens for c in prefills]
    contexts = [c.cached + c.num_tokens for c in prefills]
    tables = _block_tables(prefills, block_size, "cpu")
    return kernel.step(tables, *(_int32(values, "cpu") for values in (starts, lens, contexts)))


def _prefill(chunk: SequenceChunk, block_size: int, window: int | None, device) -> PrefillAttention:
    context = chunk.cached + chunk.num_tokens
    blocks = _long(chunk.block_table[: -(-context // block_size)], device)
    pieces = tuple(
        _piece(chunk, first, min(first + PIECE_ROWS, chunk.num_tokens), window, device)
        for first in range(0, chunk.num_tokens, PIECE_ROWS)
    )
    return PrefillAttention(blocks, context, pieces)


def _piece(chunk: SequenceChunk, first: int, end: int, window: int | None, device) -> PrefillPiece:
    """The chunk's new tokens [first, end): they see no key past the last of them, nor (in a
    sliding window) any before the window of the first."""
    start, stop = chunk.cached + first, chunk.cached + end  # their positions
    keys = slice(0 if window is None else max(0, start - window + 1), stop)
    rows = slice(chunk.token_start + first, chunk.token_start + end)
    if keys.start == start and (window is None or window >= end - first):
        return PrefillPiece(rows, keys, None)
    query_pos = torch.arange(start, stop, device=device)[:, None]  # [rows, 1]
    key_pos = torch.arange(keys.start, keys.stop, device=device)[None, :]  # [1, keys]
    return PrefillPiece(rows, keys, _visible(query_pos, key_pos, window))


def _decode_mask(decodes: list[SequenceChunk], width: int, window: int | None, device) -> torch.Tensor:
    query_pos = _long([c.cached for c in decodes], device)[:, None]  # [decodes, 1]
    key_pos = torch.arange(width, device=device)[None, :]  # [1, width]
    return _visible(query_pos, key_pos, window)[:, None, None, :]  # [decodes, 1, 1, width]


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    # Causality also hides the padding: every position past a query's own is unwritten or stale.
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] of the new tokens, which
    are written into the cache first. Returns [tokens, heads, head_dim], by the path meta.path
    names."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]  # [blocks, block_size, kv_heads, hd]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.cache_slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.cache_slots, v)
    if isinstance(meta.path, KernelPath):
        return _attend_kernels(q, k_cache, v_cache, meta.decode_tokens, meta.path, scale)
    return _attend_sdpa(q, k_cache, v_cache, meta.decode_tokens, meta.path, scale)


def _attend_kernels(q, k_cache, v_cache, decode_tokens, path: KernelPath, scale) -> torch.Tensor:
    out = prefill_attention(
        q, k_cache, v_cache, path.prefill_tables, path.query_starts, path.query_lens,
        path.prefill_contexts, path.tiles, scale, path.sliding_window,
    )  # fmt: skip
    if decode_tokens.numel():
        qd = q.index_select(0, decode_tokens)  # [decodes, heads, hd]
        od = paged_decode_attention(
            qd, k_cache, v_cache, path.decode_tables, path.decode_contexts, scale, path.sliding_window
        )
        out.index_copy_(0, decode_tokens, od)
    return out


def _attend_sdpa(q, k_cache, v_cache, decode_tokens, path: SdpaPath, scale) -> torch.Tensor:
    if path.cpu_prefills is not None:
        out = path.cpu_prefills.attend(q, k_cache, v_cache, scale, path.sliding_window)
    elif not path.prefills:  # a decode-only step: token i is sequence i's one new token
        return _attend_decodes(q, k_cache, v_cache, None, path, scale)
    else:
        out = torch.empty_like(q)
    for p in path.prefills:
        kp = k_cache.index_select(0, p.blocks).flatten(0, 1)[: p.context]  # [context, kv_heads, hd]
        vp = v_cache.index_select(0, p.blocks).flatten(0, 1)[: p.context]
        for piece in p.pieces:
            out[piece.rows] = _attend_one(q[piece.rows], kp[piece.keys], vp[piece.keys], piece.mask, scale)
    if decode_tokens.numel():
        out.index_copy_(0, decode_tokens, _attend_decodes(q, k_cache, v_cache, decode_tokens, path, scale))
    return out


def _attend_one(q, k, v, mask, scale) -> torch.Tensor:
    # q: [new, heads, hd]; k, v: [context, kv_heads, hd]. With a batch dimension of one: torch's
    # CPU SDPA takes its flash kernel only for 4-D inputs (3-D ones run the math path, which
    # materializes every score and is twice as slow on a 512-token chunk)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, heads, new, hd]
    return o[0].transpose(0, 1)


def _attend_decodes(q, k_cache, v_cache, decode_tokens, path: SdpaPath, scale) -> torch.Tensor:
    """decode_tokens None: every token of q is a decode, in order."""
    qd = q if decode_tokens is None else q.index_select(0, decode_tokens)  # [decodes, heads, hd]
    if path.decode_kernel is not None:
        return path.decode_kernel(
            qd, k_cache, v_cache, path.decode_blocks, path.decode_contexts, scale, path.sliding_window
        )
    # index_select, not advanced indexing: several times faster for these gathers on CPU
    decodes = path.decode_blocks.shape[0]
    blocks = path.decode_blocks.flatten()  # [decodes*width]
    kd = k_cache.index_select(0, blocks).view(decodes, -1, *k_cache.shape[2:]).transpose(1, 2)
    vd = v_cache.index_select(0, blocks).view(decodes, -1, *v_cache.shape[2:]).transpose(1, 2)
    # [decodes, kv_heads, width, hd] each. The query heads that share a KV head attend as its
    # `group` queries: no KV head is repeated, and in bf16 torch's CPU SDPA is fast (one query
    # per head runs 6 times slower there, and upcasting the gathered K and V costs their copies)
    kv_heads = kd.shape[1]
    group = qd.shape[1] // kv_heads
    qg = qd.view(decodes, kv_heads, group, qd.shape[2])  # [decodes, kv_heads, group, hd]
    o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=path.decode_mask, scale=scale)
    return o.reshape(qd.shape)  # [decodes, heads, hd]
