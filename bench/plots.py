"""The report's PNG plots, one function per benchmark, drawn from its result dict with
matplotlib's Agg canvas (no display, no pyplot state)."""

import statistics
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def bars_with_rounds(ax: Axes, samples: dict[str, list[float]], ylabel: str, title: str) -> None:
    """One bar per case at its median, with every round as a dot on it."""
    for x, values in enumerate(samples.values()):
        ax.bar(x, statistics.median(values), color="tab:blue", alpha=0.6)
        ax.plot([x] * len(values), values, "o", color="black", markersize=3)
    ax.set_xticks(range(len(samples)), list(samples))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)


def save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    tmp.replace(path)


def lora_overhead(result: dict, path: Path) -> None:
    ratios = {("base" if n == "0" else n): values for n, values in result["ratio_to_base"].items()}
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    bars_with_rounds(ax, ratios, "decode tok/s, ratio to base", "decode throughput vs distinct adapters")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("distinct rank-16 all-linear adapters across 32 requests")
    save(fig, path)


def adapter_loading(result: dict, path: Path) -> None:
    names = {"disk": "register, disk", "S3": "register, S3", "fetch": "fetch to worker"}
    registration = {names[k]: v for k, v in result["registration"]["register_over_read"].items()}
    activation = {name: [s * 1e3 for s in values] for name, values in result["activation"]["seconds"].items()}
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    bars_with_rounds(left, registration, "time / raw read of the bytes", "register and fetch vs raw read")
    right.boxplot(list(activation.values()), tick_labels=list(activation), whis=(1, 99))
    right.set_ylim(bottom=0)
    right.set_ylabel("ms")
    right.set_title("host tier -> slot activation vs plain copy (whiskers p1..p99)", fontsize=10)
    save(fig, path)


def grpc_overhead(result: dict, path: Path) -> None:
    values = result["values"]
    fig = Figure(figsize=(4.8, 3.6))
    ax = fig.add_subplot()
    rates = {"in process": values["in-process"], "gRPC (SDK)": values["grpc"]}
    ratio = statistics.median(result["ratios"]["grpc"])
    bars_with_rounds(ax, rates, "tok/s", f"32 concurrent streams: gRPC / in process {ratio:.2f}")
    save(fig, path)


def cold_starts(result: dict, path: Path) -> None:
    values, ratios = result["values"], result["ratios"]
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    ttft = {case: [s * 1e3 for s in values[case]["ttft p50"]] for case in ("resident", "cold")}
    ratio = statistics.median(ratios["ttft p50"])
    bars_with_rounds(left, ttft, "ms", f"probe TTFT p50: cold / resident {ratio:.2f}")
    itl = {
        f"{q}\n{'no load' if case == 'resident' else 'loading'}": [s * 1e3 for s in values[case][f"itl {q}"]]
        for q in ("p50", "p99")
        for case in ("resident", "cold")
    }
    p99 = statistics.median(ratios["itl p99"])
    bars_with_rounds(right, itl, "ms", f"resident streams' ITL, cold adapters loading: p99 {p99:.2f}x")
    save(fig, path)


def scaling(result: dict, path: Path) -> None:
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    for (name, curves), color in zip(result["values"].items(), ("tab:blue", "tab:orange"), strict=False):
        label = result["models"][name]
        for case, style in (("base", "-"), ("lora", "--")):
            points = {int(c): statistics.median(v) for c, v in curves["concurrency"][case].items()}
            left.plot(
                list(points), list(points.values()), style, marker="o", color=color, label=f"{label}, {case}"
            )
        ranks = curves["rank"]
        ratios = {
            int(r): statistics.median(a / b for a, b in zip(v, ranks["0"], strict=True))
            for r, v in ranks.items()
        }
        ratios.pop(0)
        right.plot(list(ratios), list(ratios.values()), marker="o", color=color, label=label)
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent requests (LoRA: 8 distinct rank-16 adapters)")
    left.set_ylabel("decode tok/s")
    left.legend(fontsize=7)
    right.set_xscale("log", base=2)
    right.set_xlabel("adapter rank (32 requests, 8 distinct adapters)")
    right.set_ylabel("decode tok/s, ratio to base")
    right.set_ylim(0, 1.1)
    right.legend(fontsize=7)
    save(fig, path)


def many_adapters(result: dict, path: Path) -> None:
    rounds = result["rounds"]
    zipf = next(iter(rounds))  # the Zipf case comes first, then the hot one
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    rates = {case: [r["tok/s"] for r in values] for case, values in rounds.items()}
    ratio = statistics.median(result["ratio_to_hot"])
    whole = statistics.median(result["round_ratio_to_hot"])
    title = f"saturated engine: Zipf / hot {ratio:.2f}\n(whole round, queue draining: {whole:.2f})"
    bars_with_rounds(left, rates, "generated tok/s, saturated", title)
    shares = {
        "hit rate\n(engine counter)": [r["hit rate"] for r in rounds[zipf]],
        "requests whose\nadapter was held": [r["requests held"] for r in rounds[zipf]],
    }
    bars_with_rounds(right, shares, "share of checks / of requests", f"host tier, {zipf}")
    right.set_ylim(0, 1.05)
    save(fig, path)


def rank_padding(result: dict, path: Path) -> None:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ratios = {
        name.removeprefix("max_lora_rank="): values for name, values in result["ratio_to_rank8"].items()
    }
    bars_with_rounds(
        ax, ratios, "decode step, ratio to max_lora_rank 8", "rank-8 adapters under a larger max_lora_rank"
    )
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("max_lora_rank")
    save(fig, path)


def quantized(result: dict, path: Path) -> None:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    names = {"none": "dense", "int8": "int8", "nf4": "NF4"}
    dtypes = {"float32": "fp32", "bfloat16": "bf16"}
    ratios = {}
    for name, values in result["ratios"].items():
        dtype, q = name.split()
        ratios[f"{dtypes[dtype]}\n{names[q]}"] = values
    bars_with_rounds(ax, ratios, "decode tok/s, ratio to dense", "quantized base weights on the CPU")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    save(fig, path)


def moe(result: dict, path: Path) -> None:
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ratios = {"8 adapters on\nattention, router, experts": result["ratios"]}
    bars_with_rounds(
        ax, ratios, "decode tok/s, ratio to no adapters", "LoRA on a mixture-of-experts model, CPU"
    )
    ax.axhline(1.0, color="gray", linewidth=0.8)
    save(fig, path)


def vocab_adapters(result: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    rates = {name.replace(" with ", "\nwith "): values for name, values in result["decode_tok_s"].items()}
    bars_with_rounds(left, rates, "decode tok/s", "32 requests over 8 rank-16 adapters")
    ratio = statistics.median(result["ratios"])
    bars_with_rounds(
        right, {"vocabulary side\n/ plain": result["ratios"]}, "decode tok/s, ratio", f"ratio {ratio:.3f}"
    )
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.axhline(result["target"], color="tab:red", linewidth=0.8, linestyle="--", label="target")
    right.legend(fontsize=7)
    save(fig, path)


def structured(result: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    ratio = statistics.median(result["ratios"])
    rates = {name.replace(" constrained", "\nconstrained"): v for name, v in result["decode_tok_s"].items()}
    bars_with_rounds(left, rates, "decode tok/s", f"32 requests, ratio {ratio:.3f}")
    ttft = {name.replace(" ", "\n", 2): [1e3 * s for s in v] for name, v in result["ttft_s"].items()}
    bars_with_rounds(right, ttft, "time to first token, ms", "one request alone")
    right.tick_params(axis="x", labelsize=7)
    save(fig, path)


def tensor_parallel(result: dict, path: Path) -> None:
    fig = Figure(figsize=(7.2, 3.6))
    ax = fig.add_subplot()
    ratios = {name.replace(", ", ",\n"): values for name, values in result["ratios"].items()}
    bars_with_rounds(ax, ratios, "tok/s, ratio to 1 rank, 1 thread", "tensor parallelism on 2 CPU cores")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    save(fig, path)


def hf_peft(result: dict, path: Path) -> None:
    values = result["values"]
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    rates = {"loramux": values["loramux"], "HF + PEFT\n(adapter_names=)": values["hf_peft"]}
    ratio = statistics.median(result["ratios"])
    bars_with_rounds(ax, rates, "useful tok/s", f"32 mixed-adapter requests: loramux / HF + PEFT {ratio:.2f}")
    save(fig, path)


def kv_pressure(result: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    for side, running in result["running"].items():
        left.plot(range(1, len(running) + 1), running, label=side, linewidth=1)
    ratio = statistics.median(result["ratios"]["running per step"])
    left.set_title(
        f"early stops: running requests per step\n(on demand / reserving {ratio:.2f})", fontsize=10
    )
    left.set_xlabel("step")
    left.set_ylabel("running requests")
    left.legend(fontsize=7)
    long_run = result["long_run"]
    right.plot(range(1, len(long_run["running"]) + 1), long_run["running"], linewidth=1)
    preempted = sum(1 for p in long_run["preemptions"] if p)
    right.set_title(
        f"every request to max_tokens, a cache of 1/3:\n{preempted} preempted, "
        f"{long_run['steps_without_progress']} steps without progress",
        fontsize=10,
    )
    right.set_xlabel("step")
    right.set_ylabel("running requests")
    save(fig, path)


def prefix_cache(result: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    ttft = result["ttft"]
    left.boxplot(list(ttft.values()), tick_labels=list(ttft))
    left.set_yscale("log")
    left.set_ylabel("time to first token, s")
    left.set_title("shared system prompts per adapter", fontsize=10)
    ratios = result["distinct_ratios"]
    bars_with_rounds(right, {"on / off": ratios}, "generated tok/s, ratio", "no shared prefix")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_ylim(0.9, 1.05)
    save(fig, path)


def http_overhead(result: dict, path: Path) -> None:
    values = result["values"]
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    rates = {"SDK, direct": values["direct"]["tok/s"], "openai client,\ngateway": values["gateway"]["tok/s"]}
    ratio = statistics.median(result["ratios"]["tok/s"])
    bars_with_rounds(left, rates, "tok/s", f"32 concurrent streams: gateway / direct {ratio:.2f}")
    ttft = {
        "SDK, direct": [s * 1e3 for s in values["direct"]["ttft p50"]],
        "openai client,\ngateway": [s * 1e3 for s in values["gateway"]["ttft p50"]],
    }
    added = statistics.median(result["differences"]["ttft p50 s"]) * 1e3
    bars_with_rounds(right, ttft, "ms", f"time to first token p50: gateway adds {added:+.1f} ms")
    save(fig, path)
