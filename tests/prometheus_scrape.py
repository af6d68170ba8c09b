"""Reading a process's /metrics as Prometheus does: over HTTP, through prometheus-client's parser."""

import re
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

LOGGED_ADDRESS = re.compile(r"Prometheus metrics on http://(\S+)/metrics")


def logged_metrics_address(log: Path, timeout_s: float = 30) -> str:
    """The HOST:PORT a process started with --metrics-listen HOST:0 logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = LOGGED_ADDRESS.search(log.read_text())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no metrics address in {log}:\n{log.read_text()[-3000:]}")


def scrape(address: str) -> list[Sample]:
    """Every sample of http://address/metrics, parsed (the parser raises on malformed text)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape_until(address: str, condition, timeout_s: float = 20) -> list[Sample]:
    """Scrapes until `condition(samples)` holds or the timeout passes; the last samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(address)
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels`; 0 when there is none yet."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{name} {labels} matches {len(found)} samples"
    return found[0] if found else 0.0


def find(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]
