"""`python -m tests.e2e.faulty_worker ARGS`: the inference worker whose model forward raises
after $LORAMUX_FAULT_AFTER_STEPS steps, as a GPU that hits a device error mid-run would."""

import os

from inference_service import __main__ as worker
from inference_service.model_runner import ModelRunner

FAULT = "injected fault: CUDA error: an illegal memory access was encountered"


def main() -> None:
    steps_left = int(os.environ["LORAMUX_FAULT_AFTER_STEPS"])
    forward = ModelRunner.forward

    def failing_forward(self, *args, **kwargs):
        nonlocal steps_left
        steps_left -= 1
        if steps_left < 0:
            raise RuntimeError(FAULT)
        return forward(self, *args, **kwargs)

    ModelRunner.forward = failing_forward
    worker.main()


if __name__ == "__main__":
    main()
