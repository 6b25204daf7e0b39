"""A hub model name with no network fails with one line naming what to do, instead of a minute of retries."""

from __future__ import annotations

import huggingface_hub
import pytest

from serl_cli.models.loading import ModelError, load_model


def test_unreachable_hub_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    with pytest.raises(ModelError) as info:
        load_model("someorg/somemodel")
    msg = str(info.value)
    assert "\n" not in msg and "'someorg/somemodel'" in msg and "unreachable" in msg and "HF_HUB_OFFLINE=1" in msg
