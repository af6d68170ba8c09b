"""Sampling: bad values are refused by name, filters agree with transformers' logits processors,
draws follow the filtered distribution, and a seeded request's tokens ignore its batch-mates."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from inference_service.engine.logit_adds import FIRST_CAPACITY, OutputPenalties, bias_row
from inference_service.engine.sampler import ARGMAX_CHUNK, SamplingBatch, generator_for, greedy_tokens, sample
from inference_service.sampling import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from shared.errors import InvalidArgument

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("top_k", -1),
    ("top_k", 5.0),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", -math.inf),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.2),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", math.inf),
    ("logit_bias", {5: 1.0}),  # pairs, as the worker's convert gives them
    ("logit_bias", [(5, 100.5)]),
    ("logit_bias", [(-1, 1.0)]),
    ("logit_bias", [(5, math.nan)]),
    ("logit_bias", [(5.0, 1.0)]),
    ("logit_bias", [(5, 1.0, 2.0)]),
    ("logit_bias", [(5, 1.0), (5, -1.0)]),
    ("logit_bias", [(i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)]),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", "a bare string"),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", ["ok", "x" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_is_refused_by_name(field, value):
    with pytest.raises(InvalidArgument, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_valid_params_store_lists_as_tuples():
    p = SamplingParams(
        temperature=0, top_k=1, top_p=1, min_p=1, seed=2**64 - 1, stop=["\n"], stop_token_ids=[0]
    )
    assert p.stop == ("\n",) and p.stop_token_ids == (0,)
    assert hash(p) == hash(SamplingParams(**vars(p)))


def test_stop_lists_are_capped_and_the_refusal_names_the_cap():
    at_cap = SamplingParams(
        stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, stop_token_ids=[7] * MAX_STOP_TOKEN_IDS
    )
    assert len(at_cap.stop) == MAX_STOP_STRINGS
    with pytest.raises(InvalidArgument, match=rf"10000 strings; at most {MAX_STOP_STRINGS}$"):
        SamplingParams(stop=["x"] * 10_000)
    with pytest.raises(
        InvalidArgument, match=rf"stop\[1\] is {1 << 20} characters long; at most {MAX_STOP_CHARS}"
    ):
        SamplingParams(stop=["ok", "x" * (1 << 20)])
    with pytest.raises(InvalidArgument) as e:  # a client's value is quoted short
        SamplingParams(stop=["x" * 200] * 3 + [""])
    assert len(str(e.value)) < 300


def _sample(logits, params, histories=None, generators=None, outputs=None):
    histories = histories or [[] for _ in params]
    generators = generators or [None] * len(params)
    outputs = outputs or [[] for _ in params]
    biases = [bias_row(p) for p in params]
    penalties = [_penalties(p, output) for p, output in zip(params, outputs, strict=True)]
    return sample(
        logits, SamplingBatch.build(params, generators, histories, biases, penalties, logits.device)
    )


def _penalties(params: SamplingParams, output: list[int]):
    """The row's penalties once its output holds `output`, added a token at a time as the
    scheduler adds them."""
    penalties = OutputPenalties.of(params)
    if penalties is None:
        return None
    for token in output:
        penalties.add(token)
    return penalties.row()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=0.7, top_k=1),
    ],
)
def test_greedy_and_top_k_1_take_the_argmax(params):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    assert _sample(logits, [params] * 16).token_ids == logits.argmax(dim=-1).tolist()


VOCABS = [ARGMAX_CHUNK - 1, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK, 49152, 50257]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_with_ties_infinities_and_nans(vocab, dtype):
    """Rows of few distinct values, so that maxima tie within and across chunks, with inf, -inf and
    NaN placed first, last and at chunk edges: each row's token is torch.argmax's."""
    g = torch.Generator().manual_seed(vocab)
    scores = torch.randint(0, 4, (12, vocab), generator=g).to(dtype)  # [rows, vocab]
    edge = min(ARGMAX_CHUNK, vocab - 1)
    scores[1, -1] = scores[2, 0] = scores[3, edge] = scores[3, vocab - 1] = math.inf
    scores[4] = -math.inf
    scores[5, edge - 1] = scores[6, -1] = scores[7, 0] = math.nan
    scores[8, edge] = math.nan
    scores[8, 3] = math.inf
    scores[9, vocab // 2 :] = 7  # the greatest, from the middle on
    scores[10, -1] = 7  # the greatest in a last, short chunk
    assert greedy_tokens(scores).tolist() == scores.argmax(dim=-1).tolist()


def test_repetition_penalized_greedy_choice_equals_transformers():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=g) * 3  # [rows, vocab]
    logits[::2] -= 20  # all-negative rows: a penalty must push a negative logit further down
    # Each history holds the row's favourite token, so a penalty can change the choice.
    histories = [
        [int(logits[r].argmax()), *torch.randint(0, 40, (r,), generator=g).tolist()] for r in range(8)
    ]
    penalties = [1.0, 1.3, 0.7, 2.0, 1.0, 1.1, 5.0, 0.5]
    params = [SamplingParams(temperature=0, repetition_penalty=p) for p in penalties]
    before = logits.clone()
    got = _sample(logits, params, histories).token_ids
    expected = [
        int(RepetitionPenaltyLogitsProcessor(p)(torch.tensor([h]), logits[r : r + 1].clone()).argmax())
        for r, (p, h) in enumerate(zip(penalties, histories, strict=True))
    ]
    assert got == expected
    assert got != logits.argmax(dim=-1).tolist()  # the penalty mattered somewhere
    assert torch.equal(logits, before)


def test_logit_bias_then_repetition_penalty_chooses_as_transformers_does():
    """Each row's bias, then its repetition penalty (vLLM's order), against transformers'
    SequenceBiasLogitsProcessor (one-token sequences) and RepetitionPenaltyLogitsProcessor."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=g) * 3  # [rows, vocab]
    favourites = logits.argmax(dim=-1).tolist()
    biases = [
        {},
        {favourites[1]: -100.0},  # banned
        {7: 100.0},  # forced
        {3: 2.5, 9: -1.0, favourites[3]: -2.0},
        {favourites[4]: -0.5},
        {11: 4.0},
        {favourites[6]: 1.0, 0: 6.0},
        {5: -3.0},
    ]
    penalties = [1.0, 1.0, 1.0, 1.3, 2.0, 1.0, 0.5, 1.7]
    histories = [[favourites[r], 11, 0] for r in range(8)]
    params = [
        SamplingParams(temperature=0, logit_bias=list(b.items()), repetition_penalty=p)
        for b, p in zip(biases, penalties, strict=True)
    ]
    got = _sample(logits, params, histories).token_ids
    expected = []
    for r, (bias, penalty) in enumerate(zip(biases, penalties, strict=True)):
        chain = [SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})] if bias else []
        chain.append(RepetitionPenaltyLogitsProcessor(penalty))
        scores = LogitsProcessorList(chain)(torch.tensor([histories[r]]), logits[r : r + 1].clone())
        expected.append(int(scores.argmax()))
    assert got == expected
    assert got[1] != favourites[1] and got[2] == 7
    assert sum(a != b for a, b in zip(got, favourites, strict=True)) >= 4  # the bias mattered


def test_the_bias_comes_before_the_repetition_penalty():
    """Token 0 (3.0, seen, bias -1, penalty 2): (3 - 1) / 2 = 1.0 beats token 1's 0.8 in vLLM's
    order; biased after the penalty it would be 3 / 2 - 1 = 0.5, and lose."""
    logits = torch.tensor([[3.0, 0.8, -5.0, -5.0]])  # [1, vocab]
    params = SamplingParams(temperature=0, logit_bias=[(0, -1.0)], repetition_penalty=2.0)
    assert _sample(logits, [params], histories=[[0]]).token_ids == [0]


def test_presence_and_frequency_penalties_follow_openais_formula():
    """OpenAI's documented penalty: logit[j] - count[j] * frequency - (count[j] > 0) * presence,
    count[j] the times token j is in the output so far (not the prompt), computed here per entry."""
    g = torch.Generator().manual_seed(4)
    rows, vocab = 16, 30
    logits = torch.randn(rows, vocab, generator=g)  # [rows, vocab]
    favourites = logits.argmax(dim=-1).tolist()
    outputs = [
        [favourites[r]] * (r % 4) + torch.randint(0, vocab, (r,), generator=g).tolist() for r in range(rows)
    ]
    presence = [((r * 7) % 9 - 4) / 2 for r in range(rows)]  # -2 .. 2
    frequency = [((r * 5) % 9 - 4) / 2 for r in range(rows)]
    params = [
        SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f)
        for p, f in zip(presence, frequency, strict=True)
    ]
    prompts = [[favourites[r]] * 5 for r in range(rows)]  # the prompt counts for nothing
    got = _sample(logits, params, histories=prompts, outputs=outputs).token_ids
    expected = []
    for r in range(rows):
        scores = [
            float(logits[r, j]) - outputs[r].count(j) * frequency[r] - (j in outputs[r]) * presence[r]
            for j in range(vocab)
        ]
        expected.append(max(range(vocab), key=scores.__getitem__))
    assert got == expected
    assert sum(a != b for a, b in zip(got, favourites, strict=True)) >= 4  # the penalties mattered


def test_output_penalties_kept_token_by_token_are_openais_formula_past_their_first_capacity():
    g = torch.Generator().manual_seed(5)
    output = torch.randint(0, 4 * FIRST_CAPACITY, (8 * FIRST_CAPACITY,), generator=g).tolist()
    penalties = OutputPenalties(presence=0.25, frequency=-0.5)
    seen = []
    for token in output:
        penalties.add(token)
        seen.append(token)
        row = penalties.row()
        expected = {t: -(-0.5 * seen.count(t) + 0.25) for t in set(seen)}
        assert dict(zip(row.ids.tolist(), row.values.tolist(), strict=True)) == pytest.approx(expected)
    assert len(set(output)) > FIRST_CAPACITY  # the entries grew past their first room
    assert OutputPenalties.of(SamplingParams()) is None and OutputPenalties(1.0, 0.0).row() is None


def test_penalties_draw_from_the_penalized_distribution():
    """A sampled row draws from softmax of its biased and penalized logits: token frequencies
    over many seeded draws match them (the same check as the filters', below)."""
    vocab, draws = 6, 4000
    scores = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])  # [vocab]
    params = SamplingParams(
        temperature=1.0, logit_bias=[(5, 2.5)], presence_penalty=0.5, frequency_penalty=0.75, seed=1
    )
    output = [0, 0, 1]
    target = scores.clone()
    target[5] += 2.5
    target[0] -= 2 * 0.75 + 0.5
    target[1] -= 0.75 + 0.5
    generator = generator_for(params, "cpu")
    logits = scores.expand(draws, vocab).contiguous()  # [draws, vocab]
    got = _sample(logits, [params] * draws, generators=[generator] * draws, outputs=[output] * draws)
    observed = torch.bincount(torch.tensor(got.token_ids), minlength=vocab) / draws  # [vocab]
    expected = target.softmax(dim=-1)  # [vocab]
    assert torch.allclose(observed, expected, atol=4 * (0.25 / draws) ** 0.5)


# (params, history): every row of a config in one batch, each config with its own filters.
CONFIGS = [
    (SamplingParams(temperature=1.0), []),
    (SamplingParams(temperature=0.7, top_k=4), []),
    (SamplingParams(temperature=1.3, top_p=0.8), []),
    (SamplingParams(temperature=1.0, min_p=0.15), []),
    (SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05), []),
    (SamplingParams(temperature=1.0, top_p=0.85, repetition_penalty=1.8), [0, 3, 3, 7]),
]


def _transformers_probs(scores, params, history):
    """The distribution transformers' generate() samples from, with its processors in its order."""
    chain = [
        RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
        TemperatureLogitsWarper(params.temperature),
    ]
    chain += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    chain += [TopPLogitsWarper(params.top_p), MinPLogitsWarper(params.min_p)]
    ids = torch.tensor([history or [0]])  # [1, len]; a penalty of 1 leaves the dummy [0] without effect
    return LogitsProcessorList(chain)(ids, scores[None].clone()).softmax(dim=-1)[0]  # [vocab]


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-draw", "per-request-generators"])
def test_draws_follow_the_distribution_transformers_leaves(seeded):
    vocab, draws = 12, 3000
    scores = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5  # [vocab]
    rows = [(p, h) for p, h in CONFIGS for _ in range(draws)]
    params, histories = [p for p, _ in rows], [h for _, h in rows]
    generators = [torch.Generator().manual_seed(i) if seeded else None for i in range(len(rows))]
    torch.manual_seed(0)
    tokens = torch.tensor(_sample(scores.expand(len(rows), vocab), params, histories, generators).token_ids)
    for c, (p, h) in enumerate(CONFIGS):
        expected = _transformers_probs(scores, p, h)  # [vocab]
        counts = torch.bincount(tokens[c * draws : (c + 1) * draws], minlength=vocab)  # [vocab]
        kept = expected > 0
        assert set(counts.nonzero().flatten().tolist()) == set(kept.nonzero().flatten().tolist()), p
        e = expected[kept] * draws
        chi2 = float(((counts[kept] - e) ** 2 / e).sum())
        assert chi2 < 35, (p, chi2)  # df <= 11: p-value < 3e-4 for a correct sampler


def _boundary_cases():
    dists = [[0.5, 0.3, 0.2], [0.4, 0.2, 0.2, 0.1, 0.1], [0.25] * 4, [0.6, 0.1, 0.1, 0.1, 0.1]]
    top_ps = [i / 10 for i in range(1, 10)] + [1e-9]
    filters = [{"top_p": p} for p in top_ps] + [{"min_p": m} for m in (0.25, 1 / 3, 0.5, 1.0)]
    filters += [{"top_k": k} for k in (1, 2, 3)]  # ties with the k-th token stay
    return [(d, SamplingParams(**f)) for d in dists for f in filters]


def test_exact_boundaries_and_ties_keep_the_tokens_transformers_keeps():
    cases, draws = _boundary_cases(), 300
    scores = [torch.tensor(d).log() for d, _ in cases]  # [vocab] each, probabilities on the cut-offs
    vocab = max(len(d) for d, _ in cases)
    logits = torch.stack([torch.nn.functional.pad(s, (0, vocab - len(s)), value=-math.inf) for s in scores])
    torch.manual_seed(0)
    rows = torch.arange(len(cases)).repeat_interleave(draws)  # [cases * draws]
    tokens = torch.tensor(_sample(logits[rows], [cases[r][1] for r in rows.tolist()]).token_ids)
    for c, ((d, p), s) in enumerate(zip(cases, scores, strict=True)):
        drawn = set(tokens[c * draws : (c + 1) * draws].tolist())
        assert drawn == set(_transformers_probs(s, p, []).nonzero().flatten().tolist()), (d, p)


def _run(request_logits, batch_builder, steps):
    """Sample `steps` tokens for a seeded request (row `at` of each step's batch)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    gen = generator_for(params, "cpu")
    out = []
    for step in range(steps):
        mates, at = batch_builder(step)
        all_params = [*mates[:at], params, *mates[at:]]
        gens = [generator_for(p, "cpu") for p in all_params]
        gens[at] = gen
        others = torch.randn(len(mates), request_logits.shape[-1]) * 4  # [mates, vocab]
        logits = torch.cat([others[:at], request_logits[step][None], others[at:]])  # [rows, vocab]
        histories = [[1, 2, 3]] * len(all_params)
        out.append(_sample(logits, all_params, histories, gens).token_ids[at])
    return out


BATCH_MATES = {
    "alone": lambda step: ([], 0),
    "unseeded-first": lambda step: ([SamplingParams()], 1),
    "mixed-filters": lambda step: (
        [SamplingParams(top_k=3), SamplingParams(temperature=0), SamplingParams(min_p=0.3, seed=8)]
        * (step + 1),
        step,
    ),
    "greedy-and-penalty": lambda step: (
        [SamplingParams(temperature=0, repetition_penalty=1.5)] * 9,
        9 - step,
    ),
    "same-seed-mate": lambda step: ([SamplingParams(temperature=0.8, top_p=0.95, seed=7)] * 2, 1),
}


def test_seeded_request_ignores_its_batch_mates():
    steps, vocab = 6, 64
    request_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3))  # [steps, vocab]
    runs = {}
    for i, (name, builder) in enumerate(BATCH_MATES.items()):
        torch.manual_seed(100 + i)  # unseeded mates see different global draws in every run
        runs[name] = _run(request_logits, builder, steps)
    assert all(tokens == runs["alone"] for tokens in runs.values()), runs


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)  # [1, vocab] uniform, so any two streams differing is near certain
    streams = set()
    for seed in range(4):
        params = [SamplingParams(seed=seed)]
        gen = [generator_for(params[0], "cpu")]
        streams.add(tuple(_sample(logits, params, generators=gen).token_ids[0] for _ in range(5)))
    assert len(streams) == 4


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4)) * 2  # [rows, vocab]
    counts = [0, 1, 5, 20, 3]
    params = [
        SamplingParams(logprobs=n, temperature=t, repetition_penalty=rp, top_k=k)
        for n, t, rp, k in zip(
            counts, [0, 0.5, 1.0, 0, 2.0], [1.0, 1.5, 1.0, 1.0, 0.8], [0, 0, 3, 0, 0], strict=True
        )
    ]
    result = _sample(logits, params, histories=[[1, 2]] * 5)
    expected = logits.double().log_softmax(dim=-1)  # [rows, vocab]
    bound = _log_softmax_error_bound(logits, expected)  # [rows, vocab]
    assert result.logprobs[0] is None
    for r in range(1, 5):
        lp = result.logprobs[r]
        ids, values = [i for i, _ in lp.top], [v for _, v in lp.top]
        assert len(lp.top) == counts[r]
        assert values == sorted(values, reverse=True)
        assert set(ids) == set(expected[r].topk(counts[r]).indices.tolist())
        got = torch.tensor([*values, lp.logprob], dtype=torch.float64)
        at = [*ids, result.token_ids[r]]
        assert ((got - expected[r, at]).abs() <= bound[r, at]).all(), (got, expected[r, at], bound[r, at])


def _log_softmax_error_bound(logits: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How far an fp32 log_softmax of `logits` [rows, vocab] may land from `exact`, its float64
    value, in whatever order a CPU sums: x - m - log(sum_j exp(x_j - m)), m the row's max. With u
    the unit roundoff, the differences x_j - m round by u * spread (the row's max minus min), each
    exp by 2u more, the sum of n terms by (n - 1) u, the log by 2u of log(sum) and passes the
    sum's relative error on as an absolute one; the last two subtractions (or m + log(sum), then
    x minus that) round by u of |x - m| + |m| + |out|."""
    u = torch.finfo(torch.float32).eps / 2
    x = logits.double()  # [rows, vocab]
    m = x.max(dim=-1, keepdim=True).values  # [rows, 1]
    spread = m - x.min(dim=-1, keepdim=True).values  # [rows, 1]
    log_sum = (x - m).exp().sum(dim=-1, keepdim=True).log()  # [rows, 1]
    n = x.shape[-1]
    per_row = 3 * spread + 2 + (n - 1) + 2 * log_sum + m.abs()  # [rows, 1]
    return u * (per_row + (x - m).abs() + exact.abs())  # [rows, vocab]
