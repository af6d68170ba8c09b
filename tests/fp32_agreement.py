"""How closely our fp32 logits must agree with a reference's (transformers, PEFT): as closely as the
reference's own fp32 forward agrees with its float64 forward, on the machine the test runs on.

Logits pass through thousands of fp32 roundings, in orders that differ between CPUs (vector width,
threads, oneDNN's blocking for AVX2, AVX-512 or AMX) and between two implementations of the same
sums, so no fixed tolerance holds on every CPU: 1e-4 once failed by 1.09e-4 on an AVX-512 Xeon.
The reference's float64 forward is the yardstick (it still rounds its norms and rotary tables to
fp32, as its fp32 forward and ours do, so it leaves out only the error the orders make), and its
fp32 forward's distance from it is what fp32 costs this computation here. Two fp32 forwards of the
same sums in different orders err by the same amount, so ours may be at most SLACK times as far.

Distances are root mean squares over all logits compared. The largest single error is a poor
statistic: over the PEFT test's cases it swung from 0.77 to 1.73 times the reference's, where the
root mean square stayed within 0.92 to 1.22 of it. A defect in the math (a missing or doubled LoRA
term, a wrong scaling, position or norm) moves logits thousands of times further than fp32 does.
"""

import torch

SLACK = 2.0


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def assert_fp32_agrees(ours: torch.Tensor, reference32: torch.Tensor, reference64: torch.Tensor) -> None:
    """ours and reference32: fp32 logits of one computation; reference64: the reference's float64
    forward of it. NaN or Inf in ours fails."""
    truth = reference64.double()
    scale = rms(reference32.double() - truth)
    error = rms(ours.double() - truth)
    assert error <= SLACK * scale, (
        f"our fp32 logits are {error:.3g} (RMS) from the reference's float64 forward, its own fp32 "
        f"forward {scale:.3g}: more than {SLACK:g} times as far"
    )
