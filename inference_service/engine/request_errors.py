"""The errors that stop one running request while the others run on, each naming its cause."""

from inference_service.engine.sequence import Sequence
from shared.errors import FailedPrecondition, InvalidArgument


def left_constraint(seq: Sequence) -> InvalidArgument:
    """The grammar engine stopped following the output: a token its mask forbade (never, while
    masks hold) or a step past its limits on a constraint's work."""
    problem = seq.matcher.get_error().splitlines()[0]
    return InvalidArgument(
        f"structured output: the grammar engine could not go on ({problem}); the request was stopped"
    )


def overflowed(seq: Sequence, dtype: str) -> FailedPrecondition:
    source = f"adapter {seq.adapter!r}" if seq.adapter else "the base model"
    return FailedPrecondition(
        f"{source} produced NaN or Inf logits for this request (values overflow in {dtype}); "
        "the request was stopped"
    )
