"""Causal attention over a flattened batch of prefill chunks and decode tokens, reading and
writing the paged KV cache, with the per-step metadata it needs."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_service.model.kv_cache import KVCache


@dataclass(frozen=True)
class SequenceChunk:
    """The new tokens of one sequence in this step: they follow `cached` tokens already in the
    blocks of `block_table` and sit at [token_start, token_start + num_tokens) of the batch."""

    block_table: list[int]
    cached: int
    num_tokens: int
    token_start: int


@dataclass(frozen=True)
class PrefillAttention:
    tokens: slice  # rows of the flattened batch
    blocks: torch.Tensor  # [blocks] holding positions [0, context)
    context: int  # cached + new tokens
    mask: torch.Tensor | None  # [new, context] bool; None = plain causal from position 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and used by every layer.

    Sequences with one new token are decoded together in one padded call; the others (prefill
    chunks) attend one sequence at a time.
    """

    positions: torch.Tensor  # [tokens] position of every new token in its sequence
    cache_slots: torch.Tensor  # [tokens] flat cache index (block * block_size + offset) to write it to
    prefills: tuple[PrefillAttention, ...]
    decode_tokens: torch.Tensor  # [decodes] rows of the flattened batch
    # [decodes, max_blocks] block tables, each padded with its own first block: masked positions
    # still enter SDPA's product (0 x NaN = NaN), so padding never reads another sequence's blocks
    decode_blocks: torch.Tensor
    decode_mask: torch.Tensor  # [decodes, 1, 1, max_blocks * block_size] bool

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        sliding_window: int | None,
        device: torch.device | str,
    ) -> "AttentionMetadata":
        positions, slots = [], []
        for c in chunks:
            for p in range(c.cached, c.cached + c.num_tokens):
                positions.append(p)
                slots.append(c.block_table[p // block_size] * block_size + p % block_size)
        decodes = [c for c in chunks if c.num_tokens == 1]
        width = max((len(c.block_table) for c in decodes), default=0)
        return cls(
            positions=_long(positions, device),
            cache_slots=_long(slots, device),
            prefills=tuple(
                _prefill(c, block_size, sliding_window, device) for c in chunks if c.num_tokens > 1
            ),
            decode_tokens=_long([c.token_start for c in decodes], device),
            decode_blocks=_long(
                [c.block_table + c.block_table[:1] * (width - len(c.block_table)) for c in decodes],
                device,
            ),
            decode_mask=_decode_mask(decodes, width * block_size, sliding_window, device),
        )


def _long(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _prefill(chunk: SequenceChunk, block_size: int, window: int | None, device) -> PrefillAttention:
    context = chunk.cached + chunk.num_tokens
    tokens = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
    blocks = _long(chunk.block_table[: -(-context // block_size)], device)
    if chunk.cached == 0 and (window is None or window >= context):
        return PrefillAttention(tokens, blocks, context, None)
    query_pos = torch.arange(chunk.cached, context, device=device)[:, None]  # [new, 1]
    key_pos = torch.arange(context, device=device)[None, :]  # [1, context]
    return PrefillAttention(tokens, blocks, context, _visible(query_pos, key_pos, window))


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
    are written into the cache first. Returns [tokens, heads, head_dim]."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]  # [blocks, block_size, kv_heads, hd]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.cache_slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.cache_slots, v)
    out = torch.empty_like(q)
    for p in meta.prefills:
        kp = k_cache.index_select(0, p.blocks).flatten(0, 1)[: p.context]  # [context, kv_heads, hd]
        vp = v_cache.index_select(0, p.blocks).flatten(0, 1)[: p.context]
        out[p.tokens] = _attend_one(q[p.tokens], kp, vp, p.mask, scale)
    if meta.decode_tokens.numel():
        out.index_copy_(0, meta.decode_tokens, _attend_decodes(q, k_cache, v_cache, meta, scale))
    return out


def _attend_one(q, k, v, mask, scale) -> torch.Tensor:
    # q: [new, heads, hd]; k, v: [context, kv_heads, hd]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [heads, new, hd]
    return o.transpose(0, 1)


def _attend_decodes(q, k_cache, v_cache, meta: AttentionMetadata, scale) -> torch.Tensor:
    # index_select, not advanced indexing: several times faster for these gathers on CPU
    decodes = meta.decode_blocks.shape[0]
    blocks = meta.decode_blocks.flatten()  # [decodes*width]
    qd = q.index_select(0, meta.decode_tokens)[:, :, None, :]  # [decodes, heads, 1, hd]
    kd = k_cache.index_select(0, blocks).view(decodes, -1, *k_cache.shape[2:]).transpose(1, 2)
    vd = v_cache.index_select(0, blocks).view(decodes, -1, *v_cache.shape[2:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o[:, :, 0, :]  # [decodes, heads, hd]
