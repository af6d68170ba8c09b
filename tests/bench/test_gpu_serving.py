import math

from safetensors import safe_open

from bench.gpu_serving import (
    CASES,
    NA,
    SHAPES,
    ShapeRun,
    adapter_bytes,
    requests_of,
    row,
    weight_bytes,
)
from bench.random_adapter import write_random_adapter
from bench.random_model import write_random_llama
from shared.model_config import ModelConfig


def test_cases_are_the_base_model_at_1_32_128_requests_and_1_8_32_adapters_at_32_and_128():
    assert [case for case in CASES if not case[1]] == [(1, 0), (32, 0), (128, 0)]
    assert {case for case in CASES if case[1]} == {(r, n) for r in (32, 128) for n in (1, 8, 32)}


def test_adapters_go_round_robin_over_the_requests():
    assert requests_of((3, 0)) == [None, None, None]
    assert requests_of((5, 2)) == ["r16-0", "r16-1", "r16-0", "r16-1", "r16-0"]


def test_a_decode_step_reads_the_lm_head_once_and_an_untied_embedding_table_not_at_all(tmp_path):
    tiny = SHAPES["tiny"]
    tied = write_random_llama(tmp_path / "tied", **{**tiny, "tie_word_embeddings": True})
    untied = write_random_llama(tmp_path / "untied", **tiny)
    h, i, vocab = tiny["hidden_size"], tiny["intermediate_size"], tiny["vocab_size"]
    kv = tiny["num_key_value_heads"] * h // tiny["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    read = tiny["num_hidden_layers"] * layer + h + vocab * h  # the layers, the final norm, the LM head
    assert weight_bytes(tied, "bfloat16") == weight_bytes(untied, "bfloat16") == 2 * read


def test_adapter_bytes_are_the_bytes_of_a_written_adapter(tmp_path):
    model_dir = write_random_llama(tmp_path / "model", **SHAPES["tiny"])
    folder = write_random_adapter(ModelConfig.from_dir(model_dir), tmp_path / "a", 16, seed=0)
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        elements = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 - not iterable
    assert adapter_bytes(model_dir, "float32") == 4 * elements  # written in fp32
    assert adapter_bytes(model_dir, "bfloat16") == 2 * elements


def test_row_holds_medians_and_the_step_time_against_the_roofline():
    case = (32, 8)
    run = ShapeRun(
        "x",
        parameters=0,
        weight_bytes=2_000_000,
        adapter_bytes=100_000,
        ours={case: [1000.0, 4000.0, 3200.0]},
        ratios={case: [0.9, 0.5, 0.8]},
        hf={case: [100.0, 400.0, 200.0]},
        busy_graphs={case: 0.85},
        busy_eager={case: None},
    )
    r = row(run, case, bandwidth=1e9)  # 2.8 MB at 1 GB/s: 2.8 ms
    assert (r["decode tok/s"], r["ratio to base"], r["step ms"], r["roofline ms"]) == (3200.0, 0.8, 10.0, 2.8)
    assert (r["x roofline"], r["HF(+PEFT) tok/s"], r["ours / HF"]) == (3.57, 200.0, 16.0)
    assert (r["GPU busy % graphs"], r["GPU busy % eager"]) == ("85", NA)
    assert row(run, case, bandwidth=None)["x roofline"] == NA
