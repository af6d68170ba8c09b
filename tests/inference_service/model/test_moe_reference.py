"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) against transformers + PEFT: tiny
random-weight models (hidden 128, 8 experts, top-2) with three attention adapters, mixed in one
batch with requests on the base model, 9 prompts x 32 greedy tokens. The reference runs its
experts eagerly (one matmul per expert, as ours on the CPU), in fp32 and in float64."""

import pytest
import torch

from inference_service.engine.block_manager import BlockManager
from inference_service.model.forward_batch import SequenceInput
from tests.conftest import build_peft_adapter, build_tiny_model
from tests.fp32_agreement import assert_fp32_agrees

from .test_peft_reference import Peft, _runner, _with_adapters

MOE_MODELS = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, head_dim=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
    "olmoe": dict(num_experts=8, intermediate_size=64, norm_topk_prob=False),
}
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "ko6rs": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["k_proj", "o_proj"]),
}
ROWS = [
    ("all8", 7),
    (None, 5),
    ("qv4", 9),
    ("ko6rs", 3),
    ("all8", 6),
    ("qv4", 8),
    (None, 4),
    ("ko6rs", 2),
    ("all8", 5),
]
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_model(request, tmp_path_factory) -> tuple:
    """(model type, folder, adapter name -> folder)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    overrides = dict(hidden_size=128, num_experts_per_tok=2, **MOE_MODELS[model_type])
    folder = build_tiny_model(root / "model", model_type, **overrides)
    adapters = {
        name: build_peft_adapter(folder, root / name, seed=i + 1, **lora)
        for i, (name, lora) in enumerate(ADAPTERS.items())
    }
    return model_type, folder, adapters


def _reference(model_dir, adapter_dirs) -> Peft:
    from transformers import AutoModelForCausalLM

    models = [
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
        for dtype in (torch.float32, torch.float64)
    ]
    return Peft(model_dir, adapter_dirs, [_with_adapters(m, adapter_dirs) for m in models])


class RouterMargins:
    """The smallest gap, over every token and layer the reference's float64 model routed, between
    the k-th and the (k+1)-th expert's probability: a near-tie there may flip our top-k (and
    the tokens after it) without any defect, so a failure names it."""

    def __init__(self, reference: Peft, top_k: int):
        self.smallest, self.top_k = float("inf"), top_k
        for name, module in reference.models[1].named_modules():
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
    model_type, model_dir, adapter_dirs = moe_model
    reference = _reference(model_dir, adapter_dirs)
    margins = RouterMargins(reference, top_k=2)
    runner, slots, _ = _runner(model_dir, adapter_dirs)
    assert runner.model_config.moe.num_experts == 8
    blocks = BlockManager(runner.num_blocks)
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 160, (n,), generator=gen).tolist() for _, n in ROWS]
    adapters = [a for a, _ in ROWS]
    tables = [blocks.allocate(-(-(n + DECODE_STEPS) // 4)) for _, n in ROWS]
    slot_of = [-1 if a is None else slots[a] for a in adapters]

    logits = runner.forward(
        [SequenceInput(s, 0, t, slot) for s, t, slot in zip(sequences, tables, slot_of, strict=True)],
        all_logits=True,
    )
    expected, exact = reference.logits(sequences, adapters)
    assert_fp32_agrees(logits, torch.cat(expected), torch.cat(exact))
    for step in range(DECODE_STEPS):
        next_ids = [int(e[-1].argmax()) for e in expected]  # the reference's greedy tokens
        decode = [
            SequenceInput([tok], len(s), t, slot)
            for tok, s, t, slot in zip(next_ids, sequences, tables, slot_of, strict=True)
        ]
        logits = runner.forward(decode)
        sequences = [[*s, tok] for s, tok in zip(sequences, next_ids, strict=True)]
        expected, exact = reference.logits(sequences, adapters)
        assert_fp32_agrees(
            logits, torch.stack([e[-1] for e in expected]), torch.stack([e[-1] for e in exact])
        )
        greedy = logits.argmax(dim=-1).tolist()
        assert greedy == [int(e[-1].argmax()) for e in expected], f"{model_type} step {step}; {margins}"
    print(f"{model_type}: {margins}")


@pytest.mark.parametrize(
    ("targets", "says"),
    [
        (["gate_proj"], r"'gate_proj' is not in the base model \(LoRA targets: q_proj, k_proj, v_proj, o_"),
        (r".*\.(q_proj|up_proj)", r"layers\.0\.up_proj, but the base model's MLP is a mixture of experts"),
    ],
)  # fmt: skip
def test_lora_on_an_moe_models_mlp_is_refused_naming_the_layer(moe_model, tmp_path, targets, says):
    """Its experts are no nn.Linear modules: a dense model's MLP adapter of the same shapes would
    otherwise load and change nothing."""
    from shared.errors import FailedPrecondition
    from shared.model_config import ModelConfig
    from shared.peft_checkpoint import load_peft_adapter

    _, model_dir, _ = moe_model
    model = ModelConfig.from_dir(model_dir)
    dense = build_tiny_model(
        tmp_path / "dense",
        hidden_size=128,
        intermediate_size=model.moe.intermediate_size,
        head_dim=model.head_dim,
    )
    adapter = build_peft_adapter(dense, tmp_path / "mlp", seed=1, r=4, lora_alpha=8, target_modules=targets)
    with pytest.raises(FailedPrecondition, match=says):
        load_peft_adapter("mlp", adapter, model, 16, torch.float32)
