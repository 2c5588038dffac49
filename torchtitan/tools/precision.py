"""Floating-point precision: the one map from config names to torch dtypes."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
