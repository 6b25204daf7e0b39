"""Shared test setup: one torch thread, offline Hugging Face, the data folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SERL_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

# tests run the CLI in-process (and in forked children): keep library progress bars off
# stderr, as a fresh `serl` process does, so "one line" means one line
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()


def webshop_data_dir() -> Path | None:
    root = os.environ.get("SERL_DATA_DIR")
    if root and (Path(root) / "webshop" / "documents_1k.jsonl").is_file():
        return Path(root) / "webshop"
    return None


def requires_webshop_data() -> Path:
    """Skip (with the reason) where the real 1k catalog is absent; CI sets SERL_DATA_DIR."""
    path = webshop_data_dir()
    if path is None:
        pytest.skip("SERL_DATA_DIR does not point at the WebShop data (webshop/documents_1k.jsonl)")
    return path
