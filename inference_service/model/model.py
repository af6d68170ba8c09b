"""The Llama-family decoder in plain torch, with LoRA on every linear: dense (Llama, Mistral, Qwen2)
or with a sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE; moe.py)."""

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.attention import attend
from inference_service.model.base_weight import DenseWeight
from inference_service.model.collectives import Collectives
from inference_service.model.forward_batch import ForwardBatch
from inference_service.model.kv_cache import KVCache
from inference_service.model.lora_linear import LoRALinear
from inference_service.model.moe import SparseMoe
from inference_service.model.packed_weight import PackedWeight, PanelWeight, packed
from inference_service.model.placement import Placement
from inference_service.model.rope import apply_rope, cos_sin, inverse_frequencies
from inference_service.model.shard import Shard
from inference_service.model.vocab_adapters import VocabParts, add_embedding_terms, add_head_terms
from inference_service.model.vocab_batch import VocabBatch
from kernels.cpu_linear import CpuLinear
from kernels.cpu_lora import CpuLora
from kernels.cpu_rms_norm import CpuRmsNorm
from shared.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, kernel: CpuRmsNorm | None = None) -> torch.Tensor:
        """x [..., size]; `kernel` (the compiled CPU one) takes rows of hidden states."""
        if kernel is not None and x.dim() == 2 and x.stride(1) == 1:
            return kernel(x, self.weight, self.eps)
        # Normalize in fp32 whatever the serving dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SplitRMSNorm(RMSNorm):
    """RMSNorm over a vector split across the ranks (OLMoE's norms over all of q and of k, under
    tensor parallelism): the squares of every rank's part are summed."""

    def __init__(self, size: int, full_size: int, eps: float, dtype, device, parallel: Collectives):
        super().__init__(size, eps, dtype, device)
        self.full_size, self.parallel = full_size, parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.parallel.all_reduce(x32.pow(2).sum(-1, keepdim=True))  # [tokens, 1]
        x32 = x32 * torch.rsqrt(squares / self.full_size + self.eps)
        return self.weight * x32.to(x.dtype)


class VocabEmbedding(nn.Module):
    """The embedding, its rows split across the ranks (all of them at one rank): a token whose row
    another rank holds reads zeros here, and the ranks' rows are summed. Adapters' embedding-side
    parts (vocab_adapters.py) apply to the rank's tokens before the sum."""

    def __init__(self, vocab_size: int, hidden: int, parallel: Collectives, dtype, device):
        super().__init__()
        self.start, stop = parallel.shard.vocab(vocab_size)
        # rows past the vocabulary (the last rank's padding) stay zero: no token reads them
        self.weight = nn.Parameter(torch.zeros(stop - self.start, hidden, dtype=dtype, device=device), False)
        self.parallel = parallel

    def forward(self, token_ids: torch.Tensor, vocab: VocabBatch | None, parts: VocabParts) -> torch.Tensor:
        if self.parallel.size == 1:
            x = F.embedding(token_ids, self.weight)  # [tokens, hidden]
            if vocab is not None:
                add_embedding_terms(x, token_ids, vocab, parts)
            return x
        local = token_ids - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # [tokens]
        local = local.masked_fill(elsewhere, 0)
        x = F.embedding(local, self.weight).masked_fill_(elsewhere[:, None], 0)  # [tokens, hidden]
        if vocab is not None:
            add_embedding_terms(x, local, vocab, parts)
        return self.parallel.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, pool: torch.Tensor, unit: int, place: Placement):
        """cfg: the model as this rank holds it (Shard.config); pool: the layer's adapter memory."""
        super().__init__()
        self.layer, self.cfg, self.parallel = layer, cfg, place.parallel
        kv = cfg.kv_size
        qkv_memory, o_memory = (
            (pool, unit, cfg.first_target("qkv_proj")),
            (pool, unit, cfg.first_target("o_proj")),
        )
        self.qkv_proj = place.linear(
            cfg.hidden_size, (cfg.q_size, kv, kv), cfg.qkv_bias, qkv_memory, "column"
        )
        o_bias = cfg.o_bias and place.parallel.shard.rank == 0  # row-parallel: added once to the sum
        self.o_proj = place.linear(cfg.q_size, (cfg.hidden_size,), o_bias, o_memory, "row")
        if cfg.qk_norm == "head":  # over each head (Qwen3)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, place.dtype, place.device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, place.dtype, place.device)
        elif cfg.qk_norm == "full":  # over all of q and of k (OLMoE)
            self.q_norm = _full_norm(cfg.q_size, cfg.rms_norm_eps, place)
            self.k_norm = _full_norm(cfg.kv_size, cfg.rms_norm_eps, place)

    def forward(self, x, batch: ForwardBatch, cache: KVCache, cos, sin) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        qkv = self.qkv_proj(x, batch.lora)  # [tokens, q + 2 kv]
        in_place = batch.rope is not None and cfg.qk_norm == "none"
        if in_place:  # q and k rotated where they lie in qkv, one call
            batch.rope(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)  # [tokens, heads, hd]
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)  # [tokens, kv_heads, hd]
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if not in_place:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        o = attend(q, k, v, cache, self.layer, batch.attention, cfg.head_dim**-0.5)  # [tokens, heads, hd]
        return self.parallel.all_reduce(self.o_proj(o.reshape(tokens, cfg.q_size), batch.lora))


def _full_norm(size: int, eps: float, place: Placement) -> RMSNorm:
    """An RMSNorm over all of q (or k), this rank's `size` of it: split across the ranks under
    tensor parallelism (KV heads are never replicated then: Shard.check)."""
    parallel = place.parallel
    if parallel.size == 1:
        return RMSNorm(size, eps, place.dtype, place.device)
    return SplitRMSNorm(size, size * parallel.size, eps, place.dtype, place.device, parallel)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, pool: torch.Tensor, unit: int, place: Placement):
        super().__init__()
        self.parallel = place.parallel
        inter = cfg.intermediate_size
        gate_up_memory = (pool, unit, cfg.first_target("gate_up_proj"))
        self.gate_up_proj = place.linear(
            cfg.hidden_size, (inter, inter), cfg.mlp_bias, gate_up_memory, "column"
        )
        down_memory = (pool, unit, cfg.first_target("down_proj"))
        down_bias = cfg.mlp_bias and place.parallel.shard.rank == 0  # row-parallel: added once to the sum
        self.down_proj = place.linear(inter, (cfg.hidden_size,), down_bias, down_memory, "row")

    def forward(self, x, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, batch.lora)  # [tokens, 2 inter]
        if batch.swiglu is not None:
            act = batch.swiglu(gate_up)  # [tokens, inter]
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [tokens, inter] each
            act = F.silu(gate) * up  # [tokens, inter]
        return self.parallel.all_reduce(self.down_proj(act, batch.lora))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, pool: torch.Tensor, unit: int, place: Placement):
        super().__init__()
        dtype, device, eps = place.dtype, place.device, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.self_attn = Attention(cfg, layer, pool, unit, place)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = SparseMoe(cfg, pool, unit, place) if cfg.moe else MLP(cfg, pool, unit, place)

    def forward(self, x, batch: ForwardBatch, cache: KVCache, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, batch.norm), batch, cache, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x, batch.norm), batch)


class LlamaModel(nn.Module):
    """Weights are allocated empty; `inference_service.model.weights.load_weights` fills them.
    The linear layers' base weights are held in the `quantization` format (base_weight.py);
    embeddings, norms and lm_head stay dense in `dtype`.
    Adapter memory is `lora_units` units of `lora_unit` elements in every layer (zeros; the
    engine copies adapters in): lora_pool [layers, units*unit].
    Under tensor parallelism (`parallel` over more than one rank) this is one rank's part of the
    model (shard.py): `cfg` is the whole model's, `rank_cfg` the shapes this rank holds."""

    def __init__(
        self,
        cfg: ModelConfig,
        lora_units: int,
        lora_unit: int,
        dtype: torch.dtype,
        device: torch.device | str,
        quantization: str = "none",
        parallel: Collectives | None = None,
    ):
        super().__init__()
        self.parallel = parallel = parallel or Collectives()
        parallel.shard.check_quantized(cfg, quantization)
        self.cfg, self.rank_cfg = cfg, parallel.shard.config(cfg)
        self.register_buffer(
            "lora_pool",
            torch.zeros(cfg.num_layers, lora_units * lora_unit, dtype=dtype, device=device),
            persistent=False,
        )
        self.vocab_parts = VocabParts(self.lora_pool)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel, dtype, device)
        place = Placement(dtype, device, quantization, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(self.rank_cfg, i, self.lora_pool[i], lora_unit, place) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens.weight
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.zeros_like(self.embed_tokens.weight), requires_grad=False)
        )
        self.register_buffer(
            "inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim).to(device), persistent=False
        )
        self.packed_head: PanelWeight | PackedWeight | None = None  # lm_head for the CPU, once pack() ran

    def pack(self, linear: CpuLinear | None, lora: CpuLora | None = None) -> None:
        """Once the weights are loaded, on a CPU: every dense linear weight and lm_head laid out for
        its matmuls (packed_weight.packed: for `linear` where it was built and runs), the `lora`
        kernels to run a layer's adapters with its matmul where they can (LoRALinear.pack). A tied
        head keeps its embedding dense beside the packed copy (vocab x hidden more bytes); an own
        head is let go once packed."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.pack(linear, lora)
            elif isinstance(module, SparseMoe):
                module.pack(linear)
        self.packed_head = packed(self.lm_head, linear)
        if self.packed_head is not None and not self.cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(self.lm_head.new_empty(0), requires_grad=False)

    def packed_bytes(self) -> int:
        """Bytes of the weights pack() laid out for the CPU (outside parameters and buffers)."""
        return sum(w.nbytes() for w in self._packed())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the model holds: its parameters, its buffers (adapter memory among them)
        and the weights pack() laid out."""
        packed = [t for weights in self._packed() for t in weights.tensors()]
        return [*self.parameters(), *self.buffers(), *packed]

    def _packed(self) -> "list[PanelWeight | PackedWeight]":
        weights = [m.packed for m in self.modules() if isinstance(m, DenseWeight)] + [self.packed_head]
        experts = [w for m in self.modules() if isinstance(m, SparseMoe) for w in m.packed_weights()]
        return [w for w in [*weights, *experts] if w is not None]

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Returns logits [logit_rows, vocab] in fp32."""
        x = self.embed_tokens(batch.token_ids, batch.vocab, self.vocab_parts)  # [tokens, hidden]
        cos, sin = cos_sin(self.inv_freq, batch.positions, x.dtype)  # [tokens, hd] each, for every layer
        for layer in self.layers:
            x = layer(x, batch, cache, cos, sin)
        x = self.norm(x[batch.logit_rows], batch.norm)  # [rows, hidden]
        if self.packed_head is not None:
            logits = self.packed_head.linear(x, None)  # [rows, vocab rows]
        else:
            logits = F.linear(x, self.lm_head)  # [rows, vocab rows]
        if batch.vocab is not None:
            add_head_terms(logits, x, batch.vocab, self.vocab_parts)
        logits = self.parallel.all_gather(logits)  # [rows, ranks * vocab rows]
        return logits[:, : self.cfg.vocab_size].float()  # [rows, vocab]


def model_bytes(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str = "none", shard: Shard | None = None
) -> int:
    """Device bytes of the model's weights in `dtype` and `quantization` (adapter memory aside),
    of `shard`'s part under tensor parallelism, counted on a build on the meta device: nothing
    is allocated, so this can be asked before a GPU is known to hold them."""
    model = LlamaModel(cfg, 0, 1, dtype, "meta", quantization, Collectives(shard))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
