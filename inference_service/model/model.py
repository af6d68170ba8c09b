"""The Llama-family decoder in plain torch, with LoRA on every linear: dense (Llama, Mistral, Qwen2)
or with a sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE; moe.py)."""

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.attention import attend
from inference_service.model.forward_batch import ForwardBatch
from inference_service.model.kv_cache import KVCache
from inference_service.model.lora_linear import LoRALinear
from inference_service.model.moe import SparseMoe
from inference_service.model.rope import apply_rope, cos_sin, inverse_frequencies
from shared.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the serving dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, pool: torch.Tensor, unit: int, dtype, device, quantization
    ):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        kv = cfg.kv_size
        self.qkv_proj = LoRALinear(
            cfg.hidden_size,
            (cfg.q_size, kv, kv),
            cfg.qkv_bias,
            (pool, unit, cfg.first_target("qkv_proj")),
            dtype,
            device,
            quantization,
        )
        o_memory = (pool, unit, cfg.first_target("o_proj"))
        self.o_proj = LoRALinear(
            cfg.q_size, (cfg.hidden_size,), cfg.o_bias, o_memory, dtype, device, quantization
        )
        if cfg.qk_norm != "none":  # over each head (Qwen3) or over all of q and of k (OLMoE)
            full = cfg.qk_norm == "full"
            q_norm, k_norm = (cfg.q_size, cfg.kv_size) if full else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(q_norm, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(k_norm, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, batch: ForwardBatch, cache: KVCache, cos, sin) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        qkv = self.qkv_proj(x, batch.lora)  # [tokens, q + 2 kv]
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)  # [tokens, heads, hd]
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)  # [tokens, kv_heads, hd]
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        o = attend(q, k, v, cache, self.layer, batch.attention, cfg.head_dim**-0.5)  # [tokens, heads, hd]
        return self.o_proj(o.reshape(tokens, cfg.q_size), batch.lora)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, pool: torch.Tensor, unit: int, dtype, device, quantization):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = LoRALinear(
            cfg.hidden_size,
            (inter, inter),
            cfg.mlp_bias,
            (pool, unit, cfg.first_target("gate_up_proj")),
            dtype,
            device,
            quantization,
        )
        down_memory = (pool, unit, cfg.first_target("down_proj"))
        self.down_proj = LoRALinear(
            inter, (cfg.hidden_size,), cfg.mlp_bias, down_memory, dtype, device, quantization
        )

    def forward(self, x, batch: ForwardBatch) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, batch.lora).chunk(2, dim=-1)  # [tokens, inter] each
        return self.down_proj(F.silu(gate) * up, batch.lora)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, pool: torch.Tensor, unit: int, dtype, device, quantization
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, layer, pool, unit, dtype, device, quantization)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (
            SparseMoe(cfg, pool, unit, dtype, device)
            if cfg.moe
            else MLP(cfg, pool, unit, dtype, device, quantization)
        )

    def forward(self, x, batch: ForwardBatch, cache: KVCache, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x), batch)


class LlamaModel(nn.Module):
    """Weights are allocated empty; `inference_service.model.weights.load_weights` fills them.
    The linear layers' base weights are held in the `quantization` format (base_weight.py);
    embeddings, norms and lm_head stay dense in `dtype`.
    Adapter memory is `lora_units` units of `lora_unit` elements in every layer (zeros; the
    engine copies adapters in): lora_pool [layers, units*unit]."""

    def __init__(
        self,
        cfg: ModelConfig,
        lora_units: int,
        lora_unit: int,
        dtype: torch.dtype,
        device: torch.device | str,
        quantization: str = "none",
    ):
        super().__init__()
        self.cfg = cfg
        self.register_buffer(
            "lora_pool",
            torch.zeros(cfg.num_layers, lora_units * lora_unit, dtype=dtype, device=device),
            persistent=False,
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.lora_pool[i], lora_unit, dtype, device, quantization)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens.weight
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        )
        self.register_buffer(
            "inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim).to(device), persistent=False
        )

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Returns logits [logit_rows, vocab] in fp32."""
        x = self.embed_tokens(batch.token_ids)  # [tokens, hidden]
        cos, sin = cos_sin(self.inv_freq, batch.positions, x.dtype)  # [tokens, hd] each, for every layer
        for layer in self.layers:
            x = layer(x, batch, cache, cos, sin)
        x = self.norm(x[batch.logit_rows])  # [rows, hidden]
        return F.linear(x, self.lm_head).float()  # [rows, vocab]


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str = "none") -> int:
    """Device bytes of the model's weights in `dtype` and `quantization` (adapter memory aside),
    counted on a build on the meta device: nothing is allocated, so this can be asked before a
    GPU is known to hold them."""
    model = LlamaModel(cfg, 0, 1, dtype, "meta", quantization)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
