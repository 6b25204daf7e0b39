"""Limits declared with the settings: ``setting(..., limit=...)`` says which values a
number may take, ``config.check_limits`` refuses any other in one line, and the docs show it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from serl_cli import config as cfgmod
from serl_cli.config import Limit, above, at_least, setting, within
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.online.config import OnlineConfig
from serl_cli.stages.evaluate import EvalConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.train_config import TrainConfig


@pytest.mark.parametrize(
    "limit, good, bad",
    [
        (at_least(1), [1, 1.5, 10**9], [0, 0.99, -1, math.nan, math.inf, True, "2"]),
        (at_least(0, whole=True), [0, 3], [-1, 0.5, 2.0, True]),
        (above(0), [1e-12, 2], [0, -1, math.nan]),
        (within(0, 1), [0, 0.5, 1], [-0.01, 1.01, math.nan]),
        (within(0, 1, open_low=True), [1e-9, 1], [0]),
        (within(0, 1, open_high=True), [0, 0.999], [1]),
    ],
)
def test_a_limit_takes_the_values_it_says(limit: Limit, good, bad):
    assert all(limit.ok(x) for x in good)
    assert not any(limit.ok(x) for x in bad)


def test_limits_say_their_range():
    assert at_least(1).says == "at least 1"
    assert within(0, 1, open_high=True).says == "in [0, 1)" and within(0, 1, open_low=True).says == "in (0, 1]"
    assert above(0).says == "above 0" and at_least(-1, "-1 (all), 0 or more").says == "-1 (all), 0 or more"


@dataclass
class Inner:
    rate: float = setting(0.5, "a rate", limit=within(0, 1))


@dataclass
class Outer:
    count: int = setting(1, "a count", limit=at_least(1, whole=True))
    cap: int | None = setting(None, "a cap; null: none", limit=at_least(1, whole=True))
    inner: Inner = setting(factory=Inner, doc="a section")
    free: float = field(default=-5.0)  # no limit: anything goes


def test_check_limits_walks_the_sections_and_names_the_setting():
    cfgmod.check_limits(Outer())  # the defaults, and an unset optional
    with pytest.raises(SerlError, match=r"^train\.count must be at least 1, got 0$"):
        cfgmod.check_limits(Outer(count=0), "train.")
    with pytest.raises(SerlError, match=r"^inner\.rate must be in \[0, 1\], got nan$"):
        cfgmod.check_limits(Outer(inner=Inner(rate=math.nan)))
    with pytest.raises(SerlError, match=r"^cap must be at least 1, got 0$"):
        cfgmod.check_limits(Outer(cap=0))


@pytest.mark.parametrize("cls", [TrainConfig, OnlineConfig, RolloutConfig, AnnotateConfig, EvalConfig])
def test_every_default_is_within_its_declared_limit(cls):
    cfgmod.check_limits(cls())


def test_the_online_loop_refuses_a_value_outside_a_limit_in_any_section():
    from serl_cli.online.config import check_online_config

    cfg = OnlineConfig()
    cfg.rollout.sampling.top_p = 0.0
    with pytest.raises(SerlError, match=r"rollout\.sampling\.top_p must be in \(0, 1\], got 0\.0"):
        check_online_config(cfg)


def test_the_docs_show_each_limit():
    assert cfgmod.doc_of(OnlineConfig, "keep_last").endswith("(must be 0 (keep all) or positive)")
    assert cfgmod.doc_of(OnlineConfig, "train.optim.lr").endswith("(must be a positive number (or 0))")
    assert (
        cfgmod.doc_of(OnlineConfig, "seed")
        == "the run's seed: iteration k's rollouts use seed * 1000 + k, the update seed"
    )
