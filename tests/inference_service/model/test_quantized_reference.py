"""LoRA on a quantized base, against transformers + PEFT holding the same quantized weights: torchao's
int8 weight-only and bitsandbytes' NF4 linear layers under PEFT's LoRA, the adapters mixed in one
batch with requests on the base model. The float64 yardstick is PEFT over the dequantized weights
in float64 (exact: every dequantized value is an fp32 number), so the bound is what fp32 costs."""

import re
import shutil

import pytest
import torch
from torch import nn

from inference_service.engine.block_manager import BlockManager
from inference_service.model.base_weight import Int8Weight, Nf4Weight
from inference_service.model.forward_batch import SequenceInput
from inference_service.model.lora_linear import LoRALinear
from kernels.cpu_linear import CpuLinear
from kernels.int8_linear import dequantize_int8_rows, quantize_int8_rows
from kernels.nf4_linear import dequantize_nf4, quantize_nf4
from tests.conftest import TINY_ADAPTERS, build_peft_adapter, build_tiny_model
from tests.fp32_agreement import assert_fp32_agrees

from .test_peft_reference import ROWS, Peft, _runner, _with_adapters, assert_decode_agrees

# PEFT notes that a layer it did not quantize itself cannot merge; nothing here merges.
pytestmark = pytest.mark.filterwarnings("ignore:TorchaoLoraLinear was instantiated:UserWarning")
torchao = pytest.importorskip("torchao")
bnb = pytest.importorskip("bitsandbytes")


def _int8_reference(linear: nn.Linear) -> nn.Linear:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    return linear


def _nf4_reference(linear: nn.Linear) -> nn.Module:
    """bitsandbytes' own layer; its CPU path for AVX-512 bf16 machines is a fused kernel that
    differs from dequantize-then-matmul by ~3e-3, so it is turned off to compare the math."""
    quantized = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, linear.bias is not None, torch.float32,
        compress_statistics=False, quant_type="nf4",
    )  # fmt: skip
    quantized.weight = bnb.nn.Params4bit(
        linear.weight.data, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
    )
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    quantized = quantized.to("cpu")
    quantized.support_avx512bf16_for_cpu = False
    return quantized


def _dequantized(weight: torch.Tensor, quantization: str) -> torch.Tensor:
    """The weight the quantized layer computes with, in float64 (our quantizers equal the
    references' bit for bit: tests/kernels/test_int8_linear.py, test_nf4_linear.py)."""
    if quantization == "int8":
        return dequantize_int8_rows(*quantize_int8_rows(weight), torch.float64)
    return dequantize_nf4(*quantize_nf4(weight), tuple(weight.shape), torch.float64)


REFERENCES = {"int8": _int8_reference, "nf4": _nf4_reference}
DECODE_STEPS = 32  # greedy tokens per prompt after the prefill


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple]:
    """Tiny Llama and Qwen2 whose every weight row is whole NF4 blocks (intermediate 128, not 96):
    bitsandbytes' CPU dequantize reads a block that straddles two rows differently from the blocks
    its quantize wrote (0.005 off; our NF4 follows the format, as bitsandbytes' default op does), so
    the reference is only itself on such shapes. model type -> (folder, adapter name -> folder)."""
    root = tmp_path_factory.mktemp("quantized")
    built = {}
    for model_type in ("llama", "qwen2"):
        folder = build_tiny_model(root / model_type, model_type, intermediate_size=128)
        adapters = {
            name: build_peft_adapter(folder, root / f"{model_type}-{name}", seed=i + 1, **lora)
            for i, (name, lora) in enumerate(TINY_ADAPTERS.items())
        }
        built[model_type] = (folder, adapters)
    return built


def _replace_linears(model: nn.Module, replace) -> None:
    """Every linear layer of the decoder (not lm_head) through `replace`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, replace(child))


def quantized_base(model_dir, quantization: str):
    """base(dtype): the model with its decoder's linear layers quantized as the references hold them
    (fp32), or dequantized (float64: the fp32 dequantized values, exact)."""
    from transformers import AutoModelForCausalLM

    def dequantized(linear: nn.Linear) -> nn.Linear:
        linear.weight.data = _dequantized(linear.weight.data, quantization).float()
        return linear

    def base(dtype):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _replace_linears(model, REFERENCES[quantization] if dtype == torch.float32 else dequantized)
        return model.to(dtype)

    return base


def _quantized_peft(model_dir, adapter_dirs, quantization: str) -> Peft:
    base = quantized_base(model_dir, quantization)
    return Peft(
        model_dir,
        adapter_dirs,
        [_with_adapters(base(d), adapter_dirs) for d in (torch.float32, torch.float64)],
    )


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_mixed_batch_on_a_quantized_base_matches_peft(model_type, quantization, models):
    model_dir, adapter_dirs = models[model_type]
    reference = _quantized_peft(model_dir, adapter_dirs, quantization)
    runner, slots, _ = _runner(model_dir, adapter_dirs, quantization)
    assert_decode_agrees(runner, slots, reference, ROWS, DECODE_STEPS, seed=2)


def test_quantized_bases_differ_from_the_dense_one_and_from_each_other(models):
    """Guards the test above against a quantization that does nothing."""
    prompt = [5, 6, 7, 8, 9]
    outputs = {}
    for quantization in ("none", "int8", "nf4"):
        runner, slots, _ = _runner(*models["llama"], quantization)
        table = BlockManager(runner.num_blocks).allocate(2)
        outputs[quantization] = runner.forward([SequenceInput(prompt, 0, table, slots["all8"])])
    assert (outputs["int8"] - outputs["none"]).abs().max() > 1e-4
    assert (outputs["nf4"] - outputs["none"]).abs().max() > (outputs["int8"] - outputs["none"]).abs().max()


def test_bf16_rows_on_an_nf4_base_give_the_dense_bf16_logits_of_its_dequantized_weights(models, tmp_path):
    """bf16 activations on NF4 weights take the compiled kernel where the CPU has AVX512-BF16, each
    weight looked up, scaled and rounded to bf16 as dequantize_nf4 rounds it: a mixed batch's
    prefill and decode logits equal, bit for bit, those of a dense bf16 base whose checkpoint holds
    the NF4 weights dequantized (they quantize back to the same codes and absmax)."""
    from safetensors.torch import load_file, save_file

    linear, _ = CpuLinear.load()
    if linear is None or not linear.runs_nf4(torch.zeros(1, dtype=torch.uint8), 64, torch.bfloat16):
        pytest.skip("no NF4 kernel for bf16 rows here (no AVX512-BF16)")
    model_dir, adapter_dirs = models["llama"]
    dense_dir = tmp_path / "dequantized"
    shutil.copytree(model_dir, dense_dir)
    weights = load_file(dense_dir / "model.safetensors")
    for name, weight in weights.items():
        if re.search(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", name):
            weights[name] = _dequantized(weight.float(), "nf4").to(weight.dtype)
    save_file(weights, dense_dir / "model.safetensors", metadata={"format": "pt"})
    nf4, slots, _ = _runner(model_dir, adapter_dirs, "nf4", dtype="bfloat16")
    dense, _, _ = _runner(dense_dir, adapter_dirs, dtype="bfloat16")
    _assert_takes_the_kernel(nf4, Nf4Weight)
    _assert_same_logits(nf4, dense, [*adapter_dirs], slots)


def test_bf16_rows_on_an_int8_base_round_as_int8_linear_does_the_dense_bf16_sums(models):
    """bf16 activations on int8 weights take the compiled kernel where the CPU has AVX512-BF16, each
    pair of weights widened to bf16: a mixed batch's prefill and decode logits equal, bit for bit,
    those of the same base whose int8 layers multiply the weights as dense bf16 ones, then round as
    kernels/int8_linear.py's ops do (times the scale, plus the bias), their adapters added apart."""
    linear, _ = CpuLinear.load()
    if linear is None or not linear.runs(torch.zeros(1, 2, dtype=torch.int8), torch.bfloat16):
        pytest.skip("no int8 kernel for bf16 rows here (no AVX512-BF16)")
    model_dir, adapter_dirs = models["llama"]
    int8, slots, _ = _runner(model_dir, adapter_dirs, "int8", dtype="bfloat16")
    apart, _, _ = _runner(model_dir, adapter_dirs, "int8", dtype="bfloat16")
    _assert_takes_the_kernel(int8, Int8Weight)
    for layer in (m for m in apart.model.modules() if isinstance(m, LoRALinear)):
        layer.base.forward, layer.panels = _dense_bf16_then_int8_roundings(layer.base, linear), None
    _assert_same_logits(int8, apart, [*adapter_dirs], slots)


def _dense_bf16_then_int8_roundings(base: Int8Weight, linear: CpuLinear):
    """A forward for `base` (packed: q in linear's panels): x times q widened to bf16 in the dense
    bf16 panels, times the scales and plus the bias as torch rounds each op in bf16."""
    out = base.scale.shape[0]
    q = base.q.transpose(1, 2).reshape(-1, base.q.shape[1])[:out]  # [out, in] from [panels, in, columns]
    dense = linear.pack(q.bfloat16())  # [panels, in, columns] bf16

    def forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = linear(x, dense, out, None) * base.scale.bfloat16()  # [tokens, out]
        return y if bias is None else y + bias

    return forward


def _assert_takes_the_kernel(runner, kind) -> None:
    """Every linear layer of `runner` holds `kind` weights in the compiled kernel's panels, its
    adapters added in the same call."""
    layers = [m for m in runner.model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(isinstance(m.base, kind) and m.base.linear is not None for m in layers)
    assert all(m.panels is not None for m in layers)


def _assert_same_logits(ours, expected, adapters: list[str], slots: dict[str, int]) -> None:
    """A mixed batch (each adapter and the base model) prefilled, then 3 decode steps on
    `expected`'s greedy tokens: the two runners' logits equal at every step, bit for bit."""
    rows = [(name, 5 + i) for i, name in enumerate([*adapters, None])]
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 160, (n,), generator=gen).tolist() for _, n in rows]
    slot_of = [-1 if a is None else slots[a] for a, _ in rows]
    blocks = {runner: BlockManager(runner.num_blocks) for runner in (ours, expected)}
    tables = {runner: [blocks[runner].allocate(8) for _ in rows] for runner in (ours, expected)}

    def step(runner, prefill: bool) -> torch.Tensor:
        inputs = [
            SequenceInput(s if prefill else s[-1:], 0 if prefill else len(s) - 1, table, slot)
            for s, table, slot in zip(sequences, tables[runner], slot_of, strict=True)
        ]
        return runner.forward(inputs, all_logits=prefill)

    for i in range(4):  # the prefill, then decode steps
        got, want = step(ours, i == 0), step(expected, i == 0)
        assert got.dtype == want.dtype == torch.float32  # a bf16 model's logits, widened
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), i
        last = torch.tensor([len(s) for s in sequences]).cumsum(0) - 1 if i == 0 else torch.arange(len(rows))
        for s, token in zip(sequences, want[last].argmax(dim=-1).tolist(), strict=True):
            s.append(token)


@pytest.fixture(scope="module")
def saved_nf4(models, tmp_path_factory):
    """The tiny Llama as transformers saves it quantized by bitsandbytes (NF4, double quantization),
    and that in-memory model, the reference."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    folder, quantized = _saved(models["llama"][0], config, tmp_path_factory.mktemp("nf4"))
    for module in quantized.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return folder, quantized


@pytest.fixture(scope="module")
def saved_int8(models, tmp_path_factory):
    """The tiny Llama as transformers saves it quantized by torchao (Int8WeightOnlyConfig, per row),
    and that in-memory model, the reference."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    config = TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False))
    return _saved(models["llama"][0], config, tmp_path_factory.mktemp("int8"))


def _saved(model_dir, config, root):
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    quantized.save_pretrained(root / "llama")
    return root / "llama", quantized


def _dequantized_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight a reference's quantized layer computes with, in float64; None for a dense one."""
    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).double()
    if isinstance(getattr(module, "weight", None), torchao.quantization.Int8Tensor):
        return module.weight.qdata.double() * module.weight.scale.double()  # [out, in] * [out, 1]
    return None


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_checkpoint_saved_pre_quantized_loads_as_its_library_computes_it(models, quantization, request):
    """NF4 with double quantization as bitsandbytes saves it, int8 as torchao saves it."""
    from transformers import AutoModelForCausalLM

    _, adapter_dirs = models["llama"]
    folder, quantized = request.getfixturevalue(f"saved_{quantization}")
    fp64 = AutoModelForCausalLM.from_pretrained(models["llama"][0], dtype=torch.float32).double()
    layers = dict(quantized.named_modules())
    replaced = 0
    for name, module in fp64.named_modules():
        weight = _dequantized_weight(layers[name]) if name in layers else None
        if isinstance(module, nn.Linear) and weight is not None:
            module.weight.data, replaced = weight, replaced + 1
    assert replaced == 7 * len(fp64.model.layers)
    reference = Peft(folder, adapter_dirs, [_with_adapters(m, adapter_dirs) for m in (quantized, fp64)])
    runner, slots, _ = _runner(folder, adapter_dirs)  # no --quantization: the folder says which
    assert runner.quantization == quantization
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 160, (n,), generator=gen).tolist() for _, n in ROWS]
    adapters = [a for a, _ in ROWS]
    blocks = BlockManager(runner.num_blocks)
    inputs = [
        SequenceInput(s, 0, blocks.allocate(-(-len(s) // 4)), -1 if a is None else slots[a])
        for s, a in zip(sequences, adapters, strict=True)
    ]
    logits = runner.forward(inputs, all_logits=True)
    expected, exact = reference.logits(sequences, adapters)
    assert_fp32_agrees(logits, torch.cat(expected), torch.cat(exact))
    assert logits.argmax(dim=-1).tolist() == torch.cat(expected).argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes (8-bit) is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "(fp4)"),
        (
            {
                "quant_method": "torchao",
                "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_data": {}}},
            },
            "torchao (Int4WeightOnlyConfig) is not supported",
        ),
        (
            {
                "quant_method": "torchao",
                "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_data": {"group_size": 32}}},
            },
            "torchao (Int8WeightOnlyConfig) is not supported",
        ),
    ],
)
def test_other_quantized_checkpoints_are_refused_by_name(models, tmp_path, spec, says):
    import json
    import shutil

    from shared.errors import FailedPrecondition
    from shared.model_config import ModelConfig

    folder = tmp_path / "model"
    shutil.copytree(models["llama"][0], folder)
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": spec}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FailedPrecondition, match=re.escape(says)):
        ModelConfig.from_dir(folder)


def test_nf4_refuses_a_fused_weight_whose_blocks_would_straddle_two_slices():
    from inference_service.model.base_weight import base_weight
    from shared.errors import InvalidArgument

    base_weight("nf4", 48, (4, 8), torch.float32, "cpu")  # 192 and 384 values: whole blocks
    with pytest.raises(InvalidArgument, match=re.escape("a [4, 24] weight is not")):
        base_weight("nf4", 24, (4, 8), torch.float32, "cpu")


LAYER = "model.layers.1.self_attn.k_proj"


@pytest.mark.parametrize(
    ("saved", "part", "tamper", "says"),
    [
        ("nf4", ".weight.quant_map", lambda t: t.flip(0), "quant_map is not the NF4 code"),
        ("nf4", ".weight.quant_state.bitsandbytes__nf4", lambda t: _json_edit(t, blocksize=9), "quant state"),
        ("int8", "._weight_zero_point", lambda t: t + 1, "is not zero: only symmetric int8"),
        ("int8", "._weight_scale", lambda t: t[:-1], "has 31 scales, not one per row (32)"),
        ("int8", "._weight_qdata", lambda t: t.float(), "is torch.float32 (32, 64), the model"),
    ],
)  # fmt: skip
def test_a_saved_quantized_weight_whose_parts_disagree_is_refused_naming_the_tensor(
    models, request, tmp_path, saved, part, tamper, says
):
    import shutil

    from safetensors.torch import load_file, save_file

    from shared.errors import InvalidArgument

    folder = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(f"saved_{saved}")[0], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[LAYER + part] = tamper(tensors[LAYER + part])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match=re.escape(LAYER) + ".*" + re.escape(says)):
        _runner(folder, models["llama"][1])


def test_a_pre_quantized_checkpoint_with_a_dense_linear_layer_is_refused_naming_it(
    models, saved_int8, tmp_path
):
    """transformers' modules_to_not_convert leaves layers dense; quantizing them here would not be
    the model the checkpoint describes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from shared.errors import InvalidArgument

    folder = tmp_path / "model"
    shutil.copytree(saved_int8[0], folder)
    tensors = load_file(folder / "model.safetensors")
    q, scale = (tensors.pop(f"{LAYER}._weight_{part}") for part in ("qdata", "scale"))
    del tensors[f"{LAYER}._weight_zero_point"]
    tensors[f"{LAYER}.weight"] = q.float() * scale
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        InvalidArgument,
        match=re.escape(f"tensor {LAYER}.weight is dense in a checkpoint quantized to int8"),
    ):
        _runner(folder, models["llama"][1])


def _json_edit(tensor: torch.Tensor, **changes) -> torch.Tensor:
    import json

    state = json.loads(bytes(tensor.tolist())) | changes
    return torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_quantized_weight_whose_parts_sit_in_two_shards_loads_as_from_one_file(
    models, request, tmp_path, quantization
):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    single = request.getfixturevalue(f"saved_{quantization}")[0]
    folder = tmp_path / "model"
    shutil.copytree(single, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    # each weight's codes in one shard, their scales, absmax and states in the other
    codes = {n for n in tensors if n.endswith(("_weight_qdata", ".weight"))}
    shards = {"model-1.safetensors": codes, "model-2.safetensors": set(tensors) - codes}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, folder / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in shards.items() for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    outputs = []
    for model_dir in (single, folder):
        runner, slots, _ = _runner(model_dir, models["llama"][1])
        table = BlockManager(runner.num_blocks).allocate(2)
        outputs.append(runner.forward([SequenceInput([5, 6, 7, 8, 9], 0, table, slots["all8"])]))
    assert torch.equal(*outputs)
