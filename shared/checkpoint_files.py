"""The safetensors files of an HF model folder: one, or the shards its index names."""

import json
from pathlib import Path

from shared.errors import InvalidArgument


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidArgument(
        f"model folder {model_dir} has neither model.safetensors nor model.safetensors.index.json"
    )
