"""Artifact schemas in one place: what each JSONL record holds, and how it is read back.

A run directory (``serl rollout --out RUN``)::

    RUN/manifest.json       serl version, git commit, command, resolved config, seeds,
                            stage status, artifact schema version
    RUN/rollout.yaml        the resolved rollout config
    RUN/rollouts.jsonl      one record per episode (ROLLOUT_KEYS), each with its turns (TURN_KEYS)
    RUN/annotations.jsonl   one record per turn (serl annotate)
    RUN/checkpoint/         a Hugging Face model directory (serl train)
    RUN/metrics.jsonl       one record per update (serl train)

Token ids are stored exactly as generated and never rebuilt from text: ``prompt_ids`` is
the chat-templated prompt the policy saw, ``action_ids`` what it generated (ending in the
end-of-turn token when it stopped on its own) and ``behaviour_logprobs`` the sampling
policy's log-probability of each action token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.errors import SerlError

ROLLOUT_KEYS = ("task_id", "group_id", "rollout_index", "reward", "success", "turns")
TURN_KEYS = ("prompt_ids", "action_ids", "action_text", "behaviour_logprobs", "feedback", "reward", "done", "state_key")
ROLLOUTS_FILE = "rollouts.jsonl"


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _numbers(v) -> bool:
    return isinstance(v, list) and all(type(x) in (int, float) for x in v)


def _number(v) -> bool:
    return type(v) in (int, float)


# what each stored field must be: a wrong type is refused on reading, not found mid-update
EPISODE_TYPES = {
    "task_id": (lambda v: type(v) is int, "an integer"),
    "group_id": (lambda v: type(v) is int, "an integer"),
    "rollout_index": (lambda v: type(v) is int, "an integer"),
    "reward": (_number, "a number"),
    "success": (lambda v: type(v) is bool, "true or false"),
}
TURN_TYPES = {
    "prompt_ids": (_ints, "a list of token ids"),
    "action_ids": (_ints, "a list of token ids"),
    "behaviour_logprobs": (_numbers, "a list of numbers"),
    "action_text": (lambda v: isinstance(v, str), "a string"),
    "reward": (_number, "a number"),
    "done": (lambda v: type(v) is bool, "true or false"),
    "state_key": (lambda v: isinstance(v, str), "a string"),
}


def _check_types(record: dict, types: dict, where: str) -> None:
    for key, (ok, what) in types.items():
        if not ok(record[key]):
            raise SerlError(f"{where} {key} must be {what}, got {json.dumps(record[key])[:60]}")


def read_rollouts(run_dir: str | Path, *, need_tokens: bool = True) -> list[dict]:
    """Episodes of a run, checked: schema version, keys, token/log-prob alignment."""
    run_dir = Path(run_dir)
    io.load_manifest(run_dir)
    path = run_dir / ROLLOUTS_FILE
    if not path.is_file():
        raise SerlError(
            f"{run_dir} holds no rollouts ({ROLLOUTS_FILE} missing): run `serl rollout --out {run_dir}` first"
        )
    episodes = list(io.iter_jsonl(path, required=ROLLOUT_KEYS))
    if not episodes:
        raise SerlError(f"{path} holds no episodes")
    for n, ep in enumerate(episodes, 1):
        if not isinstance(ep["turns"], list):
            raise SerlError(f"{path}:{n}: 'turns' must be a list")
        _check_types(ep, EPISODE_TYPES, f"{path}:{n}:")
        for t in ep["turns"]:
            if not isinstance(t, dict):
                raise SerlError(f"{path}:{n}: a turn must be a JSON object, got {type(t).__name__}")
            missing = [k for k in TURN_KEYS if k not in t]
            if missing:
                raise SerlError(
                    f"{path}:{n}: a turn lacks {', '.join(missing)} (rollouts without feedback or token fields)"
                )
            _check_types(t, TURN_TYPES, f"{path}:{n}: a turn's")
            if need_tokens and (not t["prompt_ids"] or not t["action_ids"]):
                raise SerlError(
                    f"{path}:{n}: a turn has no token ids: these rollouts were not recorded with a model tokenizer"
                )
            if need_tokens and t["behaviour_logprobs"] and len(t["behaviour_logprobs"]) != len(t["action_ids"]):
                raise SerlError(f"{path}:{n}: behaviour_logprobs and action_ids differ in length")
            if not isinstance(t["feedback"], dict) or "error" not in t["feedback"]:
                raise SerlError(f"{path}:{n}: a turn's feedback lacks the environment's fields (error, diff)")
    return episodes


@dataclass
class TurnSample:
    """One turn as a training sample: the prompt it saw, the tokens it wrote, its episode's place."""

    episode: int  # index of the episode in the run
    turn: int
    group_key: tuple  # (task_id, group_id): the GRPO group
    prompt_ids: list[int]
    action_ids: list[int]
    behaviour_logprobs: list[float]
    episode_reward: float
    success: bool
    state_key: str
    turn_reward: float
    off_expert: bool = False  # a noisy expert's exploration move: it reaches a state, it is no SFT target
    invalid: bool = False  # the action was invalid (turn_invalid): the invalid-action penalty's target
    faulted: bool = False  # the episode was ended by an environment fault (crash, timeout): it teaches nothing
    observation: str = ""  # the raw observation the turn acted on (GiGPO's anchor key train.gigpo_anchor observation)


def turn_invalid(turn: dict) -> bool:
    """Whether a stored turn's action was invalid: the authors' rule where the policy judged its
    reply by it (``prompt.style: authors`` records ``invalid``), else the environment's
    ``feedback.error``."""
    return bool(turn["invalid"]) if "invalid" in turn else bool((turn.get("feedback") or {}).get("error"))


def turn_samples(episodes: list[dict]) -> list[TurnSample]:
    out = []
    for e, ep in enumerate(episodes):
        for t in ep["turns"]:
            out.append(
                TurnSample(
                    episode=e,
                    turn=t.get("turn", 0),
                    group_key=(ep["task_id"], ep["group_id"]),
                    prompt_ids=t["prompt_ids"],
                    action_ids=t["action_ids"],
                    behaviour_logprobs=t["behaviour_logprobs"],
                    episode_reward=float(ep["reward"]),
                    success=bool(ep["success"]),
                    state_key=t["state_key"],
                    turn_reward=float(t["reward"]),
                    off_expert=bool(t.get("off_expert", False)),
                    invalid=turn_invalid(t),
                    faulted=bool(ep.get("error")),
                    observation=t.get("observation", ""),
                )
            )
    return out


# -- annotations (serl annotate) ------------------------------------------------------------
ANNOTATIONS_FILE = "annotations.jsonl"
SELECTION_REPORT_FILE = "selection_report.json"
# One record per turn, in rollouts.jsonl order (episode, then turn):
#   episode          index of the episode in rollouts.jsonl
#   task_id, group_id, rollout_index, turn
#   selected         the turn is in the critical set S of the placement rule
#   sources          names of the feedback sources that produced text for this turn
#   fired            names of the sources whose evidence counts for placement `feedback`
#   hindsight        the hindsight block shown to the teacher (None: no block)
#   action_mask      per action token: 1 inside the parsed action, 0 for reasoning/tags/end token
#   teacher_logprobs per action token, log pi_T (None: the teacher did not score this turn)
#   weights          per action token, the blended SERL weight w' (None: all 1)
#   advantage        the episode's group-normalized advantage
#   log_ratio_mean   mean over action tokens of log pi_T - log pi_old (None: not scored)
#   distill          the turn carries the distillation term (selected turn of a failed rollout)
ANNOTATION_KEYS = (
    "episode",
    "task_id",
    "group_id",
    "rollout_index",
    "turn",
    "selected",
    "sources",
    "fired",
    "hindsight",
    "action_mask",
    "teacher_logprobs",
    "weights",
    "advantage",
    "log_ratio_mean",
    "distill",
)


def rollout_temperature(manifest: dict) -> float:
    """Behaviour log-probs were taken at the rollout's temperature; greedy ones at 1."""
    cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    t = float(cfg.get("sampling", {}).get("temperature", 1.0))
    return t if t > 0 else 1.0


def rollouts_fingerprint(run: Path) -> str:
    return hashlib.sha256((run / ROLLOUTS_FILE).read_bytes()).hexdigest()[:16]


def read_annotations(run_dir: str | Path) -> list[dict]:
    """Annotations of a run, checked to belong to its current rollouts."""

    run = Path(run_dir)
    manifest = io.load_manifest(run)
    path = run / ANNOTATIONS_FILE
    if not path.is_file():
        raise SerlError(f"{run} has no annotations: run `serl annotate {run}` first")
    stage = manifest.get("stages", {}).get("annotate", {})
    if stage.get("status") != "done":
        raise SerlError(f"the annotation of {run} did not finish: run `serl annotate {run} --resume` first")
    made_for = stage.get("rollouts_sha256")
    if made_for != rollouts_fingerprint(run):
        raise SerlError(f"{path} was made from other rollouts than {run}/{ROLLOUTS_FILE}: annotate this run again")
    return list(io.iter_jsonl(path, required=ANNOTATION_KEYS))
