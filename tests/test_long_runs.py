"""Long runs of the online loop: periodic evaluation, checkpoint retention (``save_every``,
``keep_last``), and preemption -- SIGTERM / SIGUSR1 stops the loop at a safe point with a
checkpoint and exit code 75, and ``--resume`` continues to the same artifacts as an
uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from support import synthetic_env

from serl_cli.ablate.runners import SELF_CMD
from serl_cli.errors import SerlError
from serl_cli.online.checkpoints import checkpoint_due, prune_checkpoints, resume_point
from serl_cli.online.config import OnlineConfig, OnlineEvalConfig
from serl_cli.online.loop import run_online
from serl_cli.online.stop import PREEMPTED_EXIT, Preempted
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


def online_cfg(model, out) -> OnlineConfig:
    """3 iterations of SFT on the policy's own samples (always a gradient), a checkpoint every
    2 (iterations 1 and 2), the newest kept, an evaluation every 2 at T 0.7."""
    return OnlineConfig(
        env=synthetic_env(max_turns=2),
        model=str(model),
        iterations=3,
        seed=2,
        out=str(out),
        rollout=RolloutConfig(tasks=1, group_size=2, sampling=SamplingConfig(1.0, 1.0, 6), threads=1),
        train=TrainConfig(algo="sft", optim=OptimConfig(lr=1e-3), threads=1),
        eval=OnlineEvalConfig(episodes=1, every=2, temperature=0.7),
        save_every=2,
        keep_last=1,
    )


def same_weights(a, b, tol: float = 0.0) -> bool:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(((wa[k] - wb[k]).abs() <= tol).all() for k in wa)


def close(a, b, tol: float) -> bool:
    """Equal records, floats to ``tol`` (relative above 1 in size, absolute below); everything
    else (tokens, actions, rewards' types) exactly."""
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return numbers and math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_run(out, ref, exact: bool = True) -> None:
    """The same run: metrics, every iteration's rollouts and the final weights. ``exact=False``
    for a run made in other processes than ``ref``: a CPU kernel's result can differ in the last
    bits between processes (its path depends on memory alignment), in a generation's log-probs
    and in the update alike. So the rollouts are compared token for token, and every float --
    log-probs, metrics (a grad norm once differed by one float32 ulp, 5.4532785 against
    5.4532790), weights -- to 1e-5. That is far below what the run changes: the 3 updates move
    the weights by 1.8e-3 on average, and the largest difference seen between processes was 8e-7."""
    files = ["metrics.jsonl", *(f"iter_{k:04d}/rollouts.jsonl" for k in range(3))]
    for name in files:
        a, b = (out / name).read_bytes(), (ref / name).read_bytes()
        if exact:
            assert a == b, name
        else:
            rows = [[json.loads(line) for line in x.decode().splitlines()] for x in (a, b)]
            assert close(*rows, tol=1e-5), name
    assert same_weights(out / "checkpoint", ref / "checkpoint", tol=0.0 if exact else 1e-5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("long") / "ref"
    run_online(online_cfg(tiny_model_dir, out))
    return out


def test_periodic_evaluation_and_checkpoint_retention(reference):
    metrics = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    # after iteration 2 of 3 (every 2), and after the last: a run ends with an evaluation
    assert [("eval_success_rate" in m) for m in metrics] == [False, True, True]
    assert {"eval_score", "eval_invalid_action_rate", "eval_mean_turns"} <= set(metrics[1])
    assert (reference / "iter_0001" / "eval.json").is_file() and not (reference / "iter_0000" / "eval.json").exists()
    # due: iterations 1 (every 2) and 2 (the last); kept: the newest one
    assert sorted(p.parent.name for p in reference.glob("iter_*/checkpoint")) == ["iter_0002"]
    assert (reference / "checkpoint" / "model.safetensors").is_file()


def test_resume_point_and_pruning_rules(tmp_path):
    cfg = OnlineConfig(iterations=10, save_every=3)
    assert [k for k in range(10) if checkpoint_due(cfg, k)] == [2, 5, 8, 9]
    for k in (2, 5, 6):  # 6: written off schedule (a stop)
        d = tmp_path / f"iter_{k:04d}" / "checkpoint"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "trainer_state.pt").write_bytes(b"")
    assert resume_point(tmp_path, cfg, 8) == 7  # iteration 7 finished without a checkpoint: redo it
    assert resume_point(tmp_path, cfg, 2) == 0  # nothing due yet: from the start
    with pytest.raises(SerlError, match="iteration 8 is marked done but .* is missing"):
        resume_point(tmp_path, cfg, 9)  # 8 was due
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.parent.name for p in tmp_path.glob("iter_*/checkpoint")) == ["iter_0005", "iter_0006"]
    prune_checkpoints(tmp_path, 0)  # 0: keep all
    assert len(list(tmp_path.glob("iter_*/checkpoint"))) == 2
    for bad, match in (({"save_every": 0}, "save_every"), ({"keep_last": -1}, "keep_last")):
        with pytest.raises(SerlError, match=match):
            run_online(dataclasses.replace(OnlineConfig(out=str(tmp_path / "x")), **bad))
    assert not (tmp_path / "x").exists()


def test_stop_during_the_rollouts_abandons_the_iteration(tiny_model_dir, reference, tmp_path):
    """A signal after iteration 0 lands in iteration 1's rollouts: iteration 1 is abandoned,
    iteration 0 -- not due a checkpoint -- gets one, and the resumed run is the reference."""
    out = tmp_path / "run"
    with pytest.raises(Preempted) as stop:
        run_online(online_cfg(tiny_model_dir, out), on_iteration=lambda m: os.kill(os.getpid(), signal.SIGUSR1))
    assert stop.value.finished == 1 and stop.value.exit_code == PREEMPTED_EXIT and "SIGUSR1" in str(stop.value)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"]["iter_0000"]["status"] == "done" and "iter_0001" not in manifest["stages"]
    assert (out / "iter_0000" / "checkpoint" / "trainer_state.pt").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the loop's handlers are gone
    run_online(online_cfg(tiny_model_dir, out), resume=True)
    assert_same_run(out, reference)


def test_stop_during_the_update_finishes_the_iteration(tiny_model_dir, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    update = Learner.update

    def signalled_update(self, *args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the update runs
        return update(self, *args, **kw)

    monkeypatch.setattr(Learner, "update", signalled_update)
    with pytest.raises(Preempted) as stop:
        run_online(online_cfg(tiny_model_dir, out))
    monkeypatch.setattr(Learner, "update", update)
    assert stop.value.finished == 1  # iteration 0 finished: its update, its checkpoint (off schedule)
    assert json.loads((out / "manifest.json").read_text())["stages"]["iter_0000"]["status"] == "done"
    assert (out / "iter_0000" / "checkpoint" / "model.safetensors").is_file()
    run_online(online_cfg(tiny_model_dir, out), resume=True)
    assert_same_run(out, reference)


def _iteration_done(manifest: Path, k: int) -> bool:
    try:
        stages = json.loads(manifest.read_text()).get("stages", {})
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return stages.get(f"iter_{k:04d}", {}).get("status") == "done"


def test_cli_exits_75_on_sigusr1_and_resume_continues(tiny_model_dir, reference, tmp_path):
    """``serl train`` in its own process, stopped by SIGUSR1 once iteration 0 is done.

    The signal must reach the loop while the loop still runs, wherever the scheduler puts this
    test's polling: the child is frozen (SIGSTOP) the moment iteration 0 is seen done, the test
    checks where it stands (iteration 1 not done, so iteration 2's rollouts are yet to come and
    will see the stop), and only then signals it and lets it go on (SIGCONT). Signalled at the
    moment a slow poll happened to run, as this test once was, the signal could find the loop
    finished -- exit 0, or death by SIGUSR1's default action once the loop's handlers were gone
    -- and a deadline that passed signalled it anyway, at an unknown point. Where inside the
    loop the stop lands does not matter: every point resumes to the uninterrupted run
    (test_stop_during_the_rollouts..., test_stop_during_the_update...)."""
    out = tmp_path / "run"
    cfg_file = tmp_path / "online.yaml"
    plain = dataclasses.asdict(online_cfg(tiny_model_dir, out))
    cfg_file.write_text(yaml.safe_dump(plain))
    env = {**os.environ, "SERL_THREADS": "1", "COLUMNS": "200"}
    cmd = [*SELF_CMD, "train", "--config", str(cfg_file), "-q"]  # SELF_CMD: this interpreter
    manifest = out / "manifest.json"
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a frozen reader never blocks the child
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
        deadline = time.monotonic() + 300
        while not _iteration_done(manifest, 0):
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                log.seek(0)
                pytest.fail(f"iteration 0 never finished (exit {p.poll()}): {log.read()[-2000:]}")
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGSTOP)
        assert not _iteration_done(manifest, 1), "the child ran through iteration 1 before it could be frozen"
        os.kill(p.pid, signal.SIGUSR1)  # pending until the child runs again
        os.kill(p.pid, signal.SIGCONT)
        p.wait(timeout=300)
        log.seek(0)
        err = log.read()
    assert p.returncode == PREEMPTED_EXIT, err[-2000:]
    assert "preempted:" in err and "--resume" in err
    q = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert q.returncode == 0, q.stderr[-2000:]
    assert_same_run(out, reference, exact=False)  # made by two other processes than the reference


def test_show_lists_an_online_runs_iterations(reference):
    """`serl show RUN` on an online run: what ran and its iteration folders (before: "run serl
    rollout --out RUN first"); the manifest names the catalog that ran."""
    from typer.testing import CliRunner

    from serl_cli.cli import show as _show_cmd  # noqa: F401  (registers `show`)
    from serl_cli.cli.root import app

    assert json.loads((reference / "manifest.json").read_text())["environment"]["catalog"] == "synthetic"
    res = CliRunner().invoke(app, ["show", str(reference), "--width", "300"])
    assert res.exit_code == 0, res.output
    assert f"online run {reference}: sft on webshop, 3 iterations (done)" in res.output
    for k in range(3):
        assert f"iter_{k:04d}" in res.output
    assert f"serl show {reference / 'iter_0002'}" in res.output
    res = CliRunner().invoke(app, ["show", str(reference), "--json"])
    rows = json.loads(res.output)
    metrics = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["folder"] for r in rows] == ["iter_0000", "iter_0001", "iter_0002"]
    assert [r["status"] for r in rows] == ["done"] * 3 and [r["checkpoint"] for r in rows] == [False, False, True]
    assert [r["success_rate"] for r in rows] == [m["success_rate"] for m in metrics]
    assert rows[1]["eval_success_rate"] == metrics[1]["eval_success_rate"] and rows[0]["eval_success_rate"] is None
    res = CliRunner().invoke(app, ["show", str(reference), "--episode", "0"])
    assert isinstance(res.exception, SerlError) and f"serl show {reference / 'iter_0002'} --episode 0" in str(
        res.exception
    )
    res = CliRunner().invoke(app, ["show", str(reference / "iter_0001"), "--width", "300"])  # one iteration: a run
    assert res.exit_code == 0 and "episodes" in res.output, res.output
