"""torch's allocator advised to put large tensors on 2 MiB pages (shared/huge_page_advice.py):
where the kernel heeds it, and a worker's own tensors advised so as they are allocated."""

import os
import subprocess
import sys

import pytest

from shared import huge_page_advice
from shared.huge_page_advice import ENV, advised

# A fresh interpreter: allocates 64 MiB of zeros and prints the kernel's flags for the mapping
# that holds them ("hg": advised MADV_HUGEPAGE; whether huge pages then back it is the kernel's
# affair, as free memory allows).
ALLOCATE = """
import inference_service.__main__  # the worker's entry: applies the advice before torch loads
import torch
from tests.inference_service.engine.test_huge_pages import mapping_entry
zeros = torch.zeros(16 << 20)
print(" ".join(mapping_entry(zeros.data_ptr() + zeros.nbytes // 2, "VmFlags:")))
"""


@pytest.mark.parametrize(
    ("chosen", "expected"),
    [
        ("always [madvise] never\n", "1"),
        ("[always] madvise never\n", "1"),
        ("always madvise [never]\n", None),
    ],
)
def test_the_advice_is_given_where_the_kernel_heeds_it(tmp_path, chosen, expected):
    setting = tmp_path / "enabled"
    setting.write_text(chosen)
    assert advised({"PATH": "/bin"}, setting) == {"PATH": "/bin"} | ({ENV: expected} if expected else {})


def test_an_operators_choice_stays_and_a_kernel_without_huge_pages_gets_none(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert advised({ENV: "0"}, setting) == {ENV: "0"}
    assert advised({}, tmp_path / "missing") == {}


@pytest.mark.skipif(not huge_page_advice.heeded(), reason="the kernel gives no transparent huge pages")
def test_a_workers_tensors_are_advised_onto_huge_pages_as_they_are_allocated():
    env = {k: v for k, v in os.environ.items() if k != ENV}  # as a worker is started: not inherited

    def flags(environ: dict) -> list[str]:
        run = subprocess.run([sys.executable, "-c", ALLOCATE], env=environ, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()

    assert "hg" in flags(env)
    assert "hg" not in flags(env | {ENV: "0"})  # an operator's choice: the collapse does it later
