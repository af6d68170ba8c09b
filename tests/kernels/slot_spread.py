"""Token->slot mappings with the adapter popularity shapes punica tests over."""

import random

SPREADS = ("identical", "distinct", "uniform", "skewed")


def token_slots(
    spread: str, tokens: int, max_loras: int, base_every: int, grouped: bool, seed: int
) -> list[int]:
    """A slot per token; every `base_every`-th token uses the base model (-1), 0 = never.

    identical: all adapter tokens share one slot; distinct: a different slot per token (cycling
    through max_loras); uniform: random slots; skewed: Zipf-like, slot 0 dominates.
    """
    rng = random.Random(seed)
    if spread == "identical":
        slots = [rng.randrange(max_loras)] * tokens
    elif spread == "distinct":
        slots = [i % max_loras for i in range(tokens)]
    elif spread == "uniform":
        slots = [rng.randrange(max_loras) for _ in range(tokens)]
    else:
        weights = [1.0 / (k + 1) ** 2 for k in range(max_loras)]
        slots = rng.choices(range(max_loras), weights=weights, k=tokens)
    if base_every:
        slots = [-1 if i % base_every == 0 else s for i, s in enumerate(slots)]
    return sorted(slots) if grouped else slots
