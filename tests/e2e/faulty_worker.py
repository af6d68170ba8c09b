"""`python -m tests.e2e.faulty_worker ARGS`: the inference worker whose model forward, after
$LORAMUX_FAULT_AFTER_STEPS steps, raises (LORAMUX_FAULT=raise) as a GPU that hits a device error
would, or never returns (LORAMUX_FAULT=hang) as a hung device would; a hang logs HANGING first."""

import logging
import os
import threading

from inference_service.engine.model_runner import ModelRunner
from inference_service.server import main as worker

FAULT = "injected fault: CUDA error: an illegal memory access was encountered"
HANGING = "injected fault: this step hangs"


def main() -> None:
    steps_left = int(os.environ["LORAMUX_FAULT_AFTER_STEPS"])
    hang = os.environ["LORAMUX_FAULT"] == "hang"
    forward = ModelRunner.forward

    def failing_forward(self, *args, **kwargs):
        nonlocal steps_left
        steps_left -= 1
        if steps_left < 0:
            if hang:
                logging.getLogger(__name__).warning(HANGING)
                threading.Event().wait()
            raise RuntimeError(FAULT)
        return forward(self, *args, **kwargs)

    ModelRunner.forward = failing_forward
    worker.main()


if __name__ == "__main__":
    main()
