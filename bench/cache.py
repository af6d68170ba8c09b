"""Where the benchmarks keep the default model (and other prepared models): `$LORAMUX_CACHE`, or
.cache in the current directory, as `make bench` sets it."""

import os
from pathlib import Path

from inference_service.default_model import prepare_default_model


def default_model_dir() -> Path:
    """The default model's HF folder in the benchmark cache, converted on first use."""
    return prepare_default_model(Path(os.environ.get("LORAMUX_CACHE", ".cache")).resolve())
