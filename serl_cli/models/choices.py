"""The words a config may give a device, a precision and an attention kernel.

Apart from :mod:`serl_cli.models.device`, which turns them into torch devices and dtypes, so
that a config loads and is checked without importing torch.
"""

from __future__ import annotations

from typing import Literal, get_args

from serl_cli.errors import SerlError

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
Attention = Literal["auto", "sdpa", "eager", "flash_attention_2"]
DEVICES, DTYPE_NAMES, ATTENTION = get_args(Device), get_args(Dtype), get_args(Attention)


def check_names(device: str, dtype: str, attn: str = "auto") -> None:
    """The settings are known words (no GPU is needed to check that)."""
    if device not in DEVICES:
        raise SerlError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")
    if dtype not in DTYPE_NAMES:
        raise SerlError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    if attn not in ATTENTION:
        raise SerlError(f"unknown attn_implementation {attn!r}: choose one of {', '.join(ATTENTION)}")
