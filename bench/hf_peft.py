"""loramux against the alternative users pick: HF transformers + PEFT mixed-adapter batch generation
(`generate(..., adapter_names=[...])`) on the default model, with the same 32 requests on both
sides: 8 distinct random rank-16 all-linear adapters round-robin, prompt and output lengths
varied, greedy, EOS ignored. HF generates the whole left-padded batch in one call up to the
longest output; tokens/s counts each request's own output length on both sides. Rounds
alternate which side goes first; medians and the median of per-round ratios are printed, with
how many requests got identical greedy tokens from both sides.

    LORAMUX_CACHE=.cache .venv/bin/python -m bench.hf_peft [--repeats 3]
"""

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

REQUESTS, ADAPTERS, RANK = 32, 8, 16
PROMPT_LENS, OUTPUT_LENS = (8, 32), (8, 40)  # inclusive ranges, drawn uniformly per request
WARM_UP_TOKENS = 4
FIRST_ORDINARY_ID = 17  # ids 0..16 are the default tokenizer's special tokens
PAD_ID = 0  # left padding for HF; masked out, so any id will do
SEED = 0
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Job:
    """One request of the workload, as both sides get it."""

    adapter: str | None  # None: the base model
    prompt: list[int]
    tokens: int  # new tokens to generate


@dataclass(frozen=True)
class Run:
    """One side's pass over the workload: wall seconds of the whole call, each job's tokens, and
    where the side timed it (bench/peers.py), the seconds from the last job's first token to the
    last token."""

    seconds: float
    outputs: list[list[int]]
    decode_s: float | None = None


def workload(vocab_size: int, seed: int = SEED) -> list[Job]:
    """REQUESTS jobs: adapters r16-0 .. r16-7 round-robin, lengths and prompt ids from `seed`."""
    rng = random.Random(seed)
    jobs = []
    for i in range(REQUESTS):
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(rng.randint(*PROMPT_LENS))]
        jobs.append(Job(f"r16-{i % ADAPTERS}", prompt, rng.randint(*OUTPUT_LENS)))
    return jobs


def loramux_run(engine: Engine, jobs: list[Job]) -> Run:
    batch = []
    for job in jobs:
        params = SamplingParams(max_tokens=job.tokens, temperature=0, ignore_eos=True)
        batch.append(Request(job.prompt, job.adapter, params))
    start = time.perf_counter()
    outputs = engine.generate(batch)
    return Run(time.perf_counter() - start, [o.token_ids for o in outputs])


def hf_run(model: torch.nn.Module, jobs: list[Job]) -> Run:
    """One generate call over the left-padded batch, as an HF + PEFT user writes it; rows run to
    the longest output and each keeps its first `tokens` new tokens. Jobs without adapters run on
    a plain transformers model."""
    width = max(len(job.prompt) for job in jobs)
    ids = torch.tensor([[PAD_ID] * (width - len(job.prompt)) + job.prompt for job in jobs])  # [rows, width]
    mask = torch.tensor([[0] * (width - len(job.prompt)) + [1] * len(job.prompt) for job in jobs])
    adapters = [job.adapter for job in jobs]
    start = time.perf_counter()
    out = model.generate(  # [rows, width + max tokens]
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        **({"adapter_names": adapters} if any(adapters) else {}),  # PEFT's argument; transformers rejects it
        max_new_tokens=max(job.tokens for job in jobs),
        do_sample=False,
        eos_token_id=None,  # no EOS stopping criterion: every row runs to max_new_tokens
        pad_token_id=PAD_ID,
    )
    if out.is_cuda:
        torch.cuda.synchronize(out.device)  # the clock stops when the GPU is done, not when it was told
    seconds = time.perf_counter() - start
    return Run(seconds, [out[i, width : width + job.tokens].tolist() for i, job in enumerate(jobs)])


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """The transformers model of `model_dir` on `device`, in eval mode."""
    # transformers and peft come with the `test` extra, not `bench`: imported only when this runs
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()


def peft_model(base: torch.nn.Module, folders: list[Path]) -> torch.nn.Module:
    """`base` with every adapter loaded under its folder's name, in eval mode. The adapters keep
    the base model's dtype, as loramux's slots do (PEFT would upcast bf16 and fp16 ones to fp32)."""
    from peft import PeftModel

    first = folders[0]
    model = PeftModel.from_pretrained(base, first, adapter_name=first.name, autocast_adapter_dtype=False)
    for folder in folders[1:]:
        model.load_adapter(folder, adapter_name=folder.name, autocast_adapter_dtype=False)
    return model.eval()


def loramux_engine(model_dir: Path, folders: list[Path], jobs: list[Job]) -> Engine:
    longest = max(len(job.prompt) + job.tokens for job in jobs)
    config = EngineConfig(
        model=str(model_dir),
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        max_cpu_loras=ADAPTERS,
        max_num_seqs=REQUESTS,
        max_model_len=longest + 16,  # + 16: each sequence's last block is partly used
        kv_cache_tokens=REQUESTS * (longest + 16),
    )
    engine = Engine(config)
    for folder in folders:
        engine.add_adapter(folder.name, folder)
    return engine


def hf_peft_vs_loramux(model_dir: Path, repeats: int = 3, progress: Progress = lambda line: None) -> dict:
    """Useful tokens/s of both sides on the same workload: per round, medians, ratios, agreement."""
    model = ModelConfig.from_dir(model_dir)
    jobs = workload(model.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"{ADAPTERS} random rank-{RANK} adapters, the engine and the PEFT model")
        folders = [write_random_adapter(model, Path(tmp) / f"r16-{i}", RANK, seed=i) for i in range(ADAPTERS)]
        sides = {
            "loramux": partial(loramux_run, loramux_engine(model_dir, folders, jobs)),
            "hf_peft": partial(hf_run, peft_model(hf_model(model_dir), folders)),
        }
        with torch.inference_mode():
            values, identical = measure(sides, jobs, repeats, progress)
    return summary(values, identical, jobs, repeats)


def measure(
    sides: dict[str, Callable[[list[Job]], Run]], jobs: list[Job], repeats: int, progress: Progress
) -> tuple[dict[str, list[float]], list[int]]:
    """Per round: each side's useful tok/s, and how many requests got identical tokens."""
    progress(f"warm-up: every request, {WARM_UP_TOKENS} new tokens, on each side")
    for run in sides.values():
        run([replace(job, tokens=WARM_UP_TOKENS) for job in jobs])
    useful = sum(job.tokens for job in jobs)
    values: dict[str, list[float]] = {name: [] for name in sides}
    identical = []
    for repeat in range(repeats):
        progress(f"round {repeat + 1}/{repeats}")
        order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]  # who goes first
        runs = {name: sides[name](jobs) for name in order}
        for name, run in runs.items():
            values[name].append(useful / run.seconds)
        identical.append(agreement(runs["loramux"].outputs, runs["hf_peft"].outputs))
    return values, identical


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """How many requests got the same greedy tokens from both sides."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


def summary(values: dict[str, list[float]], identical: list[int], jobs: list[Job], repeats: int) -> dict:
    """Medians, and the median of per-round ratios (each round times both sides back to back)."""
    ratios = [ours / hf for ours, hf in zip(values["loramux"], values["hf_peft"], strict=True)]
    useful = sum(job.tokens for job in jobs)
    hf_generated = len(jobs) * max(job.tokens for job in jobs)
    table = [
        {
            "case": "loramux Engine.generate, useful tok/s",
            "value": round(statistics.median(values["loramux"]), 1),
            "baseline": "HF + PEFT generate(adapter_names=), useful tok/s",
            "baseline value": round(statistics.median(values["hf_peft"]), 1),
            "ratio": round(statistics.median(ratios), 2),
        },
        {
            "case": "tokens generated: each request's own length",
            "value": useful,
            "baseline": "HF tokens generated: rows x longest output",
            "baseline value": hf_generated,
            "ratio": round(useful / hf_generated, 2),
        },
        {
            "case": "requests with identical greedy tokens, worst round",
            "value": f"{min(identical)} / {len(jobs)}",
        },
    ]
    return {
        "setup": setup(jobs, repeats),
        "table": table,
        "values": values,
        "ratios": ratios,
        "identical": identical,
        "torch_threads": torch.get_num_threads(),
    }


def setup(jobs: list[Job], repeats: int) -> str:
    prompts = [len(job.prompt) for job in jobs]
    outputs = [job.tokens for job in jobs]
    return (
        f"default model, fp32; {len(jobs)} requests over {ADAPTERS} distinct random rank-{RANK} "
        f"all-linear adapters (round-robin), prompts of {min(prompts)}..{max(prompts)} random "
        f"non-special token ids, outputs of {min(outputs)}..{max(outputs)} new tokens "
        f"({sum(outputs)} in all), greedy, EOS ignored. loramux: Engine.generate on all requests "
        f"(continuous batching, each request stops at its own length). HF transformers + PEFT: one "
        f"generate(adapter_names=...) call over the left-padded batch with attention mask and "
        f"max_new_tokens = the longest output, in torch.inference_mode(). Tokens/s = the requests' own "
        f"output tokens / wall seconds of the whole call, prefill included, same count on both sides; "
        f"medians of {repeats} rounds, each timing both sides back to back (alternating which goes "
        f"first), after a warm-up ({WARM_UP_TOKENS} new tokens per request); ratio = loramux / HF, "
        f"the median of per-round ratios"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = default_model_dir()
    start = time.perf_counter()
    result = hf_peft_vs_loramux(model_dir, args.repeats, print)
    print(result["setup"] + f"; torch threads {result['torch_threads']}")
    for row in result["table"]:
        print(" | ".join(str(value) for value in row.values()))
    for name, values in result["values"].items():
        print(f"{name} tok/s per round: " + " ".join(f"{v:.1f}" for v in values))
    print(f"identical per round: {result['identical']}; took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
