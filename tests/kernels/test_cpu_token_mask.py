"""The CPU token-mask kernel against its torch path (engine/grammars.py's masked_by_torch), bit for
bit: random bitmasks and words wholly allowed or forbidden, vocabularies that fill their last word
or do not, logits whose rows are strided, rows left unconstrained; then through mask_rows with a
real grammar's matchers."""

import pytest
import torch
from tokenizers import Tokenizer

from inference_service.engine.grammars import Grammars, mask_rows, masked_by_torch
from inference_service.sampling import Structured
from kernels.cpu_token_mask import CpuTokenMask


@pytest.fixture(scope="module")
def kernel(target) -> CpuTokenMask:
    kernel, why = CpuTokenMask.load(target=target)
    assert kernel is not None, why
    return kernel


def _bitmask(rows: int, vocab: int, pattern: str, seed: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32: random bits, or random words each all-allowed, all-forbidden
    or random (as a grammar's masks mostly are), or all forbidden."""
    generator = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bits = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=generator)
    if pattern == "words":
        kind = torch.randint(0, 3, (rows, words), generator=generator)
        bits = torch.where(kind == 0, -1, torch.where(kind == 1, 0, bits))
    if pattern == "none":
        bits = torch.zeros_like(bits)
    return bits.to(torch.int32)


@pytest.mark.parametrize("pattern", ["random", "words", "none"])
@pytest.mark.parametrize(
    ("n", "rows", "vocab"),
    [(32, range(0, 32, 2), 49152), (3, [2, 0], 49155), (1, [0], 31), (5, [4, 1, 3], 100), (2, [1], 32)],
)
def test_the_kernel_fills_as_torch_does(kernel, pattern, n, rows, vocab):
    rows = list(rows)
    generator = torch.Generator().manual_seed(vocab)
    wide = torch.randn(n, vocab + 7, generator=generator)  # [n, vocab + 7]: rows strided past vocab
    logits = wide[:, :vocab]  # [n, vocab]
    bitmask = _bitmask(len(rows), vocab, pattern, seed=n)  # [c, words]
    expected = masked_by_torch(logits.clone(), bitmask, rows)
    kernel(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert not wide[:, vocab:].isinf().any()  # past the vocabulary: not the kernel's to fill
    untouched = [i for i in range(n) if i not in rows]
    assert not logits[untouched].isinf().any()


def test_mask_rows_with_the_kernel_as_without(kernel, default_model_dir):
    """A JSON schema's matchers at three points of an output: mask_rows through the kernel and
    through torch forbid the same tokens; unconstrained rows are untouched."""
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    grammars = Grammars(default_model_dir / "tokenizer.json", vocab, (2,), timeout_s=60)
    schema = Structured(
        "json_schema", '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}'
    )
    try:
        matchers = [None, grammars.matcher(schema), None, grammars.matcher(schema), grammars.matcher(schema)]
        for m, prefix in zip(matchers[3:], ['{"n":', '{"n":12'], strict=True):
            assert m.consume_tokens(tokenizer.encode(prefix, add_special_tokens=False).ids)
        logits = torch.randn(len(matchers), vocab, generator=torch.Generator().manual_seed(0))
        by_torch = mask_rows(logits.clone(), matchers)
        calls = []
        by_kernel = mask_rows(logits.clone(), matchers, lambda *args: calls.append(args) or kernel(*args))
    finally:
        grammars.close()
    assert torch.equal(by_kernel, by_torch) and len(calls) == 1  # the torch path did not fill it
    allowed = by_kernel.isfinite().sum(dim=1).tolist()
    assert allowed[0] == allowed[2] == vocab and 0 < min(allowed[1], allowed[3], allowed[4]) < vocab
