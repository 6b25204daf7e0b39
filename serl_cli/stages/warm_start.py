"""A warm start aimed at a success band: SFT that stops when the policy solves a target share of rooms.

Why a target and not a step count: the SFT curve is flat for hundreds of steps and then climbs
steeply (docs/RESULTS.md, the warm-start curve). On that slope, floating-point differences between
CPUs and thread counts moved where 300 fixed steps land from 0.16 to 0.49 success, and RL from the
top of that range gained almost nothing (docs/studies/sokoban_testbed.md). A target lands every machine at
the same place.

Why the default band is 0.40-0.50 and not lower: from checkpoints still low on the climb (0.22-0.26
on the test panel) 40 iterations of GRPO or SERL left the policy where it was, whatever the learning
rate or group size; from checkpoints that had reached about 0.4 it rose steadily, +7 to +11.5 points
on three seeds (docs/studies/sokoban_testbed.md, the demo).

How it runs (:func:`sft_to_band`):

- SFT as ``serl train RUN --algo sft`` runs it: the expert's turns (``off_expert`` detours left
  out), ``sft.mini_batches`` optimizer steps a pass (or ``sft.mini_batch_turns`` examples a step),
  at most ``sft.epochs`` passes, each a new seeded shuffle.
- Every ``every`` steps (a checkpoint) the policy plays ``rooms`` validation rooms: rooms of the
  *train* split that the SFT data never played (the test panel is never looked at), sampled at
  ``temperature`` with the same seed each time, so two checkpoints are compared on the same draws.
  Once success reaches half the band's lower edge, every ``every_near`` steps: on the climb, 25
  steps took success from 0.27 to 0.45 (docs/RESULTS.md), across a band 0.10 wide.
- SFT stops at the first checkpoint whose success reaches the band's lower edge, or when the
  passes are done.

Which checkpoint becomes the warm start (:func:`choose_checkpoint`):

- **in the band**: the first checkpoint in the band (where SFT stopped);
- **stepped over the band**: one stretch of steps took success from below the band to above it;
  of the checkpoints so far, the one closest to the band's centre, ties to the earlier (in
  practice one of the two around the jump; below the band rather than above on a tie: a lower
  start leaves RL more room);
- **ended below the band**: every pass is done and no checkpoint reached the band; the best one,
  reported as below the band. RL then starts lower than intended: more room to gain, but the
  online iterations may be too few to show it. More ``sft.epochs`` or a lower band fixes it.

Writes ``RUN/checkpoint`` (the chosen policy) and ``RUN/warm_start.json`` (the band, every
checkpoint's success, the choice); the manifest marks the stage ``warm_start``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import read_manifest, read_rollouts
from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.rollout.engines import ModelPolicy, SamplingConfig, make_engine
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world, built_split
from serl_cli.training.train_config import TrainConfig

WARM_START_FILE = "warm_start.json"
IN_BAND, STEPPED_OVER, BELOW = "in the band", "stepped over the band", "ended below the band"


@dataclass
class WarmStartConfig:
    band: list[float] = setting(factory=lambda: [0.40, 0.50], doc="target success on the validation rooms")
    every: int = setting(25, "SFT steps between checkpoints")
    every_near: int = setting(
        10, "steps between checkpoints once success reaches half the band's lower edge (the climb can cross it in 15)"
    )
    rooms: int = setting(100, "validation rooms: train-split rooms the SFT data never played")
    temperature: float = setting(0.4, "how the validation rooms are played (0: greedy)")
    max_new_tokens: int = setting(3, "per reply, as the evaluation generates")


def check_warm_start(cfg: WarmStartConfig) -> None:
    """One clear line for settings that cannot work, before any model loads."""
    if len(cfg.band) != 2 or not 0.0 <= cfg.band[0] <= cfg.band[1] <= 1.0:
        raise SerlError(f"warm_start.band must be [low, high] success rates, 0 <= low <= high <= 1, got {cfg.band}")
    if min(cfg.every, cfg.every_near, cfg.rooms) < 1:
        raise SerlError(
            f"warm_start.every, every_near and rooms must be at least 1, got {cfg.every}, {cfg.every_near}, {cfg.rooms}"
        )


def choose_checkpoint(successes: list[float], band: list[float]) -> tuple[int, str]:
    """(index of the warm start among the checkpoints, why): the first checkpoint in the band
    (:data:`IN_BAND`); with none in it, the one closest to the band's centre, ties to the earlier
    (:data:`STEPPED_OVER` where some checkpoint is above the band, else :data:`BELOW`)."""
    if not successes:
        raise SerlError("the warm start evaluated no checkpoint: SFT had no steps to run")
    low, high = band
    inside = [i for i, s in enumerate(successes) if low <= s <= high]
    if inside:
        return inside[0], IN_BAND
    centre = (low + high) / 2
    # rounded: 0.30 - 0.20 and 0.40 - 0.30 are the same distance, whatever floating point says
    best = min(range(len(successes)), key=lambda i: (round(abs(successes[i] - centre), 9), i))
    return best, STEPPED_OVER if max(successes) > high else BELOW


def reached_band(success: float, band: list[float]) -> bool:
    """Whether SFT stops here: success at or above the band's lower edge."""
    return success >= band[0]


def steps_to_next_check(success: float | None, cfg: WarmStartConfig) -> int:
    """SFT steps from a checkpoint with ``success`` (None: none yet) to the next: ``every``, and
    ``every_near`` once success has reached half the band's lower edge."""
    return cfg.every_near if success is not None and success >= cfg.band[0] / 2 else cfg.every


def validation_rooms(total: int, n: int, played: set[int]) -> list[int]:
    """``n`` rooms of a ``total``-room split, evenly spread over it, each moved on to the next room
    that the SFT data did not play: the same rooms for every seed that plays the same data."""
    if n + len(played) > total:
        raise SerlError(f"warm_start.rooms {n}: the split has {total} rooms and the SFT data played {len(played)}")
    rooms, taken = [], set(played)
    for i in range(n):
        room = i * total // n
        while room in taken:
            room = (room + 1) % total
        taken.add(room)
        rooms.append(room)
    return rooms


def sft_examples(run: Path, cfg: TrainConfig, tokenizer, rollout_cfg: dict) -> list[Episode]:
    """Every SFT example of the run as a one-turn episode, so a step can take any of them: the
    expert's turns (detours marked ``off_expert`` are no targets) and, with ``hindsight_sft``,
    the teacher-prompt ones."""
    from serl_cli.stages.train import hindsight_sft_examples
    from serl_cli.training.learner import training_episodes

    episodes = training_episodes(read_rollouts(run), cfg, run)
    episodes += hindsight_sft_examples(episodes, cfg, tokenizer, rollout_cfg)
    return [replace(e, turns=[t]) for e in episodes for t in e.turns if not t.off_expert]


def sft_to_band(
    run_dir: str, sft: TrainConfig, cfg: WarmStartConfig, env: EnvConfig, *, overwrite: bool = False, log=print
) -> dict:
    """SFT on the run's expert data until a checkpoint reaches ``cfg.band`` (module docstring);
    returns what ``RUN/warm_start.json`` holds."""
    run = Path(run_dir)
    check_warm_start(cfg)
    from serl_cli.stages.train import check_hindsight_sft  # torch loads: SFT runs

    check_hindsight_sft(sft)
    with runlock.run_lock(run):
        io.prepare_output(run / WARM_START_FILE, overwrite=overwrite, what="a warm start")
        io.prepare_output(run / "checkpoint", overwrite=overwrite, what="a checkpoint")
        return _sft_to_band(run, sft, cfg, env, log)


def _sft_to_band(run: Path, sft: TrainConfig, cfg: WarmStartConfig, env: EnvConfig, log) -> dict:
    rollout_cfg = read_manifest(run).rollout_config
    model_name = sft.model or rollout_cfg["model"]
    prompt = PromptConfig(**rollout_cfg["prompt"])
    io.mark_stage(run, "warm_start", "running")
    from serl_cli.stats.summary import wilson_interval
    from serl_cli.training.learner import Learner

    learner = Learner(model_name, replace(sft, algo="sft", epochs=1, mini_batch_turns=1))
    examples = sft_examples(run, sft, learner.tokenizer, rollout_cfg)
    if not examples:
        raise SerlError(f"{run} holds no expert turn to learn from (every turn is marked off_expert)")
    batch = sft.mini_batch_turns or -(-len(examples) // max(sft.mini_batches, 1))
    # each update is the stretch up to the next checkpoint, one optimizer step per `batch` examples handed to it
    learner.cfg.mini_batch_turns = batch
    max_steps = max(1, sft.epochs * -(-len(examples) // batch))
    world = build_world(env)
    rooms = validation_rooms(world.num_tasks(built_split(env)), cfg.rooms, {e.task_id for e in read_rollouts(run)})
    done, rng = 0, random.Random(sft.seed)
    order: list[int] = []
    curve: list[dict] = []
    chosen: dict | None = None  # the checkpoint kept, with its figures
    while done < max_steps:
        steps = min(steps_to_next_check(curve[-1]["success"] if curve else None, cfg), max_steps - done)
        while len(order) < steps * batch:  # a new seeded shuffle each pass over the examples
            order += rng.sample(range(len(examples)), len(examples))
        chunk, order = order[: steps * batch], order[steps * batch :]
        loss = learner.update([examples[i] for i in chunk], 1.0)["loss"]
        done += steps
        wins = _validation_wins(learner, world, env, rooms, prompt, cfg, sft.seed)
        row = {"step": done, "loss": round(loss, 4), "success": wins / len(rooms)}
        curve.append(row)
        log(f"      SFT step {row['step']}: success {row['success']:.3f} on {len(rooms)} validation rooms")
        index, _ = choose_checkpoint([r["success"] for r in curve], cfg.band)
        if index == len(curve) - 1:  # the closest to the band's centre so far: keep it
            learner.save(run / "checkpoint", prompt)
            chosen = {**row, "success_ci95": wilson_interval(wins, len(rooms))}
        if reached_band(row["success"], cfg.band):
            break
    _, outcome = choose_checkpoint([r["success"] for r in curve], cfg.band)
    assert chosen is not None  # max_steps >= 1, and the first checkpoint is the closest so far
    summary = {
        "band": list(cfg.band),
        "every": cfg.every,
        "every_near": cfg.every_near,
        "validation_rooms": len(rooms),
        "temperature": cfg.temperature,
        "examples": len(examples),
        "batch": batch,
        "max_steps": max_steps,
        "step": chosen["step"],
        "success": chosen["success"],
        "success_ci95": chosen["success_ci95"],
        "outcome": outcome,
        "curve": curve,
    }
    io.write_json(run / WARM_START_FILE, summary)
    io.mark_stage(
        run,
        "warm_start",
        "done",
        config={"algo": "sft", "sft": io.to_plain(sft), "warm_start": io.to_plain(cfg)},
        checkpoint=str(run / "checkpoint"),
        step=chosen["step"],
    )
    return summary


def _validation_wins(learner, world, env: EnvConfig, rooms: list[int], prompt, cfg, seed: int) -> int:
    """Rooms won by the learner's current policy, every room live at once (one batch: the fewest
    forward passes), with the same sampling seed at every checkpoint."""
    with learner.full_model() as module:
        policy = ModelPolicy(
            make_engine("hf", module, learner.tokenizer),
            SamplingConfig(cfg.temperature, 1.0, cfg.max_new_tokens),
            prompt,
            seed=seed,
        )
        specs = [EpisodeSpec(task_id=r) for r in rooms]
        records = run_episodes(world, built_split(env), specs, policy, max_turns=env.max_turns, batch_size=len(rooms))
    return sum(bool(r.success) for r in records)
