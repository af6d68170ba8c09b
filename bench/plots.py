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
    registration = result["registration"]["register_over_read"]
    activation = {name: [s * 1e3 for s in values] for name, values in result["activation"]["seconds"].items()}
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    bars_with_rounds(left, registration, "register time / read time", "registration vs raw read")
    right.boxplot(list(activation.values()), tick_labels=list(activation), whis=(1, 99))
    right.set_ylim(bottom=0)
    right.set_ylabel("ms")
    right.set_title("host tier -> slot activation vs plain copy (whiskers p1..p99)", fontsize=10)
    save(fig, path)


def grpc_overhead(result: dict, path: Path) -> None:
    values = result["values"]
    fig = Figure(figsize=(9, 3.6))
    left, right = fig.subplots(1, 2)
    rates = {"in process": values["in-process"], "gRPC (SDK)": values["grpc"]}
    ratio = statistics.median(result["ratios"]["grpc"])
    bars_with_rounds(left, rates, "tok/s", f"32 concurrent streams: gRPC / in process {ratio:.2f}")
    ttft = {"resident": [s * 1e3 for s in values["resident"]], "cold": [s * 1e3 for s in values["cold"]]}
    ratio = statistics.median(result["ratios"]["cold"])
    bars_with_rounds(right, ttft, "ms", f"time to first token: cold / resident {ratio:.2f}")
    save(fig, path)
