"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) against transformers + PEFT: tiny
random-weight models (hidden 128, 8 experts, top-2) with four adapters on attention, router and
experts, mixed in one batch with requests on the base model, 10 prompts x 32 greedy tokens. The
reference runs its experts eagerly (one matmul per expert, as ours on the CPU), in fp32 and in
float64; PEFT runs LoRA on experts (target_parameters) one adapter at a time, merging each
expert's delta into its weight, so each adapter's requests run as a batch of their own there."""

import pytest
import torch

from bench.random_adapter import write_random_adapter
from inference_service.engine.block_manager import BlockManager
from inference_service.model.forward_batch import SequenceInput
from inference_service.model.moe import SparseMoe
from shared.model_config import ModelConfig
from tests.conftest import build_peft_adapter, build_tiny_model
from tests.fp32_agreement import assert_fp32_agrees

from .test_peft_reference import _runner, assert_decode_agrees

MOE_MODELS = {
    "qwen2_moe": dict(
        num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=96, norm_topk_prob=False
    ),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, head_dim=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
    "olmoe": dict(num_experts=8, intermediate_size=64, norm_topk_prob=False),
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "experts4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    "all6": dict(r=6, lora_alpha=12, target_modules="all-linear"),  # PEFT adds the router and experts
    "down5rs": dict(r=5, lora_alpha=10, use_rslora=True, target_modules=[], target_parameters=["down_proj"]),
}
ROWS = [
    ("attn8", 7),
    (None, 5),
    ("experts4", 9),
    ("all6", 3),
    ("down5rs", 6),
    ("experts4", 8),
    (None, 4),
    ("all6", 2),
    ("attn8", 5),
    ("bench", 4),
]
DECODE_STEPS = 32
# The Triton path's kernels see only tokens, (token, expert) pairs and their adapters, whichever
# model routed them: two models cover both kinds of top-k weights (raw and renormalized), a shared
# expert, and a head size of its own (the torch path checks all four; the interpreter takes 10 s a model).
TRITON_MODELS = ["qwen2_moe", "qwen3_moe"]


def build_moe_model(tmp_path_factory, model_type: str) -> tuple:
    """(folder, adapter name -> folder) of a tiny MoE model of `model_type` and its adapters."""
    root = tmp_path_factory.mktemp(model_type)
    overrides = dict(hidden_size=128, num_experts_per_tok=2, **MOE_MODELS[model_type])
    folder = build_tiny_model(root / "model", model_type, **overrides)
    adapters = {
        name: build_peft_adapter(folder, root / name, seed=i + 1, **lora)
        for i, (name, lora) in enumerate(ADAPTERS.items())
    }
    # the benchmarks' adapters, written without PEFT: PEFT must read them as we do
    adapters["bench"] = write_random_adapter(ModelConfig.from_dir(folder), root / "bench", rank=4, seed=9)
    return folder, adapters


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_model(request, tmp_path_factory) -> tuple:
    """(model type, folder, adapter name -> folder)."""
    return request.param, *build_moe_model(tmp_path_factory, request.param)


class PerAdapterPeft:
    """transformers + PEFT in fp32 and float64, one model per adapter (PEFT runs one adapter with
    target_parameters at a time) and the base model alone."""

    def __init__(self, model_dir, adapter_dirs, base=None):
        """base(dtype): a fresh base model in fp32 or float64 (by default the folder's, eager)."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        def eager(dtype):
            return AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, experts_implementation="eager"
            )

        base = base or eager

        self.models = {
            name: [
                (PeftModel.from_pretrained(base(dtype), folder) if folder else base(dtype)).eval()
                for dtype in (torch.float32, torch.float64)
            ]
            for name, folder in [(None, None), *adapter_dirs.items()]
        }

    def logits(self, sequences: list[list[int]], adapters: list[str | None]) -> list[list[torch.Tensor]]:
        """Per precision (fp32, float64), per sequence: logits [len, vocab], each adapter's
        sequences as one right-padded batch."""
        out = [[None] * len(sequences) for _ in range(2)]
        for name, models in self.models.items():
            rows = [i for i, a in enumerate(adapters) if a == name]
            if not rows:
                continue
            width = max(len(sequences[i]) for i in rows)
            ids = torch.tensor([sequences[i] + [0] * (width - len(sequences[i])) for i in rows])
            mask = torch.tensor([[1] * len(sequences[i]) + [0] * (width - len(sequences[i])) for i in rows])
            for precision, model in enumerate(models):
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=mask).logits
                for j, i in enumerate(rows):
                    out[precision][i] = logits[j, : len(sequences[i])]
        return out


class RouterMargins:
    """The smallest gap, over every token and layer the reference's float64 model routed, between
    the k-th and the (k+1)-th expert's probability: a near-tie there may flip our top-k (and
    the tokens after it) without any defect, so a failure names it."""

    def __init__(self, reference: PerAdapterPeft, top_k: int):
        self.smallest, self.top_k = float("inf"), top_k
        for _, fp64 in reference.models.values():
            for name, module in fp64.named_modules():
                if name.endswith("mlp.gate"):
                    module.register_forward_hook(self._record)

    def _record(self, module, inputs, outputs) -> None:
        logits = outputs[0] if isinstance(outputs, tuple) else outputs  # [tokens, experts]
        probs = logits.double().softmax(dim=-1).sort(dim=-1, descending=True).values
        gap = (probs[:, self.top_k - 1] - probs[:, self.top_k]).min().item()
        self.smallest = min(self.smallest, gap)

    def __str__(self) -> str:
        return f"smallest router top-{self.top_k} margin in the reference: {self.smallest:.3g}"


def test_a_mixed_batch_on_an_moe_model_matches_peft(moe_model):
    """On the CPU's path: the experts' weights packed for its matmuls, as a CPU engine runs them."""
    _assert_mixed_batch_matches_peft(moe_model, kernels=False)


@pytest.mark.parametrize("moe_model", TRITON_MODELS, indirect=True)
def test_the_triton_path_on_an_moe_model_matches_peft_too(moe_model, monkeypatch):
    """On the Triton kernels' path (attention, LoRA on tokens and on (token, expert) pairs, the
    experts' grouped matmuls), in the interpreter here, 2 decode steps. The experts stay dense, as
    a GPU holds them (packing is the CPU's)."""
    monkeypatch.setattr(SparseMoe, "pack", lambda self, linear: None)
    _assert_mixed_batch_matches_peft(moe_model, kernels=True)


def _assert_mixed_batch_matches_peft(moe_model, kernels: bool) -> None:
    model_type, model_dir, adapter_dirs = moe_model
    reference = PerAdapterPeft(model_dir, adapter_dirs)
    margins = RouterMargins(reference, top_k=2)
    runner, slots, _ = _runner(model_dir, adapter_dirs)
    assert runner.model_config.moe.num_experts == 8
    moe_layers = [m for m in runner.model.modules() if isinstance(m, SparseMoe)]
    assert all((m.packed is None) == kernels for m in moe_layers)  # packed for the CPU's path only
    if not kernels:  # the packed experts count among the bytes the worker reports it holds
        moe, hidden = runner.model_config.moe, runner.model_config.hidden_size
        expert_bytes = len(moe_layers) * moe.num_experts * 3 * moe.intermediate_size * hidden * 4
        assert runner.model.packed_bytes() >= expert_bytes
    steps = 2 if kernels else DECODE_STEPS
    assert_decode_agrees(
        runner, slots, reference, ROWS, steps, seed=2, kernels=kernels, context=margins.__str__
    )
    print(f"{model_type}: {margins}")


@pytest.mark.parametrize(
    ("targets", "says"),
    [
        (["gate_proj"], r"layers\.0\.gate_proj, but the base model's MLP is a mixture of experts"),
        (r".*\.(q_proj|up_proj)", r"layers\.0\.up_proj, but the base model's MLP is a mixture of experts"),
    ],
)  # fmt: skip
def test_lora_on_an_moe_models_mlp_is_refused_naming_the_layer(moe_model, tmp_path, targets, says):
    """A dense model's MLP adapter of the same shapes as an expert: no module of the MoE model
    has its names (mlp.gate_proj), so it would otherwise load and change nothing."""
    from shared.errors import FailedPrecondition
    from shared.peft_checkpoint import load_peft_adapter

    model_type, model_dir, _ = moe_model
    model = ModelConfig.from_dir(model_dir)
    dense = build_tiny_model(
        tmp_path / "dense",
        hidden_size=128,
        intermediate_size=model.moe.intermediate_size,
        head_dim=model.head_dim,
    )
    adapter = build_peft_adapter(dense, tmp_path / "mlp", seed=1, r=4, lora_alpha=8, target_modules=targets)
    if model_type == "mixtral" and targets == ["gate_proj"]:  # its experts had w1, w3, w2: no gate_proj
        says = (
            r"'gate_proj' is not in the base model \(LoRA target modules: q_proj, k_proj, v_proj, "
            r"o_proj, block_sparse_moe\.gate, block_sparse_moe\.experts\.<e>\.w1, .*; "
            r"target_parameters: mlp\.gate\.weight"
        )
    with pytest.raises(FailedPrecondition, match=says):
        load_peft_adapter("mlp", adapter, model, 16, torch.float32)


def _per_expert_adapter(model_dir, folder, rank: int, seed: int):
    """A Mixtral adapter as PEFT saved it for transformers 4, whose experts were nn.Linear modules
    (block_sparse_moe.experts.{e}.w1/w3/w2, the router block_sparse_moe.gate)."""
    import json

    from safetensors.torch import save_file

    model = ModelConfig.from_dir(model_dir)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, experts = model.hidden_size, model.moe.intermediate_size, model.moe.num_experts
    shapes = {
        "w1": (hidden, inter),
        "w3": (hidden, inter),
        "w2": (inter, hidden),
        "q_proj": (hidden, model.q_size),
    }
    tensors = {}

    def pair(key, in_features, out_features):
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.1

    for layer in range(model.num_layers):
        prefix = f"base_model.model.model.layers.{layer}"
        pair(f"{prefix}.self_attn.q_proj", *shapes["q_proj"])
        pair(f"{prefix}.block_sparse_moe.gate", hidden, experts)
        for e in range(experts):
            for name in ("w1", "w3", "w2"):
                pair(f"{prefix}.block_sparse_moe.experts.{e}.{name}", *shapes[name])
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "bias": "none", "target_modules": ["q_proj", "gate", "w1", "w2", "w3"],
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_mixtral_adapter_saved_per_expert_loads_as_peft_converts_it(tmp_path):
    """transformers 4's per-expert layout, which PEFT converts to transformers 5's stacked
    experts on load (for Mixtral): both must compute the same model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    overrides = dict(hidden_size=128, num_experts_per_tok=2, **MOE_MODELS["mixtral"])
    model_dir = build_tiny_model(tmp_path / "mixtral", "mixtral", **overrides)
    adapter = _per_expert_adapter(model_dir, tmp_path / "v4", rank=4, seed=3)
    models = [
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager"),
            adapter,
        ).eval()
        for dtype in (torch.float32, torch.float64)
    ]
    runner, slots, _ = _runner(model_dir, {"v4": adapter})
    gen = torch.Generator().manual_seed(4)
    sequences = [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (7, 5, 9)]
    blocks = BlockManager(runner.num_blocks)
    inputs = [SequenceInput(s, 0, blocks.allocate(-(-len(s) // 4)), slots["v4"]) for s in sequences]
    logits = runner.forward(inputs, all_logits=True)
    expected = []
    for model in models:
        with torch.no_grad():
            expected.append(torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in sequences]))
    assert_fp32_agrees(logits, *expected)
    plain = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        base = torch.cat([plain(input_ids=torch.tensor([s])).logits[0] for s in sequences])
    assert (expected[0] - base).abs().max() > 1e-2  # PEFT did load the adapter


def test_an_moe_adapter_on_a_dense_base_is_refused_naming_the_part(moe_model, tiny_models):
    from shared.errors import FailedPrecondition
    from shared.peft_checkpoint import load_peft_adapter

    _, _, adapter_dirs = moe_model
    dense = ModelConfig.from_dir(tiny_models["llama"])
    with pytest.raises(
        FailedPrecondition, match=r"layers\.0\.mlp\.experts\.down_proj adapts experts, but the base"
    ):
        load_peft_adapter("down5rs", adapter_dirs["down5rs"], dense, 16, torch.float32)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_quantized_moe_base_is_refused_by_name(moe_model, quantization):
    from inference_service.engine.config import EngineConfig
    from inference_service.engine.model_runner import ModelRunner
    from shared.errors import FailedPrecondition

    model_type, model_dir, _ = moe_model
    with pytest.raises(
        FailedPrecondition, match=f"quantized bases are supported for dense models only, not {model_type}"
    ):
        ModelRunner(EngineConfig(model=str(model_dir), quantization=quantization, kv_cache_tokens=256))
