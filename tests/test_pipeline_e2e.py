"""End to end on a tiny model, through the real CLI: model init -> expert rollout -> SFT ->
one GRPO iteration -> eval. Then the online loop's determinism and resume, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import serl, synthetic_env

from serl_cli.online.config import OnlineConfig
from serl_cli.online.loop import run_online
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

SYNTH = ["--set", "env.settings.catalog=synthetic"]


@pytest.mark.slow
def test_cli_pipeline_end_to_end(tmp_path):
    model, expert, grpo, ev = (tmp_path / n for n in ("model", "expert", "grpo", "eval"))
    p = serl("model", "init", "--preset", "tiny", "--out", str(model), *SYNTH)
    assert p.returncode == 0, p.stderr
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()

    p = serl(
        "rollout",
        "--policy",
        "expert",
        "--model",
        str(model),
        "--tasks",
        "4",
        "--group-size",
        "1",
        "--max-turns",
        "8",
        "--out",
        str(expert),
        *SYNTH,
    )
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in (expert / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["success"] for r in records)

    p = serl("train", str(expert), "--algo", "sft", "--set", "train.optim.lr=1e-3", "--set", "train.epochs=2")
    assert p.returncode == 0, p.stderr
    metrics = [json.loads(line) for line in (expert / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["algo"] == "sft" and metrics[-1]["optimizer_steps"] == 2
    assert (expert / "checkpoint" / "model.safetensors").is_file()
    # the checkpoint remembers the prompt settings of its training data, and eval follows them
    assert json.loads((expert / "checkpoint" / "serl_prompt.json").read_text())["history_turns"] == 2
    assert json.loads((expert / "manifest.json").read_text())["stages"]["train:sft"]["status"] == "done"

    p = serl(
        "train",
        "--algo",
        "grpo",
        "--model",
        str(expert / "checkpoint"),
        "--iterations",
        "1",
        "--tasks",
        "2",
        "--group-size",
        "2",
        "--max-turns",
        "3",
        "--out",
        str(grpo),
        *SYNTH,
        "--set",
        "rollout.sampling.max_new_tokens=16",
    )
    assert p.returncode == 0, p.stderr
    assert (grpo / "checkpoint" / "config.json").is_file()
    assert (grpo / "iter_0000" / "rollouts.jsonl").is_file()
    m = json.loads((grpo / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("mean_reward", "success_rate", "loss", "env_steps", "iteration"):
        assert key in m

    p = serl(
        "eval",
        "--model",
        str(grpo / "checkpoint"),
        "--episodes",
        "3",
        "--max-turns",
        "3",
        "--out",
        str(ev),
        *SYNTH,
        "--set",
        "max_new_tokens=16",
    )
    assert p.returncode == 0, p.stderr
    summary = json.loads((ev / "eval.json").read_text())
    assert summary["policy"] == "model" and summary["episodes"] == 3
    assert "history_turns: 2" in (ev / "eval_config.yaml").read_text()
    assert len((ev / "episodes.jsonl").read_text().splitlines()) == 3


def _online(model_dir, out, iterations) -> OnlineConfig:
    return OnlineConfig(
        env=synthetic_env(max_turns=3),
        model=str(model_dir),
        iterations=iterations,
        seed=5,
        out=str(out),
        rollout=RolloutConfig(tasks=2, group_size=3, sampling=SamplingConfig(1.0, 1.0, 12), threads=1),
        train=TrainConfig(algo="grpo", optim=OptimConfig(lr=1e-3), threads=1),
    )


def _files(run: Path, name: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted(run.glob(f"iter_*/{name}"))]


def test_online_loop_is_deterministic(tiny_model_dir, tmp_path):
    a = run_online(_online(tiny_model_dir, tmp_path / "a", 2))
    b = run_online(_online(tiny_model_dir, tmp_path / "b", 2))
    assert a == b
    assert _files(tmp_path / "a", "rollouts.jsonl") == _files(tmp_path / "b", "rollouts.jsonl")
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()


def test_online_resume_equals_uninterrupted(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    run_online(_online(tiny_model_dir, full, 2))
    part = tmp_path / "part"
    run_online(_online(tiny_model_dir, part, 1))
    run_online(_online(tiny_model_dir, part, 2), resume=True)
    assert (full / "metrics.jsonl").read_bytes() == (part / "metrics.jsonl").read_bytes()
    assert _files(full, "rollouts.jsonl") == _files(part, "rollouts.jsonl")
    wa, wb = load_file(full / "checkpoint" / "model.safetensors"), load_file(part / "checkpoint" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_online_refuses_existing_run(tiny_model_dir, tmp_path):
    from serl_cli.errors import SerlError

    run_online(_online(tiny_model_dir, tmp_path / "r", 1))
    with pytest.raises(SerlError, match="--resume"):
        run_online(_online(tiny_model_dir, tmp_path / "r", 1))


def test_eval_prompts_a_checkpoint_as_it_was_trained(tiny_model_dir, tmp_path):
    from serl_cli.rollout.prompts import PROMPT_FILE, PromptConfig, prompt_file_text
    from serl_cli.stages.evaluate import EvalConfig, make_policy

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / PROMPT_FILE).write_text(prompt_file_text(PromptConfig(history_turns=0, history_obs_chars=100)))
    cfg = EvalConfig(policy="model", model=str(ckpt), threads=1)
    policy = make_policy(cfg)
    assert policy.prompt == PromptConfig(history_turns=0, history_obs_chars=100) and cfg.history_turns == 0
    explicit = make_policy(EvalConfig(policy="model", model=str(ckpt), history_turns=3, threads=1))
    assert explicit.prompt.history_turns == 3 and explicit.prompt.history_obs_chars == 100
    plain = make_policy(EvalConfig(policy="model", model=str(tiny_model_dir), threads=1))
    assert plain.prompt == PromptConfig()  # a model serl did not train: the defaults


def test_filtered_behaviour_cloning_keeps_only_successful_episodes(tmp_path):
    from serl_cli.artifacts.records import make_episode
    from serl_cli.errors import SerlError
    from serl_cli.training.learner import training_episodes

    eps = [
        make_episode(success=True, task_id=0),
        make_episode(success=False, task_id=1),
        make_episode(success=True, task_id=2),
    ]
    assert training_episodes(eps, TrainConfig(algo="sft", sft_successful_only=True), tmp_path) == [eps[0], eps[2]]
    assert training_episodes(eps, TrainConfig(algo="sft"), tmp_path) == eps  # off by default
    assert training_episodes(eps, TrainConfig(algo="grpo", sft_successful_only=True), tmp_path) == eps  # sft only
    with pytest.raises(SerlError, match="no successful episode"):
        training_episodes([eps[1]], TrainConfig(algo="sft", sft_successful_only=True), tmp_path)
