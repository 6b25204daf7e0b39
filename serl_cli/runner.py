"""Run a policy over many episodes side by side and record every turn.

All live episodes step in lockstep: each round the policy decides for every live
episode at once (one batched forward pass for a model policy), every environment steps,
and finished episodes leave the batch. One record per episode, one entry per turn; the
record layout is ``serl_cli.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from envs.base import Episode, Step, World
from serl_cli.policies import Decision


class Policy(Protocol):
    name: str

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]: ...


@dataclass
class EpisodeSpec:
    """Which task to run and where the episode belongs in its group."""

    task_id: int
    group_id: int = 0
    rollout_index: int = 0


def run_episodes(
    world: World,
    split: str,
    specs: list[EpisodeSpec],
    policy: Policy,
    *,
    max_turns: int | None = None,
    batch_size: int = 64,
    on_episode_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run ``specs`` with at most ``batch_size`` episodes live at once; records in spec order."""
    records: list[dict | None] = [None] * len(specs)
    pending = list(range(len(specs)))[::-1]
    live: list[tuple[int, Episode, Step, dict]] = []  # (spec index, episode, current step, record)

    def start_more():
        while pending and len(live) < batch_size:
            i = pending.pop()
            ep = world.new_episode(split, max_turns)
            step = ep.reset(specs[i].task_id)
            rec = {
                "task_id": specs[i].task_id,
                "group_id": specs[i].group_id,
                "rollout_index": specs[i].rollout_index,
                "instruction": ep.instruction,
                "initial_observation": step.observation,
                "turns": [],
            }
            live.append((i, ep, step, rec))

    start_more()
    while live:
        contexts = [{"instruction": ep.instruction, "turns": rec["turns"], "rules": world.rules} for _, ep, _, rec in live]
        decisions = policy.act([step for _, _, step, _ in live], contexts)
        still_live = []
        for (i, ep, step, rec), d in zip(live, decisions):
            nxt = ep.step(d.action)
            feedback = nxt.feedback.to_dict()
            if d.parse_error:  # the policy's reply held no well-formed action: say so, not just "invalid"
                feedback["error"] = d.parse_error
            rec["turns"].append(
                {
                    "turn": len(rec["turns"]),
                    "observation": step.observation,
                    "state_key": step.state_key,
                    "expert_action": step.expert_action,
                    "prompt_ids": d.prompt_ids,
                    "action_ids": d.action_ids,
                    "action_text": d.text,
                    "action": d.action,
                    "behaviour_logprobs": d.logprobs,
                    "next_observation": nxt.observation,
                    "next_state_key": nxt.state_key,
                    "feedback": feedback,
                    "reward": nxt.reward,
                    "done": nxt.done,
                    "info": nxt.info,
                }
            )
            if nxt.done:
                _finish(rec, nxt)
                records[i] = rec
                if on_episode_done:
                    on_episode_done(rec)
            else:
                still_live.append((i, ep, nxt, rec))
        live = still_live
        start_more()
    return records  # type: ignore[return-value]


def _finish(rec: dict, last: Step) -> None:
    turns = rec["turns"]
    rec["reward"] = float(last.reward)
    rec["success"] = bool(last.info.get("won", False))
    rec["num_turns"] = len(turns)
    rec["invalid_actions"] = sum(1 for t in turns if t["feedback"]["error"])
    rec["truncated"] = bool(last.info.get("truncated", False))
