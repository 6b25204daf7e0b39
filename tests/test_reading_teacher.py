"""A teacher that reads (study v4's positive control, docs/studies/sokoban_v4.md): aligned ref/expert
blocks, reading SFT, the perfect teacher's
weights, the selection check among scorable turns, the teacher-signal gate and the update
diagnostics. Hand-made turns where the figures are worked by hand; Sokoban rollouts of the
noisy expert, recorded with the micro model's tokenizer, elsewhere."""

from __future__ import annotations

import math
import re

import pytest
import torch

from envs.sokoban.env import SokobanWorld
from serl_cli.artifacts.records import make_annotation, make_episode, make_turn
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.diagnostics import teacher_gate as gate
from serl_cli.method.diagnostics.selection_report import selection_report
from serl_cli.method.diagnostics.update import update_figures, weight_figures
from serl_cli.method.sft.reading import episode_at, parse_reading, reading_examples, state_moves
from serl_cli.method.teacher import teacher_prompt
from serl_cli.models.loading import load_model
from serl_cli.models.tiny import init_model
from serl_cli.rollout.default_model import tokenizer_corpus
from serl_cli.rollout.engines import TokenizedExpertPolicy
from serl_cli.rollout.policies import ExpertPolicy
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.stages.train import check_hindsight_sft
from serl_cli.training.train_config import TrainConfig

SOKOBAN = {"name": "sokoban", "split": "train"}  # its action format finds the bare moves' tokens
COMPACT = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)
EXPERT_TITLE = "The expert's action from this state (privileged oracle information):"
REF_TITLE = "What a successful rollout did from this state:"


# -- aligned blocks, on hand-made turns --------------------------------------------------------


def _turn(action, key, expert=None, text=None):
    return make_turn(action=action, action_text=text or action, state_key=key, expert_action=expert, feedback={})


EPISODE = make_episode(
    [_turn("up", "s0", "left"), _turn("left", "s1", "down"), _turn("down", "s2")], success=False, rollout_index=0
)
REFERENCE = make_episode(  # visits s0 once, s1 twice (its last visit moved right), never s2
    [
        _turn("left", "s0", text="<think>the wall</think><action>left</action>"),
        _turn("up", "s3"),
        _turn("down", "s1"),
        _turn("right", "s1"),
    ],
    success=True,
    rollout_index=1,
)


def _block(turn, sources, trajectory="aligned"):
    ctx = fb.TurnContext(episode=EPISODE, turn=turn, group=[EPISODE, REFERENCE], trajectory=trajectory)
    return fb.hindsight_step(ctx, sources)


def test_aligned_ref_is_the_reference_reply_at_its_last_visit_of_this_state():
    assert _block(0, "ref") == (f"{REF_TITLE}\n<action>left</action>", ["ref"], ["ref"])  # reasoning removed
    assert _block(1, "ref") == (f"{REF_TITLE}\nright", ["ref"], ["ref"])  # its last visit
    # never visited: no block, and no fallback to the same turn index (the full rendering's "down")
    assert _block(2, "ref") == (None, [], [])
    full, _, fired = _block(2, "ref", trajectory="full")
    assert full.startswith("Successful trajectory in the same task, if any:\nStep 1") and fired == []


def test_aligned_expert_is_the_expert_action_from_this_state_labelled_privileged():
    assert _block(0, "expert") == (f"{EXPERT_TITLE}\n<action>left</action>", ["expert"], ["expert"])
    both = fb.TurnContext(episode=make_episode([_turn("Left ", "s0", "left")]), turn=0, trajectory="aligned")
    assert fb.hindsight_step(both, "expert")[2] == []  # the same action: does not fire
    assert _block(2, "expert") == (None, [], [])  # a lost task has no expert action


def test_unknown_trajectory_is_one_clear_error():
    with pytest.raises(SerlError, match="unknown trajectory 'partial'"):
        annotate_episodes([], AnnotateConfig(trajectory="partial"), None, None, env_cfg=None)


# -- Sokoban rollouts of the noisy expert ------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    return SokobanWorld()


@pytest.fixture(scope="module")
def micro(tmp_path_factory, world):
    path = init_model("micro", tmp_path_factory.mktemp("models") / "micro", tokenizer_corpus(world, episodes=50))
    model, tokenizer = load_model(str(path))
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def episodes(micro, world):
    """8 rooms x 4 noisy-expert rollouts with blunders: groups that mix wins and losses."""
    _, tokenizer = micro
    policy = TokenizedExpertPolicy(tokenizer, COMPACT, ExpertPolicy(noise=0.3, blunders=0.3, seed=0))
    specs = [EpisodeSpec(task_id=t, group_id=t, rollout_index=r) for t in range(8) for r in range(4)]
    out = run_episodes(world, "train", specs, policy)
    for ep in out:
        for t in ep.turns:
            t.behaviour_logprobs = [math.log(0.5)] * len(t.action_ids)
    assert {e.success for e in out} == {True, False}
    return out


def test_aligned_blocks_need_no_environment(episodes, micro):
    _, tokenizer = micro
    cfg = AnnotateConfig(sources="expert", trajectory="aligned", mixing_lambda=0.0)  # lambda 0: no teacher
    records, _ = annotate_episodes(episodes, cfg, None, tokenizer, env_cfg=None, bare_replies=True)
    for r in records:
        turn = episodes[r.episode].turns[r.turn]
        want = f"{EXPERT_TITLE}\n<action>{turn.expert_action}</action>" if turn.expert_action else None
        assert r.hindsight == want
        assert r.fired == (["expert"] if want and turn.action != turn.expert_action else [])


# -- reading SFT ---------------------------------------------------------------------------------

MOVE_IN_BLOCK = re.compile(r"(?:<action>|\n|player moved |pushed a box )(up|down|left|right)\b")


def test_reading_specs_parse_into_kinds():
    assert parse_reading("reading: expert; ref ; error,diff") == [
        ("named", [["expert"]]),
        ("named", [["ref"]]),
        ("taken", [["error"], ["diff"]]),
    ]
    with pytest.raises(SerlError, match="mixes kinds"):
        parse_reading("reading: expert,error")
    with pytest.raises(SerlError, match="names no block"):
        parse_reading("reading: ")
    check_hindsight_sft(TrainConfig(algo="sft", hindsight_sft="reading: expert; error,diff"))
    with pytest.raises(SerlError, match="unknown feedback source"):
        check_hindsight_sft(TrainConfig(algo="sft", hindsight_sft="reading: expertt"))


def test_reading_targets_depend_on_what_the_block_says(episodes, micro, world):
    _, tokenizer = micro
    kinds = parse_reading("reading: expert; ref; error,diff")
    made = reading_examples(episodes, tokenizer, kinds, world, "train", bare_replies=True, seed=3)
    by_episode = {(e.task_id, e.rollout_index): e.turns for e in made}
    seen = {"named": 0, "good": 0, "bad": 0, "deadlock": 0, "several optimal": 0}
    for ep in episodes:
        examples = iter(by_episode.get((ep.task_id, ep.rollout_index), []))
        actions = [t.action for t in ep.turns]
        for t, turn in enumerate(ep.turns):
            if not turn.expert_action:
                continue  # a lost task: no example
            x = next(examples)
            assert x.prompt_ids == teacher_prompt(tokenizer, turn.prompt_ids, x.hindsight)  # this state
            _, optimal, deadlocking = state_moves(episode_at(world, "train", ep.task_id, actions[:t]), "?")
            assert x.action in optimal  # every target leads to the solution
            seen["several optimal"] += len(optimal) > 1
            named = MOVE_IN_BLOCK.search(x.hindsight)
            if x.hindsight.startswith((EXPERT_TITLE, REF_TITLE)):
                seen["named"] += 1
                assert named.group(1) == x.action  # the block names the target
            elif "deadlock" in x.hindsight:
                seen["deadlock"] += 1
                assert named.group(1) in deadlocking and x.action != named.group(1)  # any move but that one
            elif named and named.group(1) in optimal:
                seen["good"] += 1
                assert x.action == named.group(1)  # a good turn: the move made
            else:
                seen["bad"] += 1  # a bump (no move named) or a detour: an optimal move, never the one made
                assert named is None or x.action != named.group(1)
        assert next(examples, None) is None
    assert min(seen.values()) > 0, seen  # blocks on good turns as well as bad, in states the state alone leaves open


# -- a perfect teacher's weights -------------------------------------------------------------------


def perfect_oracle_scorer(tokenizer):
    """The teacher that reads the aligned oracle perfectly: probability 1 on the move the block names."""

    def score(model, tok, items, temperature, micro_batch_tokens):
        out = []
        for it in items:
            named = re.search(r"<action>(\w+)</action>", tokenizer.decode(it.prompt_ids)).group(1)
            on = tokenizer.decode(it.action_ids, skip_special_tokens=True).strip() == named
            out.append([0.0 if on else math.log(1e-9)] * len(it.action_ids))
        return out

    return score


def test_a_perfect_teacher_blames_every_failed_rollouts_off_expert_tokens_more(episodes, micro):
    _, tokenizer = micro
    cfg = AnnotateConfig(sources="expert", trajectory="aligned", placement="all", teacher_signal=False)
    scorer = perfect_oracle_scorer(tokenizer)
    records, _ = annotate_episodes(episodes, cfg, None, tokenizer, env_cfg=SOKOBAN, scorer=scorer, bare_replies=True)
    checked = {"failed, off": 0, "failed, on": 0, "won, off": 0, "won, on": 0}
    for r in records:
        turn = episodes[r.episode].turns[r.turn]
        if not turn.expert_action or r.advantage == 0:
            continue
        weights = [w for w, m in zip(r.weights, r.action_mask, strict=True) if m]
        assert weights and all(w == 1.0 for w, m in zip(r.weights, r.action_mask, strict=True) if not m)
        on = turn.action == turn.expert_action
        blame = [abs(w * r.advantage) for w in weights]  # |w A| against GRPO's |A|
        failed = r.advantage < 0
        more = failed != on  # failed: more blame off the expert; won: more credit on it
        assert all((b > abs(r.advantage)) if more else (b < abs(r.advantage)) for b in blame)
        checked[f"{'failed' if failed else 'won'}, {'on' if on else 'off'}"] += 1
    assert min(checked.values()) > 0, checked


# -- the selection check among scorable turns ---------------------------------------------------


def test_selection_bias_is_also_tested_among_scorable_turns_alone():
    def rec(episode, selected, advantage, sources=("diff",)):
        return make_annotation(episode=episode, selected=selected, sources=list(sources), advantage=advantage)

    episodes = [make_episode(reward=float(k < 2), success=k < 2) for k in range(4)]
    # every selected turn is scorable; the unselected include unscorable ones of failed rollouts
    records = [rec(0, True, 1.0), rec(1, False, 1.0), rec(2, True, -1.0), rec(3, False, -1.0)]
    records += [rec(3, False, 0.0)] * 6 + [rec(2, False, -1.0, sources=())] * 4
    r = selection_report(records, episodes)
    assert r["scorable"]["turns"] == 4 and r["scorable"]["selected_turns"] == 2
    assert r["scorable"]["tests"]["fisher"]["table"] == [[1, 1], [1, 1]]  # balanced once the unscorable are out
    assert r["tests"]["fisher"]["table"] == [[1, 1], [1, 11]]
    assert r["scorable"]["tests"]["verdict"].startswith("no evidence")


# -- the gate and the update diagnostics ---------------------------------------------------------


def test_gate_verdict_by_hand():
    met = gate.gate_verdict({"held_out_states": 200, "right_direction": 0.9, "expert_prob_gain": 0.3})
    assert met["met"] and met["thresholds"] == {"right_direction": 0.9, "expert_prob_gain": 0.3, "held_out_states": 200}
    missed = gate.gate_verdict({"held_out_states": 199, "right_direction": 0.95, "expert_prob_gain": 0.29})
    assert missed["checks"] == {"held_out_states": False, "right_direction": True, "expert_prob_gain": False}
    rows = [
        {"on_expert": True, "right": True, "p_with": 0.9, "p_without": 0.5},
        {"on_expert": False, "right": False, "p_with": 0.5, "p_without": 0.4},
    ]
    s = gate.with_intervals(rows, ["a", "a"], 5)
    assert (s["held_out_turns"], s["held_out_states"], s["scored_turns"]) == (2, 1, 5)
    assert s["right_direction"] == 0.5 and s["expert_prob_gain"] == pytest.approx(0.25)


def test_gate_figures_end_to_end_on_a_random_micro_model(episodes, micro, world):
    model, tokenizer = micro
    episodes = episodes[:12]  # three rooms
    common = {"env_cfg": SOKOBAN, "seen": set(), "bare_replies": True, "action_format": world.action_format}
    s = gate.signal_of(episodes, gate.block_config(gate.BLOCKS["expert (aligned)"]), model, tokenizer, **common)
    with_expert = [t for e in episodes for t in e.turns if t.expert_action]
    assert s["held_out_turns"] == s["turns"] == len(with_expert)  # every turn with an expert action is scored
    assert s["held_out_states"] == len({t.state_key for t in with_expert})
    seen = {t.state_key for t in with_expert[:5]}
    cfg = gate.block_config(gate.BLOCKS["expert (aligned)"])
    held = gate.signal_of(episodes, cfg, model, tokenizer, **common | {"seen": seen})
    assert held["held_out_turns"] == sum(t.state_key not in seen for t in with_expert)
    copy = gate.blind_copy(
        episodes, model, tokenizer, world, "train", seen=set(), bare_replies=True, action_format=world.action_format
    )
    assert copy["turns"] > 0 and 0 < copy["p_deadlock_without_block"] < 1
    assert set(copy) >= {"p_deadlock_expert_names_d", "p_deadlock_ref_names_d", "p_deadlock_error+diff_of_d"}


def test_weight_figures_by_hand():
    records = [
        make_annotation(weights=[1.1, 0.95, 1.0], action_mask=[1, 1, 0], advantage=-2.0),
        make_annotation(weights=None, action_mask=[1], advantage=1.0),
    ]
    f = weight_figures(records, weight_clip=0.2, lam=0.5)
    # |A (w - 1)|: 2 * 0.1 + 2 * 0.05 = 0.3 over |A| 2 + 2 + 1 = 5; the clip sits at 1 +- 0.5 * 0.2
    assert f["advantage_mass_moved"] == pytest.approx(0.3 / 5)
    assert f["weighted_tokens"] == 2 and f["at_clip_fraction"] == 0.5 and f["above_one_fraction"] == 0.5
    assert f["weight_quantiles"]["min"] == pytest.approx(0.95) and f["weight_quantiles"]["max"] == pytest.approx(1.1)


def test_update_figures_at_lambda_zero_are_grpo(episodes, micro):
    model, tokenizer = micro
    cfg = AnnotateConfig(sources="expert", trajectory="aligned", mixing_lambda=0.0)
    records, _ = annotate_episodes(episodes[:8], cfg, model, tokenizer, env_cfg=SOKOBAN, bare_replies=True)
    f = update_figures(model, tokenizer, episodes[:8], records, weight_clip=0.2, lam=0.0, bare_replies=True)
    assert f["cos_serl_grpo"] == pytest.approx(1.0) and f["added_norm_ratio"] == 0.0
    assert f["grad_norm_ratio"] == pytest.approx(1.0)
    assert f["sft_turns"] > 0 and -1 <= f["cos_grpo_sft"] <= 1 and f["advantage_mass_moved"] == 0.0
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was
    torch.testing.assert_close(f["cos_serl_sft"], f["cos_grpo_sft"])


def test_update_diagnostics_script_annotates_a_saved_run_as_an_online_iteration_would(episodes, micro, tmp_path):
    """experiments/sokoban/update_diagnostics.py on a run on disk: the prompt settings come from its
    manifest, and at lambda 0 SERL's update is GRPO's, as in the test above."""
    import importlib.util
    from pathlib import Path

    from serl_cli.artifacts import io
    from serl_cli.artifacts.schema import write_rollouts

    model_dir = tmp_path / "micro"
    micro[0].save_pretrained(model_dir)
    micro[1].save_pretrained(model_dir)
    run = tmp_path / "run"
    run.mkdir()
    write_rollouts(run, episodes[:8])
    rollout = {"env": SOKOBAN, "prompt": {"bare_replies": True}}
    io.write_json(run / "manifest.json", io.new_manifest("rollout", rollout, seed=0))
    script = Path(__file__).parents[1] / "experiments" / "sokoban" / "update_diagnostics.py"
    spec = importlib.util.spec_from_file_location("update_diagnostics", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    f = module.main([str(run), "--model", str(model_dir), "--mixing-lambda", "0"])
    assert f["cos_serl_grpo"] == pytest.approx(1.0) and f["advantage_mass_moved"] == 0.0
    assert f["sft_turns"] > 0 and f["settings"]["sources"] == "expert"


# -- study v4's grid -------------------------------------------------------------------------------


def test_study_v4_grid_starts_every_arm_from_the_reading_warm_start_and_contrasts_each_with_grpo():
    from pathlib import Path

    from serl_cli.ablate import grid as ab
    from serl_cli.ablate import grid_record as ab_record

    grid = ab.load_grid(str(Path(__file__).parent.parent / "experiments" / "study" / "sokoban_v4.yaml"))
    rec = ab_record.grid_record(grid, [])
    assert rec["axes"]["seeds"] == list(range(10)) and len(rec["cells"]) == 70 and grid.baseline == "grpo"
    # recorded absolute where the warm start exists on this machine (a grid runs from anywhere), else as written
    assert grid.base["model"].endswith("runs/study-v4/warm_start")
    assert not any("model" in c["overrides"] for c in rec["cells"])
    assert grid.base["rollout"]["sampling"]["coupled"] is True
    arms = {c["arm"]: c["overrides"] for c in rec["cells"]}
    assert {a: o["train"]["algo"] for a, o in arms.items()} == {
        "grpo": "grpo",
        "serl-oracle": "serl",
        "serl-oracle-loose": "serl",
        "rlsd-oracle": "rlsd",
        "sdpo-oracle": "sdpo",
        "serl-ref": "serl",
        "serl-error+diff-feedback": "serl",
    }
    for arm in ("serl-oracle", "serl-oracle-loose", "rlsd-oracle", "sdpo-oracle", "serl-ref"):
        assert arms[arm]["annotate"]["trajectory"] == "aligned"
    loose = arms["serl-oracle-loose"]["annotate"]
    assert (loose["weight_clip"], loose["mixing_lambda"], loose["lambda_decay_steps"]) == (1.0, 1.0, 0)
    assert arms["serl-error+diff-feedback"]["annotate"]["placement"] == "feedback"
    assert sorted((c["plus"], c["minus"]) for c in grid.contrasts) == sorted(([a], ["grpo"]) for a in list(arms)[1:])
    assert list(arms)[-1] == "sdpo-oracle"  # the costliest arm last: a grid stopped for time cuts its seeds first


def test_the_loose_bounds_arm_is_a_valid_setting_and_c_above_one_is_refused():
    # c = 1 bounds the weights to [0, 2]: a token's advantage can be zeroed, never turned (study v4's loose arm)
    from serl_cli.method.annotate_config import validate

    validate(AnnotateConfig(sources="expert", trajectory="aligned", weight_clip=1.0, mixing_lambda=1.0))
    with pytest.raises(SerlError, match=r"weight_clip must be in \[0, 1\], got 1.01"):
        validate(AnnotateConfig(sources="expert", weight_clip=1.01))


def test_parameter_steps_are_the_distances_between_consecutive_checkpoints(tmp_path):
    from safetensors.torch import save_file

    from serl_cli.method.diagnostics.update import parameter_steps

    states = [
        {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])},
        {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([5.0])},  # |(3, 0, 4)| = 5
        {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([5.0])},  # |(0, 1, 0)| = 1
    ]
    dirs = []
    for i, state in enumerate(states):
        (tmp_path / str(i)).mkdir()
        save_file(state, str(tmp_path / str(i) / "model.safetensors"))
        dirs.append(tmp_path / str(i))
    assert parameter_steps(dirs) == pytest.approx([5.0, 1.0])
    save_file({"a": torch.zeros(2)}, str(tmp_path / "2" / "model.safetensors"))
    with pytest.raises(ValueError, match="other parameters"):
        parameter_steps(dirs)
