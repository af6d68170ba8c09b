"""bench.allocator: each arm's decode runs in a process of its own on that arm's allocator."""

import pytest

from bench import allocator
from shared import tcmalloc

LIBRARY = "libtcmalloc_minimal.so.4"


def test_the_glibc_arm_keeps_tcmalloc_out_and_every_other_preload(monkeypatch):
    monkeypatch.setattr(tcmalloc, "library", lambda: LIBRARY)
    monkeypatch.setenv("LD_PRELOAD", f"{LIBRARY}:libx.so")
    assert allocator.arm_env("glibc")["LD_PRELOAD"] == "libx.so"
    assert allocator.arm_env("tcmalloc")["LD_PRELOAD"] == f"{LIBRARY}:libx.so"
    monkeypatch.setenv("LD_PRELOAD", LIBRARY)
    assert "LD_PRELOAD" not in allocator.arm_env("glibc")


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_a_pair_decodes_on_each_allocator_in_turn(tiny_models):
    """run_arm refuses a process that ran on the other arm's allocator, so a pair that comes back
    ran one process on each."""
    result = allocator.compare(tiny_models["llama"], ["float32"], pairs=1, batches=(1, 2), tokens=4)
    for batch in (1, 2):
        arms = result["float32"][batch]
        assert len(arms["glibc"]) == len(arms["tcmalloc"]) == 1
        assert arms["ratio"] == [arms["tcmalloc"][0] / arms["glibc"][0]]
        assert arms["glibc"][0] > 0 and arms["tcmalloc"][0] > 0


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_a_process_that_ran_on_the_other_allocator_is_refused(tiny_models, monkeypatch):
    """An arm whose environment did not give it its allocator measures nothing."""
    glibc_env = allocator.arm_env
    monkeypatch.setattr(
        allocator, "arm_env", lambda arm: glibc_env("tcmalloc" if arm == "glibc" else "glibc")
    )
    with pytest.raises(RuntimeError, match="the glibc arm's process ran on tcmalloc"):
        allocator.run_arm("glibc", tiny_models["llama"], "float32", (1,), 2)
