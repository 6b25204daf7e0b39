"""The ``shuffled`` feedback source (serl_cli.method.feedback): the aligned oracle's block naming a
random move other than the expert's, the control for "does what the block says matter". Hand-made
turns; one annotation of noisy-expert Sokoban rollouts for the seed's path through ``annotate``."""

from __future__ import annotations

from collections import Counter

import pytest

from envs.sokoban.env import SokobanWorld
from envs.sokoban.rooms import DIRECTIONS
from serl_cli.artifacts.records import make_episode, make_turn
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.annotate_config import AnnotateConfig, validate
from serl_cli.method.annotation import annotate_episodes
from serl_cli.rollout.engines import TokenizedExpertPolicy
from serl_cli.rollout.policies import ExpertPolicy
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.runner import EpisodeSpec, run_episodes

TITLE = "The expert's action from this state (privileged oracle information):"
PINNED = ["down", "right", "right", "down", "left", "right", "right", "left"]  # turns 0-7 of task 0, expert "up"


def _episode(expert_moves, *, taken=None, task_id=3, group_id=1, rollout_index=2):
    """One rollout whose turn k has the expert move ``expert_moves[k]`` and took ``taken[k]`` (default: up)."""
    taken = taken or ["up"] * len(expert_moves)
    turns = [
        make_turn(action=a, action_text=a, state_key=f"s{k}", expert_action=e)
        for k, (a, e) in enumerate(zip(taken, expert_moves, strict=True))
    ]
    return make_episode(turns, task_id=task_id, group_id=group_id, rollout_index=rollout_index)


def _ctx(ep, t, *, seed=0, trajectory="aligned"):
    return fb.TurnContext(episode=ep, turn=t, trajectory=trajectory, seed=seed)


def _named(block: str) -> str:
    """The move a block names: its body, untagged."""
    body = block.split("\n", 1)[1]
    return body.removeprefix("<action>").removesuffix("</action>")


def test_the_named_move_is_never_the_experts_and_is_uniform_over_the_others():
    per_expert_move = 600
    for expert in DIRECTIONS:
        ep = _episode([expert] * per_expert_move)
        named = Counter(_named(fb.SOURCES["shuffled"].render(_ctx(ep, t))) for t in range(per_expert_move))
        assert expert not in named
        # every other move drawn, each near a third: a draw that favoured one of them (or never drew
        # one) falls outside; the bound is about 7 standard deviations of a fair draw's share
        assert set(named) == set(DIRECTIONS) - {expert}
        assert all(abs(n / per_expert_move - 1 / 3) < 0.13 for n in named.values()), named


def test_the_draw_depends_on_every_id_and_the_seed_and_on_nothing_else():
    ep = _episode(["left"] * 40)
    blocks = [fb.hindsight_step(_ctx(ep, t), "shuffled") for t in range(40)]
    again = _episode(["left"] * 40)  # equal records, rebuilt: the same blocks
    assert [fb.hindsight_step(_ctx(again, t), "shuffled") for t in range(40)] == blocks
    moves = [_named(b[0]) for b in blocks]
    for changed in ({"task_id": 4}, {"group_id": 2}, {"rollout_index": 3}):
        other = _episode(["left"] * 40, **changed)
        assert [_named(fb.SOURCES["shuffled"].render(_ctx(other, t))) for t in range(40)] != moves
    assert [_named(fb.SOURCES["shuffled"].render(_ctx(ep, t, seed=1))) for t in range(40)] != moves


def test_the_draw_is_pinned_the_same_on_every_machine():
    # sha256 of the ids, not Python's per-process salted hash: these draws are fixed, and a change to
    # how they are derived must be deliberate (it changes every shuffled block of a study)
    ep = _episode(["up"] * 8, task_id=0, group_id=0, rollout_index=0)
    assert [fb.shuffled_move(_ctx(ep, t)) for t in range(8)] == PINNED


def test_the_block_is_the_oracles_with_another_move():
    ep = _episode(["left", "down", "right"], taken=["up", "down", "left"])
    for t in range(3):
        oracle, _, _ = fb.hindsight_step(_ctx(ep, t), "expert")
        shuffled, used, _ = fb.hindsight_step(_ctx(ep, t), "shuffled")
        move = _named(shuffled)
        assert shuffled == oracle.replace(f"<action>{ep.turns[t].expert_action}</action>", f"<action>{move}</action>")
        assert shuffled.startswith(TITLE + "\n") and used == ["shuffled"]


def test_it_fires_as_the_oracle_does_when_the_named_move_differs_from_the_action_taken():
    ep = _episode(["left"] * 30)
    for t in range(30):
        c = _ctx(ep, t)
        named = fb.shuffled_move(c)
        assert fb.SOURCES["shuffled"].fires(c) is (named != "up")
    took_it = _episode(["left"], taken=[fb.shuffled_move(_ctx(ep, 0))])
    assert fb.hindsight_step(_ctx(took_it, 0), "shuffled")[2] == []  # the move named was the one taken


def test_nothing_where_the_oracle_has_nothing():
    ep = _episode([None, "up"])  # a lost room: no expert move from turn 0's state
    assert fb.hindsight_step(_ctx(ep, 0), "expert") == (None, [], [])
    assert fb.hindsight_step(_ctx(ep, 0), "shuffled") == (None, [], [])
    assert fb.SOURCES["shuffled"].fires(_ctx(ep, 0)) is False


def test_in_full_it_is_the_experts_trajectory_with_every_move_replaced_the_same_at_every_turn():
    expert = [{"observation": f"room {k}", "action": m, "state_key": f"s{k}"} for k, m in enumerate(DIRECTIONS * 3)]
    ep = _episode(["up", "left", "down"], taken=["up", "up", "up"])
    oracle = fb.SOURCES["expert"].render(fb.TurnContext(episode=ep, turn=0, expert=expert))
    blocks = [fb.SOURCES["shuffled"].render(fb.TurnContext(episode=ep, turn=t, expert=expert)) for t in range(3)]
    assert blocks[0] == blocks[1] == blocks[2]  # the expert's trajectory is the same at every turn, and so is this
    shown = [line for line in blocks[0].splitlines() if line.startswith("<action>")]
    assert blocks[0].splitlines()[0] == oracle.splitlines()[0]  # the expert's title
    assert all(s != f"<action>{e['action']}</action>" for s, e in zip(shown, expert, strict=True))
    # the layout is the oracle's, line for line, but for the moves
    assert [x for x in blocks[0].splitlines() if not x.startswith("<action>")] == [
        x for x in oracle.splitlines() if not x.startswith("<action>")
    ]
    assert fb.uses_expert_trajectory("shuffled", "full") and not fb.uses_expert_trajectory("shuffled", "aligned")
    assert fb.SOURCES["shuffled"].render(fb.TurnContext(episode=ep, turn=0)) is None  # no demonstration known


def test_it_draws_among_sokobans_moves_only():
    webshop = _episode(["click[buy now]"])
    with pytest.raises(SerlError, match="the shuffled source draws among up, down, left, right"):
        fb.SOURCES["shuffled"].render(_ctx(webshop, 0))
    assert validate(AnnotateConfig(sources="expert|shuffled", trajectory="aligned")) == [["expert", "shuffled"]]


def test_annotate_draws_with_its_seed(tiny_tokenizer):
    """The annotation hands its seed to the source: the same seed gives the same blocks, another seed others."""
    compact = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)
    policy = TokenizedExpertPolicy(tiny_tokenizer, compact, ExpertPolicy(noise=0.3, seed=0))
    specs = [EpisodeSpec(task_id=t, group_id=t, rollout_index=r) for t in range(4) for r in range(2)]
    episodes = run_episodes(SokobanWorld(), "train", specs, policy)

    def blocks(seed: int) -> list[str | None]:
        cfg = AnnotateConfig(sources="shuffled", trajectory="aligned", mixing_lambda=0.0, seed=seed)
        records, _ = annotate_episodes(episodes, cfg, None, tiny_tokenizer, env_cfg=None, bare_replies=True)
        return [r.hindsight for r in records]

    zero = blocks(0)
    oracle = [(t.expert_action or None) for e in episodes for t in e.turns]
    assert [b is None for b in zero] == [o is None for o in oracle] and any(zero)
    assert all(_named(b) != o for b, o in zip(zero, oracle, strict=True) if b)
    assert blocks(0) == zero and blocks(7) != zero
