"""The online loop drops the SERL teacher once lambda is 0 for good (``annotation.teacher_wanted``):
the updates are bit for bit those of a run that kept it, checkpoints after the drop hold no teacher
state, and a run resumed before, at or after the drop ends as the uninterrupted one."""

from __future__ import annotations

import shutil

import pytest
from support import synthetic_env

from serl_cli.artifacts import io
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.method.annotation import teacher_wanted
from serl_cli.online import loop as online
from serl_cli.online.config import OnlineConfig, OnlineEvalConfig
from serl_cli.online.loop import run_online
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

ITERATIONS = 4
DECAY = 2  # lambda 0.5, 0.25, then 0 from update 2: the teacher goes before iteration 2


def cfg(model, out) -> OnlineConfig:
    return OnlineConfig(
        env=synthetic_env(max_turns=2),
        model=str(model),
        iterations=ITERATIONS,
        seed=3,
        out=str(out),
        rollout=RolloutConfig(tasks=1, group_size=2, sampling=SamplingConfig(1.0, 1.0, 6), threads=1),
        train=TrainConfig(algo="serl", optim=OptimConfig(lr=1e-3), threads=1),
        annotate=AnnotateConfig(sources="error", mixing_lambda=0.5, lambda_decay_steps=DECAY, teacher_sync_interval=1),
        eval=OnlineEvalConfig(episodes=0),
        save_every=1,
        keep_last=0,
    )


def test_teacher_wanted_until_lambda_is_zero_for_good():
    wanted = [teacher_wanted(AnnotateConfig(mixing_lambda=0.5, lambda_decay_steps=2, update_step=u)) for u in range(5)]
    assert wanted == [True, True, False, False, False]
    assert teacher_wanted(AnnotateConfig(mixing_lambda=0.0, lambda_decay_steps=2, skip_zero_advantage=False))
    assert not teacher_wanted(AnnotateConfig(mixing_lambda=0.0, lambda_decay_steps=0))
    assert teacher_wanted(AnnotateConfig(mixing_lambda=0.5, lambda_decay_steps=0, update_step=10**6))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The run as it is, and the run with the teacher kept to the end (serl before the drop)."""
    base = tmp_path_factory.mktemp("drop")
    run_online(cfg(tiny_model_dir, base / "dropped"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(online.Loop, "drop_teacher", lambda self: None)
        run_online(cfg(tiny_model_dir, base / "kept"))
    return base / "dropped", base / "kept"


def same_run(a, b) -> None:
    for name in ["metrics.jsonl", *(f"iter_{k:04d}/rollouts.jsonl" for k in range(ITERATIONS))]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for k in range(ITERATIONS):
        assert (a / f"iter_{k:04d}/annotations.jsonl").read_bytes() == (
            b / f"iter_{k:04d}/annotations.jsonl"
        ).read_bytes()
    assert (a / "checkpoint/model.safetensors").read_bytes() == (b / "checkpoint/model.safetensors").read_bytes()


def test_the_updates_are_those_of_a_run_that_kept_the_teacher(runs):
    dropped, kept = runs
    same_run(dropped, kept)
    lambdas = [
        io.read_json(dropped / f"iter_{k:04d}/manifest.json")["stages"]["annotate"]["stats"]["lambda"]
        for k in range(ITERATIONS)
    ]
    assert lambdas == [0.5, 0.25, 0.0, 0.0]


def test_checkpoints_after_the_drop_hold_no_teacher(runs):
    dropped, kept = runs
    has = [(dropped / f"iter_{k:04d}/checkpoint/teacher_state.pt").is_file() for k in range(ITERATIONS)]
    assert has == [True, True, False, False]
    assert all((kept / f"iter_{k:04d}/checkpoint/teacher_state.pt").is_file() for k in range(ITERATIONS))
    timing = [r["update"]["annotate"] for r in io.iter_jsonl(dropped / "timings.jsonl")]
    assert all(t["annotate_s"] >= t["teacher_forward_s"] >= 0 for t in timing)
    assert [t["teacher_items"] for t in timing][DECAY:] == [0, 0]


@pytest.mark.parametrize("start", [1, 2, 3])  # before the drop, at it (a checkpoint with teacher state), after it
def test_a_run_resumed_across_the_drop_ends_as_the_uninterrupted_one(runs, tiny_model_dir, tmp_path, start):
    dropped, _ = runs
    out = tmp_path / "resumed"
    shutil.copytree(dropped, out)
    manifest = io.load_manifest(out)
    for k in range(start, ITERATIONS):  # as if the run had stopped after iteration start - 1
        manifest["stages"].pop(f"iter_{k:04d}")
        shutil.rmtree(out / f"iter_{k:04d}")
    manifest["stages"].pop("online", None)
    io.write_json(out / "manifest.json", manifest)
    shutil.rmtree(out / "checkpoint")
    run_online(cfg(tiny_model_dir, out), resume=True)
    same_run(out, dropped)
