"""Run records: one :class:`Episode` per line of ``rollouts.jsonl``, holding its :class:`Turn` s; one
:class:`Annotation` per line of ``annotations.jsonl``; one :class:`Metrics` per line of ``metrics.jsonl``;
the run's ``manifest.json`` as a :class:`Manifest` of :class:`StageRecord` s.

These dataclasses are the one definition of the record: the code reads their attributes, and
``from_dict`` / ``to_dict`` read and write the JSON. A field without a default is required
(``ROLLOUT_KEYS``, ``TURN_KEYS``, ``ANNOTATION_KEYS``: a record without one is refused on reading); the others are
optional and take their default where a record lacks them. ``from_dict`` checks a record as
``serl_cli.artifacts.schema.read_rollouts`` always has (keys, types, token/log-prob alignment),
in one-line errors naming the file and line; what each field's type must be is in
``serl_cli.artifacts.record_checks``.

``to_dict`` writes the keys in field order -- the order the rollout runner (and ``serl annotate``)
has always written them -- so a run's ``rollouts.jsonl`` (``annotations.jsonl``) is byte-identical
to what the dict records gave, and
read -> write is the identity on it. A turn's fields "written only when set" are left out at their
default, as the runner left them out. Keys this version does not know are kept in ``extra`` and
written back after the known ones. (A hand-written record that lacks an optional key gains it,
at its default, when written back.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TypedDict

from serl_cli.artifacts.record_checks import ANNOTATION_TYPES, EPISODE_TYPES, TURN_TYPES, check_types
from serl_cli.errors import SerlError


@dataclass(slots=True, kw_only=True)
class Turn:
    """One turn: the state the policy saw, the tokens it wrote, what the environment answered."""

    turn: int = 0  # the turn's index in its episode
    observation: str = ""  # the raw observation the policy acted on
    state_key: str  # a hash of that observation (envs.base.state_key): the same state across rollouts
    expert_action: str | None = None  # the environment's reference action from this state; None: none
    prompt_ids: list[int]  # the chat-templated prompt the policy saw, as token ids
    action_ids: list[int]  # what it generated, ending in the end-of-turn token when it stopped on its own
    action_text: str  # action_ids decoded: the reply, reasoning included
    action: str = ""  # the action parsed out of the reply, as the environment got it
    behaviour_logprobs: list[float]  # the sampling policy's log-prob of each action token ([]: an expert's)
    next_observation: str = ""  # the environment's raw answer to the action
    next_state_key: str | None = None  # its hash
    feedback: dict  # what the environment said of the action (envs.base.Feedback): error (None: fine), diff
    reward: float  # the step's reward
    done: bool  # the episode ended with this turn
    info: dict = field(default_factory=dict)  # environment-specific extras (won, truncated, deadlock, ...)
    # written only when set:
    off_expert: bool = False  # a noisy expert's exploration move: it reaches a state, it is no SFT target
    invalid: bool | None = None  # prompt.style authors: the reply broke the authors' rule; None: feedback decides
    engine_logprobs: list[float] | None = None  # the engine's log-probs where the trainer recomputed pi_old
    hindsight: str | None = None  # an SFT example's block in its prompt (method.sft: hindsight, reading)
    policy_version: int | None = None  # max_staleness > 0: the policy version (updates done) that wrote it
    extra: dict = field(default_factory=dict)  # keys this version does not know, written back as they came

    @property
    def invalid_action(self) -> bool:
        """Whether the action was invalid: the authors' rule where the policy judged its reply by
        it (``prompt.style: authors`` records ``invalid``), else the environment's ``feedback.error``."""
        return bool(self.invalid) if self.invalid is not None else bool(self.feedback.get("error"))

    @classmethod
    def from_dict(cls, d: dict, where: str = "turn", *, need_tokens: bool = True) -> Turn:
        """A turn record, checked; ``where`` names it in errors (``path:line``)."""
        if not isinstance(d, dict):
            raise SerlError(f"{where}: a turn must be a JSON object, got {type(d).__name__}")
        missing = [k for k in TURN_KEYS if k not in d]
        if missing:
            raise SerlError(f"{where}: a turn lacks {', '.join(missing)} (rollouts without feedback or token fields)")
        check_types(d, TURN_TYPES, f"{where}: a turn's")
        if need_tokens and (not d["prompt_ids"] or not d["action_ids"]):
            raise SerlError(
                f"{where}: a turn has no token ids: these rollouts were not recorded with a model tokenizer"
            )
        if need_tokens and d["behaviour_logprobs"] and len(d["behaviour_logprobs"]) != len(d["action_ids"]):
            raise SerlError(f"{where}: behaviour_logprobs and action_ids differ in length")
        if not isinstance(d["feedback"], dict) or "error" not in d["feedback"]:
            raise SerlError(f"{where}: a turn's feedback lacks the environment's fields (error, diff)")
        return cls(**_known(d, _TURN_FIELDS), extra=_unknown(d, _TURN_FIELDS))

    def to_dict(self) -> dict:
        """The JSON record: known keys in field order (those written only when set, when set), then ``extra``."""
        return _to_dict(self, _TURN_FIELDS, _TURN_WHEN_SET)


COUNTED = -1  # Episode.num_turns and invalid_actions: the count is made from the episode's turns


@dataclass(slots=True, kw_only=True)
class Episode:
    """One episode of one task: where it belongs in its group, its turns, how it ended."""

    task_id: int  # the task in its split
    group_id: int  # the task's group in the rollout (GRPO's group: (task_id, group_id))
    rollout_index: int  # the episode's place in its group
    instruction: str = ""  # the task as the environment states it
    initial_observation: str = ""  # the observation after reset
    turns: list[Turn]  # in the order they were played
    reward: float  # the episode's reward: the last step's
    success: bool  # the environment's verdict (info.won)
    num_turns: int = COUNTED  # len(turns) (COUNTED: counted from the turns)
    invalid_actions: int = COUNTED  # how many turns' actions were invalid (COUNTED: counted from the turns)
    truncated: bool = False  # cut at the turn limit, or by an environment fault
    error: str | None = None  # the environment fault that ended the episode (None: none)
    extra: dict = field(default_factory=dict)  # keys this version does not know, written back as they came

    def __post_init__(self):
        # not given, or null in a record: counted (typed int, so every reader of a record sums them as such)
        if self.num_turns is None or self.num_turns == COUNTED:
            self.num_turns = len(self.turns)
        if self.invalid_actions is None or self.invalid_actions == COUNTED:
            self.invalid_actions = sum(t.invalid_action for t in self.turns)

    @property
    def group_key(self) -> tuple[int, int]:
        """(task_id, group_id): the GRPO group."""
        return self.task_id, self.group_id

    @classmethod
    def from_dict(cls, d: dict, where: str = "episode", *, need_tokens: bool = True) -> Episode:
        """An episode record and its turns, checked; ``where`` names it in errors (``path:line``).
        ``need_tokens``: every turn must hold token ids (and log-probs as many as its action's)."""
        missing = [k for k in ROLLOUT_KEYS if k not in d]
        if missing:
            raise SerlError(f"{where}: record lacks {', '.join(missing)}")
        if not isinstance(d["turns"], list):
            raise SerlError(f"{where}: 'turns' must be a list")
        check_types(d, EPISODE_TYPES, f"{where}:")
        turns = [Turn.from_dict(t, where, need_tokens=need_tokens) for t in d["turns"]]
        return cls(**{**_known(d, _EPISODE_FIELDS), "turns": turns}, extra=_unknown(d, _EPISODE_FIELDS))

    def to_dict(self) -> dict:
        """The JSON record, as ``rollouts.jsonl`` holds it (its turns' records included)."""
        d = _to_dict(self, _EPISODE_FIELDS, {})
        d["turns"] = [t.to_dict() for t in self.turns]
        return d


@dataclass(slots=True, kw_only=True)
class Annotation:
    """One turn's annotation (``serl annotate``, one line of ``annotations.jsonl``, in rollout order):
    its block, whether it is in the critical set S, the teacher's scores and the SERL weights."""

    episode: int  # index of the episode in rollouts.jsonl
    task_id: int
    group_id: int
    rollout_index: int
    turn: int  # the turn's index in its episode
    selected: bool  # the turn is in the critical set S of the placement rule
    sources: list[str]  # names of the feedback sources that produced text for this turn
    fired: list[str]  # names of the sources whose evidence counts for placement `feedback`
    hindsight: str | None  # the hindsight block shown to the teacher (None: no block)
    action_mask: list[int]  # per action token: 1 inside the parsed action, 0 for reasoning/tags/end token
    teacher_logprobs: list[float] | None  # per action token, log pi_T (None: the teacher did not score this turn)
    weights: list[float] | None  # per action token, the blended SERL weight w' (None: all 1)
    advantage: float  # the episode's group-normalized advantage (the update's, where it signs the weights)
    log_ratio_mean: float | None  # mean over action tokens of log pi_T - log pi_old (None: not scored)
    distill: bool  # the turn carries the distillation term (selected turn of a failed rollout)
    extra: dict = field(default_factory=dict)  # keys this version does not know, written back as they came

    @classmethod
    def from_dict(cls, d: dict, where: str = "annotation") -> Annotation:
        """An annotation record, checked; ``where`` names it in errors (``path:line``)."""
        if not isinstance(d, dict):
            raise SerlError(f"{where}: an annotation must be a JSON object, got {type(d).__name__}")
        missing = [k for k in ANNOTATION_KEYS if k not in d]
        if missing:
            raise SerlError(f"{where}: record lacks {', '.join(missing)}")
        check_types(d, ANNOTATION_TYPES, f"{where}:")
        for name in ("teacher_logprobs", "weights"):
            if d[name] is not None and len(d[name]) != len(d["action_mask"]):
                raise SerlError(f"{where}: {name} and action_mask differ in length")
        return cls(**_known(d, _ANNOTATION_FIELDS), extra=_unknown(d, _ANNOTATION_FIELDS))

    def to_dict(self) -> dict:
        """The JSON record, as ``annotations.jsonl`` holds it: every field in field order, then ``extra``."""
        return _to_dict(self, _ANNOTATION_FIELDS, {})


class Metrics(TypedDict, total=False):
    """One line of ``metrics.jsonl``: one update's figures (in the online loop, one iteration's).

    A plain dict, written and read back as it is, so the file is the dict's JSON. Declared are the
    keys the update always reports and those the readers look up (``serl show``, ``serl plot``, the
    ablation report, the CLI's table); each algorithm adds its own figures (``pg_loss``, ``kl``,
    ``distill_kl``, ``selected_fraction``, ...) and the online loop the evaluation's ``eval_*``."""

    update: int  # the learner's updates so far, this one included
    algo: str
    iteration: int  # the online loop's iteration (absent from a single update's line)
    env_steps: int  # the online loop: the iteration's environment steps (turns played)
    turns: int  # turns trained on
    action_tokens: int
    turns_with_gradient: int
    episodes: int
    mean_reward: float
    success_rate: float
    faulted_episodes: int
    faulted_turns: int
    loss: float  # the mean over the applied optimizer steps (NaN: every step was skipped)
    optimizer_steps: int  # 0: no turn had a gradient, nothing was applied
    skipped_steps: int  # steps whose loss or gradient was not finite
    mean_abs_advantage: float
    weight_mean: float  # serl, rlsd: the SERL weights over the action tokens
    weight_min: float
    weight_max: float
    advantage_mass_moved: float
    hindsight_examples: int  # train.hindsight_sft: the examples added to the update
    staleness_mean: float  # max_staleness > 0: how many updates old the rollouts were
    staleness_max: int
    is_weight_mean: float
    eval_success_rate: float  # the online loop's evaluation, on the iterations it ran


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One stage's entry in ``manifest.json`` (``stages.NAME``), read through: its status, its
    settings, its statistics, and whatever else it recorded (``get``). A stage the run has not
    started reads as an empty entry (status None)."""

    name: str
    entry: dict  # the JSON object as the manifest holds it

    @property
    def status(self) -> str | None:  # running, done (None: not started)
        return self.entry.get("status")

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def config(self) -> dict:  # the stage's resolved settings
        return self.entry.get("config") or {}

    @property
    def stats(self) -> dict:  # its statistics (annotate: teacher work, the teacher signal)
        return self.entry.get("stats") or {}

    def get(self, key: str, default=None):
        """What else the stage recorded (rollouts_sha256, checkpoint, metrics_line, ...)."""
        return self.entry.get(key, default)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A run's ``manifest.json``: what made the run and each stage's entry (:class:`StageRecord`).
    A view of the JSON object as read: the stages write it (``artifacts.io.mark_stage``), and
    ``to_dict`` is that object, so reading changes no byte of it."""

    data: dict

    @classmethod
    def from_dict(cls, d, where: str = "manifest.json") -> Manifest:
        """A manifest, checked: an object whose ``stages`` map names to objects."""
        if not isinstance(d, dict) or not isinstance(d.get("stages", {}), dict):
            raise SerlError(f"{where} is not a serl manifest (expected an object with a stages mapping)")
        for name, entry in d.get("stages", {}).items():
            if not isinstance(entry, dict):
                raise SerlError(f"{where}: stage {name} must be a JSON object, got {json.dumps(entry)[:60]}")
        return cls(d)

    def to_dict(self) -> dict:
        return self.data

    @property
    def stages(self) -> dict[str, StageRecord]:
        """Every stage the run recorded, in the order they started."""
        return {name: StageRecord(name, entry) for name, entry in self.data.get("stages", {}).items()}

    def stage(self, name: str) -> StageRecord:
        return StageRecord(name, self.data.get("stages", {}).get(name) or {})

    def has(self, name: str) -> bool:
        return name in self.data.get("stages", {})

    @property
    def rollout_config(self) -> dict:
        """The rollout's settings (model, env, sampling, prompt...): what the later stages read."""
        return self.stage("rollout").config

    @property
    def seed(self) -> int | None:
        return self.data.get("seed")

    @property
    def serl_version(self) -> str | None:
        return self.data.get("serl_version")

    @property
    def git_commit(self) -> str | None:
        return self.data.get("git_commit")


# -- records made in code: tests, synthetic benchmark batches ------------------------------------
def make_turn(**values) -> Turn:
    """A turn whose required fields not in ``values`` hold neutral values (no tokens, no error, reward 0)."""
    neutral = {
        "state_key": "",
        "prompt_ids": [],
        "action_ids": [],
        "action_text": "",
        "behaviour_logprobs": [],
        "feedback": {"error": None, "diff": ""},
        "reward": 0.0,
        "done": False,
    }
    return Turn(**{**neutral, **values})


def make_episode(turns: Sequence[Turn] = (), **values) -> Episode:
    """An episode of ``turns`` whose required fields not in ``values`` hold neutral values (task 0, reward 0)."""
    neutral = {"task_id": 0, "group_id": 0, "rollout_index": 0, "reward": 0.0, "success": False}
    return Episode(**{**neutral, **values}, turns=list(turns))


def make_annotation(**values) -> Annotation:
    """An annotation whose fields not in ``values`` hold neutral values (turn 0 of episode 0, not
    selected, no block, unscored, every weight 1, advantage 0)."""
    neutral = {
        "episode": 0,
        "task_id": 0,
        "group_id": 0,
        "rollout_index": 0,
        "turn": 0,
        "selected": False,
        "sources": [],
        "fired": [],
        "hindsight": None,
        "action_mask": [],
        "teacher_logprobs": None,
        "weights": None,
        "advantage": 0.0,
        "log_ratio_mean": None,
        "distill": False,
    }
    return Annotation(**{**neutral, **values})


# -- reading and writing -------------------------------------------------------------------------
def _required(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)


ROLLOUT_KEYS = _required(Episode)  # what every episode record holds
TURN_KEYS = _required(Turn)  # what every turn record holds
_EPISODE_FIELDS = tuple(f.name for f in fields(Episode) if f.name != "extra")
_TURN_FIELDS = tuple(f.name for f in fields(Turn) if f.name != "extra")
ANNOTATION_KEYS = _required(Annotation)  # what every annotation record holds: all of it
_ANNOTATION_FIELDS = tuple(f.name for f in fields(Annotation) if f.name != "extra")
# a turn's keys written only when set, with the default they are left out at: the runner writes
# off_expert only when true and invalid only where the policy judged the reply
_WHEN_SET = ("off_expert", "invalid", "engine_logprobs", "hindsight", "policy_version")
_TURN_WHEN_SET = {f.name: f.default for f in fields(Turn) if f.name in _WHEN_SET}


def _known(d: dict, names: tuple[str, ...]) -> dict:
    return {k: d[k] for k in names if k in d}


def _unknown(d: dict, names: tuple[str, ...]) -> dict:
    return {k: v for k, v in d.items() if k not in names}


def _to_dict(record, names: tuple[str, ...], when_set: dict) -> dict:
    d = {}
    for name in names:
        value = getattr(record, name)
        if name not in when_set or value != when_set[name]:
            d[name] = value
    d.update(record.extra)
    return d


def check_token_ids(episodes: list[Episode], vocabulary: int, where: str) -> None:
    """Every stored token id of ``episodes`` lies in a vocabulary of ``vocabulary`` ids: rollouts
    made with another model's tokenizer are refused by turn, not met as an index error mid-update."""
    for episode in episodes:
        for t, turn in enumerate(episode.turns):
            top = max(max(turn.prompt_ids, default=-1), max(turn.action_ids, default=-1))
            if top >= vocabulary:
                raise SerlError(
                    f"{where}: task {episode.task_id} (group {episode.group_id}, rollout {episode.rollout_index}), "
                    f"turn {t}: token id {top} is outside the model's vocabulary of {vocabulary} ids: these "
                    "rollouts were made with another tokenizer"
                )
