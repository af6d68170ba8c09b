"""The serving dtypes both services accept, by the names configs and the wire format use."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
