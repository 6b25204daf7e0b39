"""Sokoban as the testbed where small models learn: the noisy expert, the compact prompt,
hindsight SFT and the demo end to end. Structure only: how much the models learn is
measured in docs/RESULTS.md, not asserted here. About 40 s on one thread."""

from __future__ import annotations

import pytest

from envs.sokoban.env import SokobanWorld
from envs.sokoban.rooms import parse_room
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.cli.demo import _env_in
from serl_cli.demo.config import DemoConfig, demo_defaults, quick
from serl_cli.demo.pipeline import run_demo
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.sft.hindsight import hindsight_examples
from serl_cli.method.teacher import block_ids, teacher_prompt_ids
from serl_cli.models.loading import load_model
from serl_cli.models.tiny import init_model
from serl_cli.rollout.default_model import tokenizer_corpus
from serl_cli.rollout.policies import ExpertPolicy
from serl_cli.rollout.prompts import PromptConfig, build_messages, reply_ids
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig, run_rollout
from serl_cli.stages.train import check_hindsight_sft, train_on_run
from serl_cli.training.train_config import TrainConfig

COMPACT = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)


@pytest.fixture(scope="module")
def world():
    return SokobanWorld()


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory, world):
    return init_model("micro", tmp_path_factory.mktemp("models") / "micro", tokenizer_corpus(world, episodes=50))


def play(world, policy, tasks=40):
    return run_episodes(world, "train", [EpisodeSpec(task_id=t) for t in range(tasks)], policy)


# -- the noisy expert -----------------------------------------------------------------------
def test_noisy_expert_marks_its_detours_and_never_deadlocks(world):
    records = play(world, ExpertPolicy(noise=0.5, seed=0))
    turns = [t for r in records for t in r.turns]
    assert 0.3 < sum(t.off_expert for t in turns) / len(turns) < 0.6
    assert not any(t.info["deadlock"] for t in turns)  # every detour kept the room solvable
    for r in records:  # replayed: a detour is never an optimal move, a demonstration always is
        ep = world.new_episode("train")
        ep.reset(r.task_id)
        for t in r.turns:
            assert (t.action in ep.optimal_actions()) is (not t.off_expert)
            ep.step(t.action)
    optimal_but_not_first = [t for t in turns if not t.off_expert and t.action != t.expert_action]
    assert optimal_but_not_first  # spread over every optimal move, not the solver's first


def test_blunders_deadlock_rooms_and_what_follows_is_off_expert(world):
    records = play(world, ExpertPolicy(blunders=1.0, seed=0))
    lost = [r for r in records if any(t.info["deadlock"] for t in r.turns)]
    assert lost and not any(r.success for r in lost)
    for r in lost:
        k = next(i for i, t in enumerate(r.turns) if t.info["deadlock"])
        assert all(t.off_expert for t in r.turns[k:])  # the blunder, then moves with no expert action
        assert all(t.expert_action is None for t in r.turns[k + 1 :])


def test_plain_expert_records_no_off_expert_key(world):
    records = play(world, ExpertPolicy(), tasks=10)
    assert not any("off_expert" in t.to_dict() for r in records for t in r.turns)


def test_noisy_expert_draws_are_seeded_per_call(world):
    first = play(world, ExpertPolicy(noise=0.3, seed=1), tasks=10)
    assert first == play(world, ExpertPolicy(noise=0.3, seed=1), tasks=10)
    assert first != play(world, ExpertPolicy(noise=0.3, seed=2), tasks=10)


def test_solvable_actions_leave_out_the_deadlocking_push(world):
    ep = world.new_episode("train")
    ep.play(
        parse_room("""# # # # # # #
        # _ _ _ _ _ #
        # _ _ B _ _ #
        # _ _ P _ _ #
        # _ _ _ _ G #
        # # # # # # #""")
    )
    assert sorted(ep.solvable_actions()) == ["down", "left", "right"]  # up pushes the box against a goalless wall


# -- the compact prompt ---------------------------------------------------------------------
def test_compact_prompt_is_the_user_message_alone():
    full = build_messages("RULES", "Push every box onto a goal.", [], "GRID", ["up", "down"], PromptConfig())
    compact = build_messages("RULES", "Push every box onto a goal.", [], "GRID", ["up", "down"], COMPACT)
    assert [m["role"] for m in full] == ["system", "user"] and "Admissible actions: up, down" in full[1]["content"]
    assert compact == [
        {"role": "user", "content": "Task: Push every box onto a goal.\nTurn 1. Current observation: GRID"}
    ]


# -- hindsight SFT --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory, micro_dir):
    out = tmp_path_factory.mktemp("runs") / "noisy"
    run_rollout(
        RolloutConfig(
            env=EnvConfig(name="sokoban", split="train"),
            model=str(micro_dir),
            policy="expert",
            tasks=30,
            group_size=1,
            expert_noise=0.3,
            expert_blunders=0.2,
            prompt=COMPACT,
            threads=1,
            out=str(out),
        )
    )
    return out


@pytest.mark.parametrize("sources", ["error,diff", "error"])
def test_hindsight_examples_are_teacher_prompts_and_student_prompts_with_the_expert_reply(
    noisy_run, micro_dir, sources
):
    _, tokenizer = load_model(str(micro_dir))
    episodes = read_rollouts(noisy_run)
    examples = {
        (e.task_id, e.rollout_index): e.turns
        for e in hindsight_examples(episodes, tokenizer, sources, bare_replies=True)
    }
    expected = 0
    for ep in episodes:
        group = [ep]
        got = iter(examples.get((ep.task_id, ep.rollout_index), []))
        for t, turn in enumerate(ep.turns):
            block, _, _ = fb.hindsight_step(fb.TurnContext(episode=ep, turn=t, group=group), sources)
            if not (turn.off_expert and turn.expert_action and block):
                continue
            expected += 2
            with_block, without = next(got), next(got)
            assert with_block.prompt_ids == teacher_prompt_ids(
                turn.prompt_ids, block_ids(tokenizer, block), tokenizer.eos_token_id
            )
            assert without.prompt_ids == turn.prompt_ids  # the same example, deconfounded
            target = reply_ids(tokenizer, turn.expert_action, bare=True)
            assert with_block.action_ids == without.action_ids == target != turn.action_ids
            assert not with_block.off_expert and with_block.hindsight == block and without.hindsight is None
        assert next(got, None) is None
    assert expected == sum(len(v) for v in examples.values()) > 0


def test_hindsight_sft_adds_its_examples_to_the_update(noisy_run, micro_dir, tmp_path):
    cfg = TrainConfig(algo="sft", hindsight_sft="error", threads=1, checkpoint=str(tmp_path / "ckpt"))
    m = train_on_run(str(noisy_run), cfg)
    plain = sum(1 for e in read_rollouts(noisy_run) for t in e.turns if not t.off_expert)
    assert m["hindsight_examples"] > 0 and m["turns"] == plain + m["hindsight_examples"]


@pytest.mark.parametrize(
    "cfg, match",
    [
        (TrainConfig(algo="grpo", hindsight_sft="error"), "goes with --algo sft"),
        (TrainConfig(algo="sft", hindsight_sft="eror"), "unknown feedback source"),
    ],
)
def test_hindsight_sft_settings_are_checked(cfg, match):
    with pytest.raises(SerlError, match=match):
        check_hindsight_sft(cfg)


# -- the demo -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("parallel_arms", [True, False], ids=["side-by-side", "one-after-the-other"])
def test_quick_demo_runs_end_to_end_on_sokoban(micro_dir, tmp_path, parallel_arms):
    cfg = quick(DemoConfig(model=str(micro_dir), threads=1, out=str(tmp_path / "demo"), parallel_arms=parallel_arms))
    summary = run_demo(cfg, log=lambda *_: None)
    # the evaluations ran in the arms' processes, in whatever order they ended: the table keeps its own
    assert list(summary["results"]) == ["expert", "warm start", "warm start + grpo", "warm start + serl"]
    assert list(summary["kept_iterations"]) == ["grpo", "serl"] and set(summary["gains"]) == {"grpo", "serl"}
    for r in summary["results"].values():
        assert r["episodes"] == cfg.eval_episodes and 0 <= r["success_rate"] <= 1 and len(r["success_ci95"]) == 2
    assert summary["results"]["expert"]["success_rate"] == 1.0
    signal = summary["teacher_signal"]
    assert signal is None or {"turns", "right_direction", "expert_prob_gain"} <= set(signal)
    assert (tmp_path / "demo" / "demo.json").is_file() and (tmp_path / "demo" / "serl" / "checkpoint").is_dir()
    # the warm start's SFT step, as the band chose it, is reported in demo.json
    chosen = io.read_json(tmp_path / "demo" / "expert" / "warm_start.json")
    assert summary["warm_start"]["step"] == chosen["step"] and summary["warm_start"]["outcome"] == chosen["outcome"]
    assert io.read_json(tmp_path / "demo" / "demo.json")["warm_start"] == summary["warm_start"]


def test_other_environments_keep_the_webshop_demo():
    web = demo_defaults("webshop")
    assert (web.env.name, web.env.max_turns, web.preset, web.expert_tasks, web.algos) == (
        "webshop",
        10,
        "tiny",
        60,
        ["grpo"],
    )
    assert (web.sft.epochs, web.sft.mini_batches, web.sft.optim.lr, web.sft.hindsight_sft) == (4, 32, 2e-3, None)
    assert (web.online.iterations, web.online.rollout.tasks, web.online.rollout.group_size) == (2, 4, 4)
    assert (web.eval_episodes, web.eval_temperature, web.prompt) == (30, 0.0, PromptConfig(history_turns=0))
    assert demo_defaults("sokoban") == DemoConfig()


def test_demo_reads_the_environment_from_config_and_set(tmp_path):
    (tmp_path / "c.yaml").write_text("env: {name: webshop}\n")
    assert _env_in([str(tmp_path / "c.yaml")], None) == "webshop"
    assert _env_in([str(tmp_path / "c.yaml")], ["env.name=sokoban"]) == "sokoban"
    assert _env_in(None, ["seed=3"]) is None


def test_the_quick_demo_has_a_folder_of_its_own():
    """`serl demo --quick` then `serl demo`, as the README runs them: the second must not find the
    first's run in its folder; an --out given stays the user's."""
    assert quick(DemoConfig()).out == "runs/demo-quick" != DemoConfig().out
    assert quick(DemoConfig(out="elsewhere")).out == "elsewhere"
