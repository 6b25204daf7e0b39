"""``serl rollout``: run a policy on sampled tasks, G times each, and store every turn.

Tasks are drawn from the split with ``random.Random(seed)`` (without replacement); each
task is run ``group_size`` times (its group). A model policy samples with the run's seed,
so the same command twice gives byte-identical ``rollouts.jsonl`` on CPU. The expert
policy records SFT data: the same prompt ids a model would see and the expert's action as
the reply, tokenized with ``--model``'s tokenizer (or the default model's); with
``expert_noise`` / ``expert_blunders`` it is a noisy expert (``rollout.policies.ExpertPolicy``)
whose random moves are marked ``off_expert``.

**Resume.** Every lockstep round's decisions (token ids, log-probs, text) are appended to
``rollouts.journal.jsonl`` and fsynced before the environments step. ``--resume`` after a
kill hands the journaled rounds back instead of asking the policy again -- the
environments (deterministic given task and actions) are re-stepped to exactly where they
were -- and then lets the policy go on with its call counter where it stood, which puts
sampling on the same draws. So no episode is lost or run twice, and the final
``rollouts.jsonl`` is byte-identical to an uninterrupted run's (docs/RELIABILITY.md).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from serl_cli import config as cfgmod
from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import ROLLOUTS_FILE, read_manifest, rollouts_fingerprint, write_rollouts
from serl_cli.config import at_least, setting, within
from serl_cli.errors import SerlError
from serl_cli.models.choices import Device, Dtype, check_names
from serl_cli.rollout.engines import (
    EngineName,
    ModelPolicy,
    SamplingConfig,
    TokenizedExpertPolicy,
    check_dispatch,
    make_engine,
)
from serl_cli.rollout.engines.vllm import VLLMConfig
from serl_cli.rollout.engines.vllm_requests import check_sampling
from serl_cli.rollout.policies import Decision, ExpertPolicy
from serl_cli.rollout.prompts import PromptConfig, check_chat_template_kwargs, check_style
from serl_cli.rollout.runner import Dispatch, EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world, world_info

Policy = Literal["model", "expert"]
POLICIES = get_args(Policy)
JOURNAL_FILE = "rollouts.journal.jsonl"


@dataclass
class RolloutConfig:
    env: EnvConfig = setting(factory=lambda: EnvConfig(split="train"), doc="the environment and its split")
    model: str | None = setting(None, "HF model directory or name; null: the embedded tiny model for the environment")
    policy: Policy = setting("model", "model | expert (expert: SFT data)")
    expert_noise: float = setting(
        0.0,
        "policy expert: chance per turn of a random detour (kept solvable where the env can tell), marked off_expert",
        limit=within(0, 1, "a probability in [0, 1]"),
    )
    expert_blunders: float = setting(
        0.0,
        "policy expert: chance per turn of a move that makes the task unsolvable, where one exists",
        limit=within(0, 1, "a probability in [0, 1]"),
    )
    engine: EngineName = setting("hf", "generation engine: hf | vllm (the vllm extra)")
    vllm: VLLMConfig = setting(factory=VLLMConfig, doc="engine vllm: tensor parallelism, memory, dtype")
    device: Device = setting(
        "auto",
        "engine hf (models.device): auto (CUDA when present) | cpu | cuda. In the online loop the hf engine "
        "generates with the trainer's own model: train.device",
    )
    dtype: Dtype = setting(
        "auto",
        "auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16: compute precision, through autocast. "
        "In the online loop: train.dtype",
    )
    gpus: list[int] | None = setting(
        None, "engine vllm: CUDA devices of its own (one per tensor-parallel shard); null: shared"
    )
    tasks: int = setting(8, "how many tasks to sample from the split", limit=at_least(1, whole=True))
    group_size: int = setting(8, "G: rollouts per task", limit=at_least(1, whole=True))
    sampling: SamplingConfig = setting(factory=SamplingConfig, doc="temperature, top_p, token budget")
    prompt: PromptConfig = setting(factory=PromptConfig, doc="what a turn's prompt shows")
    batch_size: int = setting(
        64, "episodes live at once (one generate call per turn across them)", limit=at_least(1, whole=True)
    )
    env_workers: int = setting(
        1,
        "processes the environments step in, each round's steps at once (1: in this process); same episodes",
        limit=at_least(1, whole=True),
    )
    dispatch: Dispatch = setting(
        "round",
        "round: every live episode's turn waits for the round's slowest reply and step | episode (engine vllm, "
        "greedy or sampling.coupled): each episode's next prompt goes to the engine as soon as its environment "
        "answers; the same replies, the log-probs to float32 rounding (docs/VLLM.md)",
    )
    seed: int = setting(0, "task order and sampling")
    threads: int | None = setting(
        None,
        "torch threads; null: all cores. In the online loop: train.threads",
        limit=at_least(1, "at least 1 (or unset: every core)", whole=True),
    )
    out: str = setting("runs/rollout", "the run directory to write")


def validate(cfg: RolloutConfig) -> None:
    """Settings that would otherwise fail deep inside generation, or silently mean something else."""
    if cfg.policy not in POLICIES:
        raise SerlError(f"unknown rollout policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    cfgmod.check_limits(cfg)  # the declared limits of the rollout's settings, its sampling's and its prompt's
    check_chat_template_kwargs(cfg.prompt.chat_template_kwargs)
    check_style(cfg.prompt)
    if cfg.policy == "model" and cfg.engine == "vllm":
        check_sampling(cfg.sampling)  # before vLLM starts (a minute), not at its first call
    check_dispatch(cfg.dispatch, cfg.policy, cfg.engine, cfg.sampling.temperature, cfg.sampling.coupled)
    check_names(cfg.device, cfg.dtype)


def sample_tasks(num_tasks: int, count: int, seed: int) -> list[int]:
    if not 0 < count <= num_tasks:
        raise SerlError(f"--tasks {count} out of range: the split has {num_tasks} tasks")
    return random.Random(seed).sample(range(num_tasks), count)


def episode_specs(task_ids: list[int], group_size: int) -> list[EpisodeSpec]:
    if group_size < 1:
        raise SerlError(f"--group-size must be at least 1, got {group_size}")
    return [
        EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate(task_ids) for r in range(group_size)
    ]


def rollout_specs(cfg: RolloutConfig, world) -> list[EpisodeSpec]:
    """The episodes a rollout runs: ``cfg.tasks`` tasks drawn with ``cfg.seed``, ``group_size`` each."""
    return episode_specs(sample_tasks(world.num_tasks(cfg.env.split), cfg.tasks, cfg.seed), cfg.group_size)


def collect(cfg, world, specs: list[EpisodeSpec], policy, progress=None) -> list[Episode]:
    """Run ``specs`` with ``policy``, ``cfg.batch_size`` at a time, in ``cfg.env``, its environments in
    ``cfg.env_workers`` processes; one record per spec, in order. ``cfg``: a :class:`RolloutConfig` or an
    evaluation's config (both name these settings)."""
    return run_episodes(
        world,
        cfg.env.split,
        specs,
        policy,
        max_turns=cfg.env.max_turns,
        batch_size=cfg.batch_size,
        on_episode_done=progress,
        step_timeout_s=cfg.env.step_timeout_s,
        pool=env_pool(cfg),
        dispatch=cfg.dispatch,
    )


def env_pool(cfg):
    """The worker processes ``cfg.env``'s environments step in (``cfg.env_workers`` of them), None for 1."""
    if cfg.env_workers <= 1:
        return None
    from serl_cli.rollout.env_pool import pool_for

    return pool_for(cfg.env, cfg.env_workers, cfg.env.step_timeout_s)


def rollout_summary(records: list[Episode], wall: float) -> dict:
    """What a rollout's manifest says of it (the online loop's metrics read it too)."""
    gen_tokens = sum(len(t.action_ids) for r in records for t in r.turns)
    turns = sum(r.num_turns for r in records)
    return {
        "episodes": len(records),
        "tasks": len({r.task_id for r in records}),
        "turns": turns,
        "mean_reward": sum(r.reward for r in records) / len(records),
        "success_rate": sum(r.success for r in records) / len(records),
        "invalid_action_rate": sum(r.invalid_actions for r in records) / max(turns, 1),
        "env_errors": sum(1 for r in records if r.error),
        "generated_tokens": gen_tokens,
        "wall_time_s": round(wall, 3),
        "tokens_per_s": gen_tokens / wall if wall > 0 else 0.0,
        "turns_per_s": turns / wall if wall > 0 else 0.0,
    }


def write_rollout(cfg: RolloutConfig, records: list[Episode], wall: float) -> dict:
    """A finished rollout into ``cfg.out`` at once (the online loop's: its episodes were
    collected in memory, perhaps by several processes): the manifest, ``rollouts.jsonl``."""
    out = Path(cfg.out)
    io.make_dir(out)
    io.write_json(out / "manifest.json", io.new_manifest("rollout", io.to_plain(cfg), cfg.seed))
    write_rollouts(out, records)
    summary = rollout_summary(records, wall)
    io.mark_stage(out, "rollout", "done", summary=summary, rollouts_sha256=rollouts_fingerprint(out))
    return summary


def resolve_model(cfg: RolloutConfig, world) -> str:
    if cfg.model:
        return cfg.model
    from serl_cli.rollout.default_model import default_model_dir

    return str(default_model_dir(world, cfg.env.name))


def make_rollout_policy(cfg: RolloutConfig, model, tokenizer, engine=None):
    if cfg.policy == "expert":
        return TokenizedExpertPolicy(
            tokenizer, cfg.prompt, ExpertPolicy(cfg.expert_noise, cfg.expert_blunders, cfg.seed)
        )
    if cfg.policy == "model":
        if engine is None:
            engine = make_engine(cfg.engine, model, tokenizer, vllm=cfg.vllm, seed=cfg.seed)
        return ModelPolicy(engine, cfg.sampling, cfg.prompt, seed=cfg.seed)
    raise SerlError(f"unknown rollout policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")


class JournaledPolicy:
    """A policy whose every round of decisions is journaled; on resume the journaled rounds
    are replayed before the policy is asked again."""

    def __init__(self, policy, journal: Path, replay: list[list[dict]]):
        self.policy, self.journal, self.replay = policy, journal, replay
        self.name = policy.name
        self.round = 0
        if hasattr(policy, "calls"):  # ModelPolicy seeds its call r with seed * 1_000_003 + r
            policy.calls = len(replay)

    def act(self, steps, contexts) -> list[Decision]:
        if self.round < len(self.replay):
            saved = self.replay[self.round]
            if len(saved) != len(steps):
                raise SerlError(
                    f"{self.journal}: round {self.round} holds {len(saved)} decisions but {len(steps)} "
                    f"episodes are live: the environment is not the one this journal was written with"
                )
            self.round += 1
            return [Decision(**d) for d in saved]
        decisions = self.policy.act(steps, contexts)
        io.append_journal(self.journal, {"round": self.round, "decisions": [dataclasses.asdict(d) for d in decisions]})
        self.round += 1
        return decisions


class JournaledEpisodes:
    """``dispatch: episode``'s journal: each decision journaled as the policy makes it, keyed by its
    episode (place in the rollout's specs) and turn; on resume a journaled turn is answered from the
    journal, the others by the policy, each from its own seed (greedy, or coupled sampling)."""

    def __init__(self, policy, journal: Path, replay: dict[tuple[int, int], dict]):
        self.policy, self.journal, self.replay = policy, journal, replay
        self.name = policy.name
        self._replayed: list[tuple[int, Decision]] = []
        self._turns: dict[int, int] = {}  # the turn each episode the policy is deciding is at

    def submit(self, key: int, step, ctx: dict) -> None:
        turn = len(ctx["turns"])
        saved = self.replay.get((key, turn))
        if saved is not None:
            self._replayed.append((key, Decision(**saved)))
        else:
            self._turns[key] = turn
            self.policy.submit(key, step, ctx)

    def finished(self) -> list[tuple[int, Decision]]:
        out, self._replayed = self._replayed, []
        for key, d in self.policy.finished() if self.policy.busy else []:
            unit = {"episode": key, "turn": self._turns.pop(key), "decision": dataclasses.asdict(d)}
            io.append_journal(self.journal, unit)
            out.append((key, d))
        return out

    @property
    def busy(self) -> bool:
        return bool(self._replayed) or self.policy.busy

    def cancel(self) -> None:
        self.policy.cancel()


def journal_replay(journal: Path, header: dict, dispatch: str) -> tuple[list[list[dict]], dict]:
    """A journal's decisions: by round (dispatch round), or by (episode, turn) (dispatch episode)."""
    units = io.read_journal(journal, header)
    if dispatch == "episode":
        if not all(isinstance(u.get("episode"), int) and isinstance(u.get("turn"), int) for u in units):
            raise SerlError(f"{journal}: a decision without its episode and turn: pass --overwrite to start again")
        return [], {(u["episode"], u["turn"]): u["decision"] for u in units}
    if [u.get("round") for u in units] != list(range(len(units))):
        raise SerlError(f"{journal}: rounds out of order: the journal was edited; pass --overwrite to start again")
    return [u["decisions"] for u in units], {}


def journal_header(cfg: RolloutConfig, episodes: int) -> dict:
    """What must match for a journal to be resumed: every setting that changes the episodes."""
    plain = io.to_plain(cfg)
    for key in ("threads", "out"):
        plain.pop(key)
    return {"stage": "rollout", "config": plain, "episodes": episodes}


def stored_rollout_settings(out: str | Path) -> dict | None:
    """The settings the rollout in ``out`` was made with (its manifest's, written when it started):
    what ``serl rollout --out OUT --resume`` runs with. None where there is none."""
    if not (Path(out) / "manifest.json").is_file():
        return None
    try:
        stored = read_manifest(out).stage("rollout").get("config")
    except SerlError:  # a damaged manifest: the resume itself says what is wrong
        return None
    return stored if isinstance(stored, dict) else None


def check_same_rollout(out: Path, cfg: RolloutConfig) -> None:
    """``--resume`` of a finished rollout keeps it only if it was made with these settings (as
    an interrupted one's journal header is checked: all but ``threads`` and ``out``)."""
    stored = read_manifest(out).stage("rollout").get("config")
    if not isinstance(stored, dict):
        return
    now = io.to_plain(cfg)
    if cfg.model is None:  # the manifest holds the model it resolved to
        now["model"] = resolve_model(cfg, build_world(cfg.env))
    stored, now = ({k: v for k, v in c.items() if k not in ("threads", "out")} for c in (stored, now))
    found = io.differences(stored, now)
    if found:
        raise SerlError(
            f"cannot resume {out} with other settings ({io.differences_text(found)}): it holds a finished "
            f"rollout made with the stored ones; pass a new --out for another, or --overwrite to run it again"
        )


def check_rollouts_unchanged(out: Path) -> None:
    """A finished rollout kept by ``--resume`` holds the records it wrote (its recorded fingerprint)."""
    recorded = read_manifest(out).stage("rollout").get("rollouts_sha256")
    if recorded is not None and rollouts_fingerprint(out) != recorded:
        raise SerlError(
            f"{out / ROLLOUTS_FILE} has changed since the rollout wrote it (its sha256 differs from the record): "
            "pass --overwrite to run the rollout again"
        )


def _finished_summary(out: Path) -> dict | None:
    try:
        stage = read_manifest(out).stage("rollout")
    except SerlError:
        return None
    return stage.get("summary") if stage.done and (out / ROLLOUTS_FILE).is_file() else None


def run_rollout(
    cfg: RolloutConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
    progress=None,
    model=None,
    tokenizer=None,
    engine=None,
) -> dict:
    """Collect rollouts into ``cfg.out``; returns a summary. ``model``/``tokenizer`` may be
    passed in (the online loop keeps its policy in memory), and so may a live ``engine``
    (the online loop keeps one vLLM engine for the whole run). ``resume`` continues an
    interrupted run from its journal (or returns the summary of a finished one)."""
    out = Path(cfg.out)
    with runlock.run_lock(out):
        return _run_rollout(
            cfg,
            out,
            overwrite=overwrite,
            resume=resume,
            progress=progress,
            model=model,
            tokenizer=tokenizer,
            engine=engine,
        )


def _run_rollout(cfg: RolloutConfig, out: Path, *, overwrite, resume, progress, model, tokenizer, engine) -> dict:
    from serl_cli.models.loading import load_model, set_torch_threads

    journal = out / JOURNAL_FILE
    finished = io.begin_resumable(
        out / ROLLOUTS_FILE,
        journal,
        overwrite=overwrite,
        resume=resume,
        what="rollout",
        finished=lambda: _finished_summary(out),
        records_of=lambda summary: summary.get("episodes"),
    )
    if finished is not None:
        check_same_rollout(out, cfg)
        check_rollouts_unchanged(out)
        return finished
    validate(cfg)
    world = build_world(cfg.env)
    check_style(cfg.prompt, world)
    specs = rollout_specs(cfg, world)
    if model is None and engine is None:
        cfg.model = resolve_model(cfg, world)
    header = journal_header(cfg, len(specs))
    replay: list[list[dict]] = []
    turns: dict[tuple[int, int], dict] = {}
    resuming = resume and not overwrite and journal.exists() and (out / "manifest.json").is_file()
    if resuming:  # check the journal before loading anything
        replay, turns = journal_replay(journal, header, cfg.dispatch)
    set_torch_threads(cfg.threads)
    if model is None and engine is None:
        assert cfg.model is not None  # resolved above, before the journal is checked
        if cfg.policy == "model" and cfg.engine == "vllm":  # vLLM loads the weights itself
            engine = make_engine("vllm", None, None, model_dir=cfg.model, vllm=cfg.vllm, seed=cfg.seed, gpus=cfg.gpus)
        elif cfg.policy == "model":
            from serl_cli.models.device import resolve
            from serl_cli.models.loading import load_for_inference

            model, tokenizer = load_for_inference(cfg.model, resolve(cfg.device, cfg.dtype))
        else:  # the expert: only its tokenizer is needed (kept on the CPU)
            model, tokenizer = load_model(cfg.model)
    if engine is not None:
        tokenizer = engine.tokenizer
    if model is not None:
        model.eval()
    policy = make_rollout_policy(cfg, model, tokenizer, engine)
    if resuming:
        resumed = {"resumed_turns": len(turns)} if cfg.dispatch == "episode" else {"resumed_from_round": len(replay)}
        io.mark_stage(out, "rollout", "running", **resumed)
    else:
        io.make_dir(out)
        io.write_json(out / "manifest.json", io.new_manifest("rollout", io.to_plain(cfg), cfg.seed, world_info(world)))
        io.start_journal(journal, header)
    started = time.time()
    journaled = JournaledEpisodes(policy, journal, turns) if cfg.dispatch == "episode" else None
    records = collect(cfg, world, specs, journaled or JournaledPolicy(policy, journal, replay), progress)
    wall = time.time() - started
    write_rollouts(out, records)
    summary = rollout_summary(records, wall)
    io.mark_stage(out, "rollout", "done", summary=summary, rollouts_sha256=rollouts_fingerprint(out))
    journal.unlink(missing_ok=True)
    return summary
