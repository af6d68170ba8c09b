"""The KV cache's size: --kv-cache-tokens when given, else what memory allows (a byte budget on a
CPU, a share of the GPU after a profiled step on CUDA); a worker whose cache cannot hold one
max_model_len request refuses to start, naming both sizes."""

import subprocess
import sys

import pytest
import torch

from inference_service.engine import Engine, EngineConfig
from inference_service.engine.kv_budget import bytes_per_block, cuda_blocks
from inference_service.engine.model_runner import ModelRunner
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from tests.adapter_store.conftest import REPO

GIB = 1 << 30


def _config(tiny_models, **fields) -> EngineConfig:
    return EngineConfig(model=str(tiny_models["llama"]), **fields)


def test_a_block_holds_k_and_v_of_every_layer(tiny_models):
    model = ModelConfig.from_dir(tiny_models["llama"])  # 2 layers, 2 kv heads of 16
    assert bytes_per_block(model, _config(tiny_models, block_size=4)) == 2 * 2 * 4 * 2 * 16 * 4
    assert (
        bytes_per_block(model, _config(tiny_models, block_size=4, dtype="bfloat16")) == 2 * 2 * 4 * 2 * 16 * 2
    )


def test_on_a_cpu_the_cache_is_the_byte_budget_but_no_more_than_full_sequences_use(tiny_models):
    config = _config(tiny_models, kv_cache_memory=200 * 1024, block_size=4, max_num_seqs=8)
    runner = ModelRunner(config)
    per_block = bytes_per_block(runner.model_config, config)  # 2 KiB
    assert runner.num_blocks == 200 * 1024 // per_block == 100
    assert runner.cache.k.numel() * 4 * 2 == (100 + 1) * per_block  # and the decode graphs' scratch block

    roomy = ModelRunner(_config(tiny_models, kv_cache_memory=GIB, block_size=4, max_num_seqs=8))
    assert roomy.num_blocks == 8 * 256 // 4  # 8 sequences of the model's 256 positions


def test_kv_cache_tokens_overrides_memory(tiny_models):
    runner = ModelRunner(_config(tiny_models, kv_cache_tokens=1000, kv_cache_memory=1, block_size=16))
    assert runner.num_blocks == 63  # 1000 positions, in blocks of 16


def test_a_cache_too_small_for_one_full_request_refuses_to_start(tiny_models):
    with pytest.raises(InvalidArgument) as refused:
        Engine(_config(tiny_models, kv_cache_memory=15 * 8192, block_size=16))  # 15 blocks of 8 KiB
    assert str(refused.value) == (
        "the KV cache holds 240 token positions (--kv-cache-memory 122880), fewer than one request of "
        "max_model_len 256 needs (256): give the cache more memory or lower max_model_len"
    )
    with pytest.raises(InvalidArgument, match=r"holds 128 token positions \(--kv-cache-tokens 128\)"):
        Engine(_config(tiny_models, kv_cache_tokens=128))
    Engine(_config(tiny_models, kv_cache_tokens=128, max_model_len=128))  # a shorter limit fits


def test_the_worker_names_the_sizes_and_exits_when_its_cache_cannot_hold_a_request(tiny_models):
    args = ["--listen", "127.0.0.1:0", "--model", str(tiny_models["llama"]), "--kv-cache-tokens", "100"]
    done = subprocess.run(
        [sys.executable, "-m", "inference_service", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "inference worker: the KV cache holds 112 token positions (--kv-cache-tokens 100)" in done.stderr
    assert "Traceback" not in done.stderr


def test_on_cuda_the_cache_gets_what_utilization_leaves_after_others_and_the_profiled_peak():
    per_block = 1 << 20
    total, others, torch_reserved, peak = 80 * GIB, 2 * GIB, 20 * GIB, 18 * GIB
    free = total - others - torch_reserved
    blocks = cuda_blocks(total, free, torch_reserved, peak, 0.9, per_block)
    assert blocks == (int(0.9 * total) - others - peak) // per_block  # 52 GiB
    assert cuda_blocks(total, free, torch_reserved, 75 * GIB, 0.9, per_block) == 0  # nothing left


def test_the_profiled_step_is_the_largest_prefill_and_runs_on_any_device(tiny_models):
    runner = ModelRunner(_config(tiny_models, kv_cache_tokens=256, max_num_batched_tokens=100))
    logits = runner.profile_step()  # [1, vocab]
    assert logits.shape == (1, runner.model_config.vocab_size) and torch.isfinite(logits).all()
