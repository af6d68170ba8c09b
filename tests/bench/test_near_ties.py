"""bench.near_ties: a request's bf16 tokens are compared up to the first step whose top two logits
bf16's own rounding could swap."""

import torch

from bench.hf_peft import Job
from bench.near_ties import GreedyPath, greedy_paths


class Scripted(torch.nn.Module):
    """A model whose last-position logits at step i (counted from the prompt's end) are rows[i]."""

    def __init__(self, rows: list[list[float]], prompt: int):
        super().__init__()
        self.rows, self.prompt = torch.tensor(rows), prompt

    def forward(self, input_ids, adapter_names=None):
        step = input_ids.shape[1] - self.prompt
        logits = torch.zeros(1, input_ids.shape[1], self.rows.shape[1])
        logits[0, -1] = self.rows[step]
        return type("Output", (), {"logits": logits})()


def test_the_first_step_whose_margin_bf16_moved_as_far_is_a_near_tie():
    # step 0: margin 2, 0.1 from fp32's: clear; step 1: margin 0.25, 0.375 from fp32's (which puts
    # the other token first): a near tie; step 2: clear again, but the path is cut at step 1
    low = Scripted([[0, 2, 0], [1.25, 1.0, 0], [0, 0, 3]], prompt=2)
    high = Scripted([[0, 1.9, 0], [1.0, 1.125, 0], [0, 0, 3]], prompt=2)
    (path,) = greedy_paths(low, high, [Job(None, [7, 7], 3)])
    assert path == GreedyPath([1, 0, 2], tie=1) and path.compared == 1
    assert path.agrees([1, 1, 1]) and not path.agrees([0, 0, 2])


def test_equal_logits_are_a_near_tie_and_a_path_without_one_is_compared_whole():
    (path,) = greedy_paths(Scripted([[1, 1]], 1), Scripted([[1, 1]], 1), [Job("a", [5], 1)])
    assert path == GreedyPath([0], tie=0)
    clear = GreedyPath([3, 4], tie=None)
    assert clear.compared == 2 and clear.agrees([3, 4]) and not clear.agrees([3, 5])
