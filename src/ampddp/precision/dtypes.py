"""Parsing of dtype settings, so YAML strings and torch dtypes are accepted alike."""

from __future__ import annotations

import torch

from ampddp.errors import ConfigError

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
LOW_PRECISION = (torch.float16, torch.bfloat16)


def parse_float_dtype(name: str, value: object) -> torch.dtype | None:
    """Turn None/False, a torch floating dtype or one of FLOAT_DTYPES' names into a dtype."""
    if value is None or value is False:
        return None
    if isinstance(value, torch.dtype) and value in FLOAT_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in FLOAT_DTYPES:
        return FLOAT_DTYPES[value.lower()]
    raise ConfigError(
        f"{name}={value!r} is not a supported dtype; valid: None, torch.float16, torch.bfloat16, "
        f"torch.float32 or one of the strings {', '.join(sorted(FLOAT_DTYPES))}"
    )


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """Short printable name ('float16') for a dtype, None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")
