import json
import subprocess
from pathlib import Path

import pytest

from bench.provenance import CPU_FLAGS, commit
from bench.record import measure, write_record
from bench.report import write_report
from shared import tcmalloc
from tests.allocators import on_each_allocator

ROOT = Path(__file__).resolve().parents[2]


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo."""
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(field))
    return line.split(":", 1)[1].strip()


def test_a_written_record_and_the_report_name_the_commit_and_cpu_it_ran_on(tmp_path):
    def run() -> dict:
        return {"setup": "one round", "table": [{"case": "a", "ratio": 0.9}]}

    record = measure("lora_overhead", "LoRA overhead", run, command="cmd", rerun="cmd --only lora_overhead")
    results = tmp_path / "not" / "made"  # yet: a --results folder of one's own
    written = json.loads(write_record(results, record).read_text())
    model, flags = cpuinfo("model name"), cpuinfo("flags").split()
    assert written["commit"].removesuffix("+dirty") == git(ROOT, "rev-parse", "--short", "HEAD")
    assert written["machine"]["cpu"] == model
    assert written["machine"]["cpu_flags"] == {flag: flag in flags for flag in CPU_FLAGS}

    report = write_report(results, ["lora_overhead"]).read_text()
    assert f"| `lora_overhead` | `{written['commit']}` |" in report  # the table of where figures came from
    assert f"Commit: `{written['commit']}`" in report  # and the benchmark's own section
    family = f"family {cpuinfo('cpu family')} model {cpuinfo('model')}"
    assert written["machine"]["cpu_family"] == family
    assert f"{model}, {family} ({'avx2' if 'avx2' in flags else 'no avx2'}, " in report
    assert "not recorded" not in report
    assert f"| {written['machine']['malloc']} |" in report  # the allocator, in the provenance table


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_a_record_names_the_allocator_its_process_ran_on():
    probe = "from bench.provenance import machine; print(machine()['malloc'])"
    assert on_each_allocator(probe) == ("glibc", "tcmalloc")


def test_commit_is_dirty_while_tracked_files_differ_from_it(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "untracked.py").write_text("")
    assert commit(repo) == head  # a file git does not track changes no figure
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "results" / "a.json").write_text("{}")
    git(repo, "add", "bench")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")
    head = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "bench" / "results" / "a.json").write_text('{"new": 1}')
    assert commit(repo) == head  # a suite writing its results as it goes changes no code
    (repo / "a.py").write_text("x = 2\n")
    assert commit(repo) == f"{head}+dirty"
    assert commit(outside) == "unknown"
