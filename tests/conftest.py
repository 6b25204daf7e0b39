"""Shared test setup: one torch thread, offline Hugging Face, the data folder, and the model fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SERL_THREADS", "1")
# an xdist worker starts with COLUMNS=80, which rich would fix as the width of serl's consoles when
# they are created; without it they read COLUMNS per print, as tests that set it expect
os.environ.pop("COLUMNS", None)
sys.path.insert(0, str(Path(__file__).parent))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

# tests run the CLI in-process (and in forked children): keep library progress bars off
# stderr, as a fresh `serl` process does, so "one line" means one line
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()


# -- fixtures: a tokenizer and tiny models built offline in seconds (tests/support.py) ------------------
# (imported here, after the environment above is set)
from support import boost_eos, webshop_like_corpus  # noqa: E402

from serl_cli.models.loading import load_model  # noqa: E402
from serl_cli.models.tiny import init_model, train_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(webshop_like_corpus(), 4096)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", webshop_like_corpus(), seed=0)


@pytest.fixture(scope="session")
def stopping_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    model, tokenizer = load_model(str(tiny_model_dir))
    model.eval()
    boost_eos(model, tokenizer, webshop_like_corpus())
    out = tmp_path_factory.mktemp("models") / "tiny-stopping"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# -- the fast tier: `python -m pytest -m "not slow"` -------------------------------------------------
# A test that builds on a model (a tiny model directory, directly or through another fixture) trains,
# generates or scores with it: slow, as are those marked by hand. What is left -- the math, the
# environments, configs, artifacts, the CLI's refusals -- is the fast tier.
MODEL_FIXTURES = {"tiny_model_dir", "stopping_model_dir"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# -- a folder nothing can be written into (the read-only checks) --------------------------------------
@pytest.fixture
def unwritable(tmp_path) -> Iterator[Path]:
    """A folder this process cannot create anything in: a read-only one, or for root (who writes
    into those anyway) a folder of sysfs, which refuses new entries to everyone."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").mkdir()
    except OSError:
        yield folder
    else:
        (folder / "probe").rmdir()
        sysfs = Path("/sys/kernel")
        try:
            (sysfs / "serl-probe").mkdir()
        except OSError:
            yield sysfs
        else:  # pragma: no cover
            (sysfs / "serl-probe").rmdir()
            pytest.skip("no folder here refuses this process a new directory")
    finally:
        folder.chmod(0o755)
