"""What structured outputs cost, on the default model (SmolLM2-135M-Instruct, float32, CPU), with
a mid-size JSON schema (SCHEMA: enums, a nested object through a $ref, an array with bounds,
integer bounds, string patterns), asked for through the chat template, greedy.

Decode: 32 requests, each on a chat prompt asking for one person as JSON, on two engines that take
their steps in turn (bench.engine_overhead), so both arms see the same machine state: in one arm
no request is constrained, in the other every second one (16) follows SCHEMA. A constrained
request stops when its JSON is whole, so over a whole run the arms would decode batches of
different sizes, at different context lengths. Like is compared with like instead: every request
of both arms has `tokens` (48) new tokens at most, fewer than any whole output of round 0 takes,
so the constrained requests are cut by length, not ended; only the decode steps in which all 32
requests decoded count, the first K of each arm (K: the fewer of the two arms', should a
constrained request end early), so the same step of each arm has the same batch at the same
context lengths and the masks are the one difference. An arm's tok/s in a round is 32 over its
median such step (a median, as other processes' bursts on 2 cores slow some steps tenfold); the
ratio is the median of per-round ratios. A first round, dropped from the figures, runs the
constrained requests alone to their end, checks that each stops on JSON valid against SCHEMA and
keeps their tokens, then runs both arms once to warm them.

Time to first token: on a fresh engine per round, whose model a first (dropped) request warmed,
one request alone at a time, `generate` with max_tokens 1 (its wall time holds the compile, which
`submit` does in the caller's thread): unconstrained; SCHEMA first (the first constraint also
builds the grammar engine's tokenizer and its token trie); SCHEMA again (cached); a schema new to
the engine (SCHEMA with other integer bounds: a compile alone). Medians over the rounds.

Masking: `mask_rows` over logits [32, vocab] with 16 matchers, and the engine's CPU kernel where it
has one (as its steps call it), replayed through round 0's constrained outputs one step at a time
(each matcher where the engine's was at that step), over the steps in which all 16 decode, beside
the grammar engine's masks alone (copies of the same matchers); medians of the steps, then of
`repeats` replays, against the unconstrained arm's median decode step.

    .venv/bin/python -m bench.structured [--repeats 5] [--tokens 48]
    .venv/bin/python -m bench.suite --only structured   (recorded in bench/results/, as make bench does)
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import torch

from bench.cache import default_model_dir
from bench.engine_overhead import full_batch_steps
from bench.report import markdown_table
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.engine.grammars import mask_rows
from inference_service.sampling import SamplingParams, Structured

REQUESTS, CONSTRAINED = 32, 16  # request i is constrained when i is even
TOKENS = 48  # new tokens of a timed round: fewer than any whole output of the default model
WHOLE_TOKENS = 384  # room for any output SCHEMA allows, but for strings written as escapes
TARGET = 0.9  # the decode ratio structured outputs are meant to keep at least
NONE, HALF = "none constrained", f"{CONSTRAINED} / {REQUESTS} constrained"
ARMS = (NONE, HALF)
JOBS = ("engineer", "designer", "manager", "analyst", "nurse", "teacher", "pilot", "chef")
TTFT_CASES = (
    "unconstrained",
    "first constraint of a fresh engine",
    "same constraint again (cached)",
    "new constraint on a warm engine",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12} [A-Z][a-z]{1,16}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "designer", "manager", "analyst", "nurse", "teacher"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 2,
            "maxItems": 4,
        },
        "home": {"$ref": "#/$defs/place"},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "home", "remote"],
    "additionalProperties": False,
    "$defs": {
        "place": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"enum": ["US", "UK", "FR", "DE", "JP", "BR", "IN"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "country", "zip"],
            "additionalProperties": False,
        }
    },
}


def structured(
    model_dir: Path,
    repeats: int = 5,
    progress: Callable[[str], None] = lambda line: None,
    tokens: int = TOKENS,
) -> dict:
    """The decode ratio, time to first token and masking cost of structured outputs (the module's
    docstring says how each is measured)."""
    schema = constraint(SCHEMA)
    with torch.inference_mode():
        engines = {arm: arm_engine(model_dir) for arm in ARMS}
        prompts = [chat_prompt(engines[NONE], i) for i in range(REQUESTS)]
        progress("round 0 (dropped): the constrained requests to their end, then both arms")
        whole = whole_outputs(engines[HALF], prompts[::2], schema)
        decode_rounds(engines, prompts, schema, tokens, 1)
        steps, kept = decode_rounds(engines, prompts, schema, tokens, repeats, progress)
        progress(f"{repeats} replays of {CONSTRAINED} matchers' masks")
        masks = mask_costs(engines[HALF], [out.token_ids for out in whole], schema, repeats)
        outputs = whole_summary(engines[HALF], whole)
        for e in engines.values():
            e.stop()
        ttft = ttft_rounds(model_dir, prompts[0], repeats, progress)
    return summary(steps, kept, outputs, ttft, masks, repeats, tokens)


def constraint(schema: dict) -> Structured:
    return Structured("json_schema", json.dumps(schema))


def arm_engine(model_dir: Path) -> Engine:
    """An engine for one arm: room for every request's chat prompt and a whole output."""
    length = 128 + WHOLE_TOKENS  # a chat prompt of the default template takes about 70 tokens
    config = EngineConfig(
        model=str(model_dir),
        max_loras=0,
        max_num_seqs=REQUESTS,
        max_model_len=length,
        kv_cache_tokens=REQUESTS * length,
    )
    return Engine(config)


def chat_prompt(e: Engine, i: int) -> list[int]:
    """Request i's prompt: the chat template around a request for one person as JSON."""
    ask = (
        f"Describe a fictional {JOBS[i % len(JOBS)]} (person {i}) as a JSON object with name, age, "
        "role, skills, home (city, country, zip) and remote."
    )
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
    return e.tokenizer.encode(text, add_special_tokens=False)


def params(tokens: int, schema: Structured | None) -> SamplingParams:
    """Greedy; EOS ignored, so that unconstrained requests run to `tokens` as constrained ones do
    (a whole constrained output stops its request all the same)."""
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured=schema)


def whole_outputs(e: Engine, prompts: list[list[int]], schema: Structured) -> list:
    """The constrained requests alone, run to their end (or to the model's length)."""
    room = min(WHOLE_TOKENS, e.max_model_len - max(len(p) for p in prompts))
    return e.generate([Request(p, params=params(room, schema)) for p in prompts])


def arm_requests(arm: str, prompts: list[list[int]], schema: Structured, tokens: int) -> list[Request]:
    return [
        Request(p, params=params(tokens, schema if arm == HALF and i % 2 == 0 else None))
        for i, p in enumerate(prompts)
    ]


def decode_rounds(
    engines: dict[str, Engine],
    prompts: list[list[int]],
    schema: Structured,
    tokens: int,
    repeats: int,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[dict[str, list[list[float]]], list[int]]:
    """Per arm, per round, the seconds of the first K steps in which all requests decoded; and
    each round's K."""
    steps: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    kept = []
    for repeat in range(1, repeats + 1):
        order = ARMS if repeat % 2 else ARMS[::-1]  # who steps first
        runs = [(engines[arm], arm_requests(arm, prompts, schema, tokens)) for arm in order]
        seconds = dict(zip(order, full_batch_steps(runs), strict=True))
        kept.append(min(len(s) for s in seconds.values()))
        if not kept[-1]:
            raise RuntimeError("no step in which all requests decoded: raise --tokens")
        for arm in ARMS:
            steps[arm].append(seconds[arm][: kept[-1]])
        rates = ", ".join(
            f"{arm} {REQUESTS / statistics.median(s[-1]):.1f} tok/s" for arm, s in steps.items()
        )
        progress(f"round {repeat}/{repeats}: {rates}")
    return steps, kept


def ttft_rounds(model_dir: Path, prompt: list[int], repeats: int, progress: Callable[[str], None]) -> dict:
    """Seconds to the first token of each of TTFT_CASES in each round, on a fresh engine per
    round; and the grammar engine's (compiles, hits) after each round."""
    seconds: dict[str, list[float]] = {case: [] for case in TTFT_CASES}
    counts = []
    for repeat in range(1, repeats + 1):
        progress(f"time to first token, fresh engine {repeat}/{repeats}")
        e = ttft_engine(model_dir)
        first_token_seconds(e, prompt, None)  # the model's first step: allocations, not grammars
        fresh = constraint({**SCHEMA, "properties": {**SCHEMA["properties"], "age": new_bounds(repeat)}})
        for case, schema in zip(
            TTFT_CASES, (None, constraint(SCHEMA), constraint(SCHEMA), fresh), strict=True
        ):
            seconds[case].append(first_token_seconds(e, prompt, schema))
        stats = e.grammars.stats()
        counts.append((stats.compiles, stats.hits))
        e.stop()
    return {"seconds": seconds, "compiles_hits": counts}


def ttft_engine(model_dir: Path) -> Engine:
    """Without a prefix cache: every request computes its whole prompt, as a new one would."""
    config = EngineConfig(
        model=str(model_dir), max_loras=0, kv_cache_tokens=512, max_model_len=256, prefix_caching=False
    )
    return Engine(config)


def new_bounds(n: int) -> dict:
    """SCHEMA's age with other bounds: a constraint as large as SCHEMA, new to the engine."""
    return {"type": "integer", "minimum": 18, "maximum": 199 + n}


def first_token_seconds(e: Engine, prompt: list[int], schema: Structured | None) -> float:
    start = time.perf_counter()
    e.generate([Request(prompt, params=params(1, schema))])
    return time.perf_counter() - start


def mask_costs(e: Engine, outputs: list[list[int]], schema: Structured, repeats: int) -> dict:
    """Per replay, the median seconds of mask_rows over [REQUESTS, vocab] logits with a matcher on
    every second row, and of the grammar engine's masks alone, over the steps where every
    constrained output is still going."""
    replays = [replay_masks(e, outputs, schema) for _ in range(repeats)]
    return {
        "mask_rows_s": [statistics.median(r[0]) for r in replays],
        "grammar_s": [statistics.median(r[1]) for r in replays],
        "steps": min(len(t) for t in outputs),
    }


def replay_masks(e: Engine, outputs: list[list[int]], schema: Structured) -> tuple[list[float], list[float]]:
    """Seconds of each step's mask_rows and of its grammar masks alone (other matchers, in the
    same states), the matchers fed `outputs`' tokens as the engine fed them."""
    ours = [e.grammars.matcher(schema) for _ in outputs]
    alone = [e.grammars.matcher(schema) for _ in outputs]
    logits = torch.randn(REQUESTS, e.model_config.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = [None] * REQUESTS
    rows[::2] = ours
    masked, grammar = [], []
    for step in range(min(len(t) for t in outputs)):
        start = time.perf_counter()
        mask_rows(logits, rows, e.runner.cpu_kernels.token_mask)
        masked.append(time.perf_counter() - start)
        start = time.perf_counter()
        for m in alone:
            m.compute_bitmask()
        grammar.append(time.perf_counter() - start)
        for m, a, t in zip(ours, alone, outputs, strict=True):
            m.consume_token(t[step])
            a.consume_token(t[step])
    return masked, grammar


def whole_summary(e: Engine, whole: list) -> dict:
    """Round 0's constrained outputs: their text (EOS left out), finish reasons and whether each
    is JSON valid against SCHEMA."""
    eos = set(e.tokenizer.eos_token_ids)
    texts = [e.tokenizer.decode([t for t in out.token_ids if t not in eos]) for out in whole]
    return {
        "texts": texts,
        "tokens": [len(out.token_ids) for out in whole],
        "finish_reasons": [out.finish_reason for out in whole],
        "valid": [is_valid(text) for text in texts],
    }


def is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def summary(
    steps: dict[str, list[list[float]]],
    kept: list[int],
    whole: dict,
    ttft: dict,
    masks: dict,
    repeats: int,
    tokens: int,
) -> dict:
    rates = {arm: [REQUESTS / statistics.median(s) for s in rounds] for arm, rounds in steps.items()}
    ratios = [h / n for h, n in zip(rates[HALF], rates[NONE], strict=True)]
    step_s = statistics.median(statistics.median(s) for s in steps[NONE])
    table = decode_rows(rates, ratios, kept, whole) + ttft_rows(ttft) + mask_rows_table(masks, step_s)
    return {
        "setup": setup(repeats, tokens),
        "table": table,
        "decode_tok_s": rates,
        "ratios": ratios,
        "full_batch_steps": kept,
        "ttft_s": ttft["seconds"],
        "ttft_compiles_hits": ttft["compiles_hits"],
        "mask_rows_s": masks["mask_rows_s"],
        "grammar_mask_s": masks["grammar_s"],
        "mask_steps": masks["steps"],
        "decode_step_s": step_s,
        "whole_outputs": whole,
        "schema": SCHEMA,
        "target": TARGET,
        "torch_threads": torch.get_num_threads(),
    }


def decode_rows(
    rates: dict[str, list[float]], ratios: list[float], kept: list[int], whole: dict
) -> list[dict]:
    tokens, valid = whole["tokens"], sum(whole["valid"])
    return [
        {"figure": f"decode tok/s, {NONE}", "value": round(statistics.median(rates[NONE]), 1)},
        {"figure": f"decode tok/s, {HALF}", "value": round(statistics.median(rates[HALF]), 1)},
        {
            "figure": f"decode ratio, {HALF} to {NONE}",
            "value": round(statistics.median(ratios), 3),
            "rounds min..max": f"{min(ratios):.3f} .. {max(ratios):.3f}",
            "note": f"target at least {TARGET}; {min(kept)} to {max(kept)} full-batch steps a round",
        },
        {
            "figure": "whole constrained outputs (round 0)",
            "value": valid,
            "rounds min..max": "",
            "note": f"of {len(tokens)} valid against the schema; {min(tokens)} to {max(tokens)} tokens",
        },
    ]


def ttft_rows(ttft: dict) -> list[dict]:
    seconds = ttft["seconds"]
    plain = statistics.median(seconds[TTFT_CASES[0]])
    rows = []
    for case, values in seconds.items():
        ms = [1000 * v for v in values]
        added = "" if case == TTFT_CASES[0] else f"{1000 * (statistics.median(values) - plain):+.1f} ms"
        rows.append(
            {
                "figure": f"time to first token ms, {case}",
                "value": round(statistics.median(ms), 1),
                "rounds min..max": f"{min(ms):.1f} .. {max(ms):.1f}",
                "note": f"{added} to unconstrained" if added else "",
            }
        )
    return rows


def mask_rows_table(masks: dict, step_s: float) -> list[dict]:
    ms = [1000 * v for v in masks["mask_rows_s"]]
    grammar = [1000 * v for v in masks["grammar_s"]]
    return [
        {
            "figure": f"mask_rows ms a step, {CONSTRAINED} of {REQUESTS} rows",
            "value": round(statistics.median(ms), 2),
            "rounds min..max": f"{min(ms):.2f} .. {max(ms):.2f}",
            "note": (
                f"{statistics.median(ms) / (1000 * step_s):.3f} of an unconstrained decode step "
                f"({1000 * step_s:.1f} ms), over {masks['steps']} steps"
            ),
        },
        {
            "figure": f"of which the grammar engine's {CONSTRAINED} masks, ms",
            "value": round(statistics.median(grammar), 2),
            "rounds min..max": f"{min(grammar):.2f} .. {max(grammar):.2f}",
        },
    ]


def setup(repeats: int, tokens: int) -> str:
    return (
        f"{REQUESTS} concurrent greedy requests on the default model on the CPU, float32, each a chat "
        f"prompt asking for one person as JSON, at most {tokens} new tokens, EOS ignored; in one arm "
        f"none is constrained, in the other every second one ({CONSTRAINED}) follows a mid-size JSON "
        "schema (enums, a nested object through a $ref, an array with bounds, integer bounds, string "
        f"patterns); each arm on its own engine, the engines taking their steps in turn; an arm's "
        f"tok/s in a round is {REQUESTS} over its median step among the first K steps of each arm in "
        f"which all {REQUESTS} requests decoded (the same steps at the same context lengths: "
        f"{tokens} tokens are fewer than any whole output takes, so none ends early); medians of "
        f"{repeats} rounds after a dropped round that runs the constrained requests to their end and "
        "validates their JSON. Time to first token: one request alone, max_tokens 1, on a fresh "
        "engine per round whose model a first request warmed; medians of "
        f"{repeats} rounds. mask_rows: replayed over the constrained outputs of the dropped round, "
        f"medians of the steps, then of {repeats} replays. Target: a decode ratio of at least {TARGET}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()
    result = structured(default_model_dir(), args.repeats, print, args.tokens)
    print(result["setup"] + f"; torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))


if __name__ == "__main__":
    main()
