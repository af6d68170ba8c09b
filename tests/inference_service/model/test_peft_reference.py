"""The acceptance check of the runtime: logits of one mixed-adapter batch agree with transformers +
PEFT's (`adapter_names=`) as closely as fp32 allows (tests/fp32_agreement.py), for prefill and for
decode steps."""

import contextlib
from dataclasses import fields
from unittest import mock

import pytest
import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine import model_runner
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.cpu_kernels import CpuKernels
from kernels.cpu_library import BASELINE, NATIVE
from kernels.cpu_linear import CpuLinear
from kernels.cpu_lora import CpuLoraStep
from kernels.cpu_prefill_attention import CpuPrefillAttention
from kernels.cpu_rms_norm import CpuRmsNorm
from kernels.cpu_rope import CpuRope
from kernels.cpu_swiglu import CpuSwiglu
from shared.base_vocab import BaseVocab
from shared.peft_checkpoint import load_peft_adapter
from tests.conftest import TINY_ADAPTERS
from tests.fp32_agreement import assert_fp32_agrees
from tests.kernels.targets import declined, kernel_targets

BASE = None
# One row per request: its adapter (None = base model) and prompt length. Rows of one adapter
# are split up so the batch is not grouped by slot.
ROWS = [
    ("all8", 7),
    (BASE, 5),
    ("qv4", 9),
    ("mlp16rs", 3),
    ("all8", 6),
    ("re2", 8),
    (BASE, 4),
    ("qv4", 2),
    ("pattern", 5),
]
DECODE_STEPS = 4


def _peft_model(model_dir, adapter_dirs, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return _with_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), adapter_dirs)


def _with_adapters(base, adapter_dirs):
    from peft import PeftModel

    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model.eval()


class Peft:
    """transformers + PEFT holding every adapter, in fp32 and in float64 (or given models)."""

    def __init__(self, model_dir, adapter_dirs, models=None):
        self.models = models or [
            _peft_model(model_dir, adapter_dirs, dtype) for dtype in (torch.float32, torch.float64)
        ]

    def logits(self, sequences: list[list[int]], adapters: list[str | None]) -> list[list[torch.Tensor]]:
        """Per precision (fp32, float64), per sequence: logits [len, vocab] of one right-padded
        mixed batch."""
        width = max(len(s) for s in sequences)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        names = [a or "__base__" for a in adapters]
        out = []
        for model in self.models:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
            out.append([logits[i, : len(s)] for i, s in enumerate(sequences)])
        return out


def _image(runner: ModelRunner, name: str, path) -> AdapterImage:
    """The adapter's image as the runner's rank holds it."""
    model, base = runner.model_config, BaseVocab(runner.config.model, runner.model_config)
    weights = load_peft_adapter(name, path, model, runner.config.max_lora_rank, torch.float32, base)
    return AdapterImage.of(weights, runner.model_config, torch.float32, runner.parallel.shard)


def _runner(
    model_dir, adapter_dirs, quantization="none", parallel=None, max_lora_rank=16, dtype="float32"
) -> tuple[ModelRunner, dict[str, int], AdapterMemory]:
    """Every adapter loaded into pages of adapter memory, placed by AdapterMemory as the engine
    places them: a memory filled by the first ones' pages and freed in between, so later
    adapters' pages land out of order and apart. parallel: a tensor-parallel rank's Collectives
    (every rank places the adapters alike)."""
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            quantization=quantization,
            max_loras=len(adapter_dirs),
            max_lora_rank=max_lora_rank,
            kv_cache_tokens=512,
            block_size=4,
        ),
        parallel,
    )
    memory = AdapterMemory.for_model(runner.lora_units, runner.rank_config, runner.config.torch_dtype)
    slots = {}
    for name, path in adapter_dirs.items():
        image = _image(runner, name, path)
        filler, _ = memory.acquire(
            f"filler-{name}", (1,) * len(runner.model_config.lora_targets) + (0,)
        )  # a gap
        slots[name], _ = memory.acquire(name, image.need)
        runner.load_slot(slots[name], image, memory.pages(slots[name]))
        memory.release(filler)
        memory.vacate(filler)
    return runner, slots, memory


@pytest.mark.parametrize("path", ["compiled", "baseline", "torch", "triton"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_mixed_batch_matches_peft_for_prefill_and_decode(model_type, path, tiny_models, tiny_adapters):
    """On the CPU with every compiled kernel (as a CPU worker runs), with every kernel built for
    the AVX2 baseline (as an AVX2-only CPU's worker runs; where this CPU has AVX-512 besides), on
    the torch path a CPU without a compiler takes (blocks and pages gathered for SDPA and batched
    matmuls, torch's elementwise ops, weights in oneDNN's layout), and on the Triton kernels' path
    (attention and LoRA; in the interpreter here, compiled on a GPU)."""
    if path == "baseline" and BASELINE not in kernel_targets():
        pytest.skip("this CPU has no AVX-512: its own build (path compiled) takes the baseline's paths")
    adapter_dirs = tiny_adapters[model_type]
    reference = Peft(tiny_models[model_type], adapter_dirs)
    # no kernel built on the torch path: the weights are packed without one too
    loaders = {"torch": CpuKernels, "baseline": lambda: CpuKernels.load(target=BASELINE)[0]}
    with mock.patch.object(model_runner, "_cpu_kernels", loaders.get(path, model_runner._cpu_kernels)):
        runner, slots, _ = _runner(tiny_models[model_type], adapter_dirs)
    names = {kernel.name for kernel in fields(CpuKernels)}
    loaded = {name for name in names if getattr(runner.cpu_kernels, name) is not None}
    # a build without AVX-512 declines the attention kernels for torch's SDPA
    built = names - declined(BASELINE if path == "baseline" else NATIVE)
    assert loaded == (set() if path == "torch" else built)
    kernels = path == "triton"
    with counted_calls(ENTRY_POINTS) as calls:
        assert_decode_agrees(runner, slots, reference, ROWS, DECODE_STEPS, seed=1, kernels=kernels)
    if path in ("compiled", "baseline"):  # each model kernel ran, not only loaded: none is left out
        assert {name for name, n in calls.items() if n} == built - {"token_mask"}, calls  # no grammar here
    elif path == "torch":
        assert not any(calls.values()), calls


# Where each compiled CPU kernel is called (the LoRA kernels through the step's CpuLoraStep: with
# the base matmul, on the dense layers' panels).
ENTRY_POINTS = {
    "decode_attention": (CpuDecodeAttention, "__call__"),
    "prefill_attention": (CpuPrefillAttention, "__call__"),
    "lora": (CpuLoraStep, "linear"),
    "rope": (CpuRope, "__call__"),
    "rms_norm": (CpuRmsNorm, "__call__"),
    "swiglu": (CpuSwiglu, "__call__"),
    "linear": (CpuLinear, "__call__"),
}


@contextlib.contextmanager
def counted_calls(entry_points: dict[str, tuple[type, str]]):
    """Counts the calls of each (class, method) of `entry_points` by name, within the block."""
    calls = dict.fromkeys(entry_points, 0)

    def counting(name, method):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return counted

    with contextlib.ExitStack() as stack:
        for name, (cls, attribute) in entry_points.items():
            stack.enter_context(mock.patch.object(cls, attribute, counting(name, getattr(cls, attribute))))
        yield calls


def assert_decode_agrees(
    runner: ModelRunner,
    slots: dict[str, int],
    reference,
    rows: list[tuple[str | None, int]],
    steps: int,
    seed: int,
    kernels: bool = False,
    context=lambda: "",
    prompts: list[list[int]] | None = None,
) -> None:
    """A mixed batch of random prompts (or `prompts`), one per row (adapter name or None, length),
    prefilled then decoded greedily for `steps` steps on the reference's tokens: every step's
    logits as close to the reference's float64 forward as its fp32 forward is (reference.logits
    gives both), and the greedy tokens equal. context(): what a failing token comparison should also say."""
    blocks = BlockManager(runner.num_blocks)
    gen = torch.Generator().manual_seed(seed)
    sequences = prompts or [torch.randint(3, 160, (n,), generator=gen).tolist() for _, n in rows]
    adapters = [a for a, _ in rows]
    tables = [blocks.allocate(-(-(len(s) + steps) // runner.config.block_size)) for s in sequences]
    slot_of = [-1 if a is None else slots[a] for a in adapters]
    logits = runner.forward(
        [SequenceInput(s, 0, t, slot) for s, t, slot in zip(sequences, tables, slot_of, strict=True)],
        all_logits=True,
        kernels=kernels,
    )
    expected, exact = reference.logits(sequences, adapters)
    assert_fp32_agrees(logits, torch.cat(expected), torch.cat(exact))
    for step in range(steps):
        next_ids = [int(e[-1].argmax()) for e in expected]  # the reference's greedy tokens
        decode = [
            SequenceInput([tok], len(s), t, slot)
            for tok, s, t, slot in zip(next_ids, sequences, tables, slot_of, strict=True)
        ]
        logits = runner.forward(decode, kernels=kernels)
        sequences = [[*s, tok] for s, tok in zip(sequences, next_ids, strict=True)]
        expected, exact = reference.logits(sequences, adapters)
        assert_fp32_agrees(
            logits, torch.stack([e[-1] for e in expected]), torch.stack([e[-1] for e in exact])
        )
        greedy = [int(e[-1].argmax()) for e in expected]
        assert logits.argmax(dim=-1).tolist() == greedy, f"decode step {step}; {context()}"


def test_chunked_prefill_equals_one_shot_prefill(tiny_models, tiny_adapters):
    """A prompt fed in three chunks (steps) gives the logits the whole prompt gives: both agree
    with PEFT's as closely as fp32 allows."""
    reference = Peft(tiny_models["mistral"], tiny_adapters["mistral"])
    runner, slots, _ = _runner(tiny_models["mistral"], tiny_adapters["mistral"])
    blocks = BlockManager(runner.num_blocks)
    prompt = list(range(10, 30))
    whole = runner.forward([SequenceInput(prompt, 0, blocks.allocate(5), slots["all8"])], all_logits=True)
    table = blocks.allocate(5)
    parts = [
        runner.forward([SequenceInput(prompt[a:b], a, table, slots["all8"])], all_logits=True)
        for a, b in ((0, 7), (7, 8), (8, 20))
    ]
    (expected,), (exact,) = reference.logits([prompt], ["all8"])
    assert_fp32_agrees(torch.cat(parts), expected, exact)
    assert_fp32_agrees(whole, expected, exact)


def test_adapter_changes_logits_and_reused_pages_keep_nothing_stale(tiny_models, tiny_adapters):
    """Guards the reference test against a no-op LoRA path: adapters really move the logits. An
    adapter copied into pages another one held (higher rank, more modules) gives exactly its own
    logits: nothing of the old one is left."""
    runner, slots, memory = _runner(tiny_models["llama"], tiny_adapters["llama"])
    blocks = BlockManager(runner.num_blocks)
    prompt = [5, 6, 7, 8]

    def logits(slot):
        return runner.forward([SequenceInput(prompt, 0, blocks.allocate(1), slot)])

    base = logits(-1)
    for name in TINY_ADAPTERS:
        assert (logits(slots[name]) - base).abs().max() > 1e-2, name
    qv4 = logits(slots["qv4"])
    image = _image(runner, "qv4", tiny_adapters["llama"]["qv4"])
    all8 = memory.pages(slots["all8"])  # rank 8 on every module: one page of each
    q_and_v = tuple(pages if t in (0, 2) else () for t, pages in enumerate(all8))
    runner.load_slot(slots["all8"], image, q_and_v)
    torch.testing.assert_close(logits(slots["all8"]), qv4, atol=0, rtol=0)
