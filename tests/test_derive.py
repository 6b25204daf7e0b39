"""One place per concept: each algorithm's needs in its registry entry, applied by one function
(``algos.registry.apply_algorithm``) for the loop, the staged path and the ablation grid; each
stage's config derived from the run config in one place (``online.derive``). End to end: a staged
annotate + train makes the online loop's update, and ``serl eval --config RUN_FILE`` decodes
exactly as the loop's periodic evaluation."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from support import assert_one_line_error, half_successful, make_half_successful, rollout_config, serl

from serl_cli import config as cfgmod
from serl_cli.algos.registry import apply_algorithm, check_annotations
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_annotations
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.method.annotate_config import validate as validate_annotate
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import annotate_config, eval_config, train_config
from serl_cli.online.derive import rollout_config as derived_rollout
from serl_cli.stages.evaluate import EvalConfig
from serl_cli.training.train_config import TrainConfig


def test_the_registry_entry_is_what_an_algorithm_needs():
    _, a = apply_algorithm(TrainConfig(algo="rlsd"), AnnotateConfig(placement="feedback"))
    assert (a.placement, a.tokens, a.skip_zero_advantage) == ("all", "reply", True)  # every turn, every token
    t, a = apply_algorithm(TrainConfig(algo="sdpo"), AnnotateConfig())
    assert t.distill_coef == 1.0 and not a.skip_zero_advantage  # the term alone, on every failed rollout
    t, _ = apply_algorithm(TrainConfig(algo="sdpo", distill_coef=0.5))
    assert t.distill_coef == 0.5  # a default, not an override
    t, a = apply_algorithm(TrainConfig(algo="serl", distill_coef=0.1), AnnotateConfig(placement="gap"))
    assert (t.distill_coef, a.placement, a.skip_zero_advantage) == (0.1, "gap", False)  # any distillation
    given = (TrainConfig(algo="grpo"), AnnotateConfig(placement="random"))
    assert apply_algorithm(*given) == given
    # an update refuses annotations that do not meet its algorithm's needs
    check_annotations(TrainConfig(algo="rlsd"), {"placement": "all", "tokens": "reply"})
    with pytest.raises(SerlError, match=r'--algo rlsd needs annotations made with tokens="reply", these have "action"'):
        check_annotations(TrainConfig(algo="rlsd"), {"placement": "all", "tokens": "action"})
    with pytest.raises(SerlError, match="skip_zero_advantage=false"):
        check_annotations(TrainConfig(algo="serl", distill_coef=0.1), {"skip_zero_advantage": True})


def test_the_loop_and_the_grid_take_the_needs_from_the_registry():
    from serl_cli.ablate import grid as ab

    run = OnlineConfig(train=TrainConfig(algo="rlsd"), annotate=AnnotateConfig(placement="feedback"), seed=3)
    a = annotate_config(run, iteration=2, updates=7)
    assert (a.placement, a.tokens, a.seed, a.update_step) == ("all", "reply", 3002, 7)
    grid = ab.load_grid(None, flags={"algo": "grpo,rlsd,sdpo", "placement": "feedback"})
    by_algo = {arm["algo"]: arm for arm in ab.arms(grid)}
    assert by_algo["rlsd"]["placement"] == "all" and by_algo["sdpo"]["placement"] == "feedback"
    assert by_algo["grpo"]["placement"] is None
    sdpo = next(c for c in ab.cells(grid) if c["params"]["algo"] == "sdpo")
    assert sdpo["overrides"]["train"] == {"algo": "sdpo", "seed": 0, "distill_coef": 1.0}


def test_each_stage_config_is_derived_from_the_run():
    run = cfgmod.resolve(
        OnlineConfig,
        config_file=None,
        flags={},
        overrides=["seed=4", "model=m", "train.device=cpu", "train.threads=2", "eval.split=dev", "eval.episodes=0"],
    )
    r = derived_rollout(run, 3, "runs/x/iter_0003")
    assert (r.seed, r.model, r.out, r.env, r.device, r.threads) == (4003, "m", "runs/x/iter_0003", run.env, "cpu", 2)
    assert derived_rollout(run).seed == 4 and train_config(run).seed == 4
    e = eval_config(run, "ev")
    assert (e.env.split, e.episodes, e.seed, e.device, e.prompt) == ("dev", None, 4, "cpu", run.rollout.prompt)
    assert (e.temperature, e.max_new_tokens) == (run.eval.temperature, run.rollout.sampling.max_new_tokens)


@pytest.mark.slow
def test_serl_annotate_applies_the_algorithms_needs(stopping_model_dir, tmp_path):
    from serl_cli.stages.rollout import run_rollout

    run = tmp_path / "run"
    run_rollout(rollout_config(stopping_model_dir, run, tasks=1, group_size=2, max_new_tokens=6))
    make_half_successful(run)
    p = serl("annotate", str(run), "--algo", "rlsd", "--placement", "feedback", "--set", "sources=error", "-q")
    assert p.returncode == 0, p.stderr
    made = io.load_manifest(run)["stages"]["annotate"]["config"]
    assert (made["placement"], made["tokens"]) == ("all", "reply")  # rlsd's, over the flag, as the loop does
    p = serl("annotate", str(run), "--overwrite", "--set", "sources=error", "-q")  # for serl (the default)
    assert p.returncode == 0, p.stderr
    p = serl("train", str(run), "--algo", "rlsd", "--threads", "1", "--out", str(tmp_path / "ckpt"))
    assert_one_line_error(p, '--algo rlsd needs annotations made with tokens="reply"', "serl annotate RUN --algo rlsd")


# ------------------------------------------------------------------ the loop, and the same steps staged
@pytest.fixture(scope="module")
def loop_run(stopping_model_dir, tmp_path_factory) -> Path:
    """One iteration of the online loop, as `serl train --config` runs it: serl under the authors'
    advantage settings (cross-step groups, the invalid-action penalty: not the annotation's own
    default), and a periodic evaluation sampled at 0.4. Half of each group is made successful as the
    loop reads its rollouts (rewards are data here) so that advantages, and weights, are not all 0."""
    import serl_cli.online.sources as sources
    from serl_cli.online.loop import run_online
    from serl_cli.online.run_file import run_settings

    run = tmp_path_factory.mktemp("loop") / "run"
    cfg = cfgmod.resolve(
        OnlineConfig,
        config_file=None,
        flags={},
        overrides=[
            f"model={stopping_model_dir}",
            "env.settings.catalog=synthetic",
            "env.max_turns=2",
            "rollout.tasks=2",
            "rollout.group_size=2",
            "rollout.sampling.max_new_tokens=8",
            "train.algo=serl",
            "train.group_norm=cross_steps",
            "train.invalid_action_penalty=0.1",
            "train.optim.lr=0.001",
            "train.threads=1",
            "annotate.sources=error",
            "annotate.unparsed=whole",  # the random model's replies parse to no action: weight all of them
            "eval.episodes=2",
            "eval.temperature=0.4",
            f"out={run}",
        ],
    )
    gathered = sources.as_stored  # the loop's batch, as every process holds it and rank 0 writes it

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources, "as_stored", lambda records: half_successful(gathered(records)))
        run_online(cfg)
    (run / "online.yaml").write_text(yaml.safe_dump(run_settings(cfg), sort_keys=False))
    return run


@pytest.mark.slow
def test_staged_annotate_and_train_make_the_loops_update(loop_run, tmp_path):
    """`serl annotate RUN --config RUN_FILE` signs the weights by the run's train settings, as the
    loop does; `serl train RUN --config RUN_FILE` on them then makes the loop's update."""
    it, staged = loop_run / "iter_0000", tmp_path / "staged"
    staged.mkdir()
    shutil.copy(it / "rollouts.jsonl", staged)
    manifest = io.load_manifest(it)
    manifest["stages"] = {"rollout": manifest["stages"]["rollout"]}  # the rollouts alone, as `serl rollout` leaves them
    io.write_json(staged / "manifest.json", manifest)
    run_file = str(loop_run / "online.yaml")
    p = serl("annotate", str(staged), "--config", run_file, "-q")
    assert p.returncode == 0, p.stderr
    loop_ann, staged_ann = read_annotations(it), read_annotations(staged)
    assert any(a.weights for a in loop_ann) and any(a.advantage != 0 for a in loop_ann)
    for a, b in zip(loop_ann, staged_ann, strict=True):
        assert b.advantage == pytest.approx(a.advantage, abs=1e-6)
        assert (a.weights is None) == (b.weights is None)
        assert b.weights is None or b.weights == pytest.approx(a.weights, abs=1e-6)
    p = serl("train", str(staged), "--config", run_file, "--out", str(tmp_path / "ckpt"), "-q")
    assert p.returncode == 0, p.stderr
    loop_m = json.loads((loop_run / "metrics.jsonl").read_text().splitlines()[0])
    # a checkpoint outside the run: the update only read it, and its metrics are in the checkpoint's record
    staged_m = json.loads((tmp_path / "ckpt" / "serl_update.json").read_text())["metrics"]
    for key in ("loss", "pg_loss", "mean_abs_advantage", "weight_mean", "advantage_mass_moved", "turns_with_gradient"):
        assert staged_m[key] == pytest.approx(loop_m[key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_the_periodic_evaluation_decodes_as_serl_eval_on_the_run_file(loop_run, tmp_path):
    from serl_cli.cli.common import resolve

    run_file, ckpt, ev = loop_run / "online.yaml", str(loop_run / "checkpoint"), tmp_path / "ev"
    run = cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(run_file))
    resolved = resolve(
        EvalConfig, config_file=[str(run_file)], overrides=[], flags={"model": ckpt, "out": str(ev)}, command="eval"
    )
    periodic = eval_config(run, loop_run / "iter_0000")  # what the loop ran, on the policy in its memory
    assert resolved == dataclasses.replace(periodic, model=ckpt, out=str(ev))
    p = serl("eval", "--config", str(run_file), "--model", ckpt, "--out", str(ev), "-q")
    assert p.returncode == 0, p.stderr
    episodes = (ev / "episodes.jsonl").read_text()
    assert episodes == (loop_run / "iter_0000" / "episodes.jsonl").read_text() and episodes.count("\n") == 2


def test_the_teacher_signal_is_checked_every_n_iterations_and_on_the_last():
    run = OnlineConfig(iterations=25, train=TrainConfig(algo="serl"))
    run.annotate.teacher_signal_every = 10
    assert [k for k in range(25) if annotate_config(run, k).teacher_signal] == [0, 10, 20, 24]
    run.annotate.teacher_signal_every = 1
    assert all(annotate_config(run, k).teacher_signal for k in range(25))
    run.annotate.teacher_signal = False
    assert not any(annotate_config(run, k).teacher_signal for k in range(25))
    assert annotate_config(OnlineConfig(iterations=5, train=TrainConfig(algo="serl"))).teacher_signal  # no iteration


def test_teacher_signal_every_must_be_positive():
    with pytest.raises(SerlError, match="teacher_signal_every must be a positive number of iterations, got 0"):
        validate_annotate(AnnotateConfig(teacher_signal_every=0))
