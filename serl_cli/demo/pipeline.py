"""``serl demo``: the whole pipeline on the embedded default, in minutes on a laptop CPU.

On Sokoban, the default (no data download), it shows a model learning:

1. the embedded ``micro`` model for the environment (0.9M parameters, built on first use,
   then cached);
2. noisy-expert data on train rooms (``serl rollout --policy expert`` with ``expert_noise``
   and ``expert_blunders``): the expert's moves, and random detours and blunders marked
   ``off_expert`` that only serve to reach the states a learner's mistakes lead to;
3. one warm start: SFT on the expert's moves up to a target, not a step count
   (``stages.warm_start``): checkpoints every few steps (``warm_start.every``), each played on train
   rooms the data never saw, and SFT stops at the first one whose success enters
   ``warm_start.band`` (0.40-0.50: from lower checkpoints, still on the steep part of the SFT
   curve, 40 RL iterations moved nothing); the step it chose is printed and kept in ``demo.json``. Without
   ``warm_start`` (``--set warm_start=null``), ``sft``'s fixed steps. ``sft.hindsight_sft``
   (off by default) would add examples that teach the network to read SERL's hindsight
   block: at this scale that start left RL half the gain (+9.5 points in 40 iterations
   against +19.0 without it, docs/RESULTS.md), and study v3 (e) measures what it buys SERL;
4. from that same warm start, each online algorithm of ``algos`` (GRPO and SERL):
   ``serl train --iterations K``. Both arms start from the same checkpoint, so the
   comparison is of the update alone. Their episodes end at a deadlocking push
   (``arm_settings``: Sokoban's ``end_on_deadlock``), where the room can no longer be won:
   success is the same, but the updates no longer train on a third to a half of turns that
   no move could have saved, and an iteration takes half the time, so 80 iterations fit
   where 40 did;
5. the expert (a reference), the warm start and every arm on the first tasks of the test
   panel, with 95 % Wilson intervals: sampled at ``eval_temperature`` (0.4, the paper's
   validation setting; greedy decoding of a small model repeats a bump into a wall until
   the turn limit); each arm's gain over the warm start with its 95 % interval, paired room
   by room (:func:`paired_gain`); and SERL's teacher signal where the annotation measured it.

Any other environment (``--env webshop``) runs the original demo: the tiny model, plain
expert data, SFT, two GRPO iterations and a greedy evaluation (:func:`demo_defaults`).

Every step writes the same artifacts its own command would, under ``out``. To change what the
demo compares, change ``algos`` (the arms, each from the same warm start) or ``warm_start``
and ``sft`` (where the arms start); the steps themselves need no change.

Threads: one torch thread per process unless ``threads`` (``--threads``) says otherwise. The
model is 0.9M parameters: a second thread buys little on its small matrices, and on a 2-core
machine where the two arms already run side by side, or anything else is running, extra
threads fight for the cores. The SFT alone took 9 min 21 s with two threads
on a busy 2-core machine against 131 s with one. One thread also gives the same numbers on
every machine of the same CPU family, where the thread count would otherwise change the
floating-point summation order.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from serl_cli.algos.registry import objective
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import SELECTION_REPORT_FILE
from serl_cli.demo.config import DemoConfig, expert_data_config, online_arm_config, panel_eval_config
from serl_cli.demo.side_by_side import progress_line, run_side_by_side
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.rollout.default_model import default_model_dir
from serl_cli.rollout.worlds import build_world
from serl_cli.stages.evaluate import run_eval
from serl_cli.stages.rollout import run_rollout
from serl_cli.stages.warm_start import BELOW, IN_BAND, STEPPED_OVER, check_warm_start, sft_to_band


def run_demo(cfg: DemoConfig, *, overwrite: bool = False, log=print) -> dict:
    from serl_cli.online.loop import run_online  # torch loads now, not while the config is read

    out = Path(cfg.out)
    if not cfg.algos:
        raise SerlError("the demo needs at least one online algorithm in `algos`")
    if cfg.warm_start is not None:
        check_warm_start(cfg.warm_start)  # before minutes of expert data, not after
    io.prepare_output(out / "demo.json", overwrite=overwrite, what="a demo run")
    started = time.time()
    world = build_world(cfg.env)
    model = cfg.model or str(default_model_dir(world, cfg.env.name, cfg.preset))
    steps = 5
    log(f"[1/{steps}] model: {model}")

    s = run_rollout(expert_data_config(cfg, model, out / "expert"), overwrite=True)
    log(f"[2/{steps}] expert data: {s['episodes']} episodes, {s['turns']} turns")

    warm = _warm_start(cfg, model, out / "expert", log, steps)
    warm_checkpoint = str(out / "expert" / "checkpoint")
    policies: dict[str, str | None] = {"expert": None, "warm start": warm_checkpoint}

    arms = [online_arm_config(cfg, algo, warm_checkpoint) for algo in cfg.algos]
    side_by_side = cfg.parallel_arms and len(arms) > 1
    n = cfg.online.iterations
    log(
        f"[4/{steps}] online: {', '.join(cfg.algos)}, {n} iteration{'' if n == 1 else 's'} each"
        f"{', side by side' if side_by_side else ''}"
    )
    kept: dict[str, dict | None] = {}

    def arm_policy(arm: OnlineConfig) -> tuple[str, str]:
        """The arm's row name and the checkpoint it is scored with: its best iterate (logged)."""
        best = kept[arm.train.algo] = best_iteration(Path(arm.out))
        if best is not None:
            log(
                f"      {arm.train.algo}: kept iteration {best['iteration']} of {cfg.online.iterations}, success "
                f"{best['success']:.3f} on {cfg.online.eval.episodes} train rooms"
            )
        return f"{ARM_PREFIX}{arm.train.algo}", (best or {}).get("checkpoint") or str(Path(arm.out) / "checkpoint")

    scored: dict[str, tuple[dict, dict[int, float]]] = {}
    if side_by_side:
        # the test-panel evaluations share the arms' processes: the warm start's and the expert's
        # queue behind the arms, and each arm's follows it, so they run while the slower arm trains
        def evaluation(i: int) -> list:
            name, model_dir = arm_policy(arms[i])
            return [(name, _evaluation_job, (cfg, name, model_dir, steps))]

        scored = run_side_by_side(
            arms,
            log,
            after_arm=evaluation,
            extra=[(name, _evaluation_job, (cfg, name, model_dir, steps)) for name, model_dir in policies.items()],
        )
    else:
        for arm in arms:
            run_online(arm, overwrite=True, on_iteration=lambda h, algo=arm.train.algo: log(progress_line(algo, h)))
        for name, model_dir in [*policies.items(), *(arm_policy(arm) for arm in arms)]:
            scored[name] = _evaluate(cfg, name, model_dir, log, steps)
    # the table's order whatever order the evaluations ended in: expert, warm start, then the arms
    order = [*policies, *(f"{ARM_PREFIX}{arm.train.algo}" for arm in arms)]
    results = {name: scored[name][0] for name in order}
    by_room = {name: scored[name][1] for name in results}
    summary = {
        "results": results,
        "gains": {algo: paired_gain(by_room["warm start"], by_room[ARM_PREFIX + algo]) for algo in cfg.algos},
        "warm_start": warm,
        "iterations": cfg.online.iterations,
        "kept_iterations": {algo: (kept.get(algo) or {}).get("iteration") for algo in cfg.algos},
        "wall_time_s": round(time.time() - started, 1),
        "model": model,
        "eval_temperature": cfg.eval_temperature,
    }
    taught = [algo for algo in cfg.algos if objective(algo).needs_annotations]
    if taught:  # the first arm with a teacher (the demo's: serl)
        summary["teacher_signal"] = teacher_signal(out / taught[0])
    io.write_json(out / "demo.json", summary)
    return summary


ARM_PREFIX = "warm start + "  # an online arm's row in demo.json's results: "warm start + grpo"


def paired_gain(warm_start: dict[int, float], arm: dict[int, float]) -> dict:
    """An arm's gain over the warm start, each a {task_id: success} of the same test rooms:
    {"points", "ci95" (points), "rooms"}. Both played the same rooms, so the interval is the paired
    t-interval of the per-room differences: a room's difficulty cancels, and the interval is
    narrower than the two rates' own Wilson intervals put together would suggest."""
    from serl_cli.stats.summary import describe  # scipy: once the demo has run, not when it is configured

    rooms = sorted(warm_start.keys() & arm.keys())
    d = describe([100 * (arm[r] - warm_start[r]) for r in rooms])
    return {"points": d["mean"], "ci95": d["ci95"], "rooms": len(rooms)}


def gain_text(points: float, ci95: list[float] | None, spec: str = ".1f") -> str:
    """A gain in points with its 95 % interval, "+17.5 [+11.2, +23.8]" (no interval from a single room)."""
    return f"{points:+{spec}}" + ("" if ci95 is None else f" [{ci95[0]:+{spec}}, {ci95[1]:+{spec}}]")


def _warm_start(cfg: DemoConfig, model: str, run: Path, log, steps: int) -> dict:
    """SFT on the expert data in ``run``, to ``cfg.warm_start``'s band (or ``cfg.sft``'s steps
    without one); returns what ``demo.json`` reports of it: the SFT step chosen, and its success
    on the validation rooms where a band chose it."""
    from serl_cli.stages.train import train_on_run  # torch

    sft = copy.deepcopy(cfg.sft)
    sft.threads, sft.seed, sft.model = cfg.threads, cfg.seed, model
    if cfg.warm_start is None:
        m = train_on_run(str(run), sft, overwrite=True)
        hindsight = f", {m['hindsight_examples']} hindsight examples" if "hindsight_examples" in m else ""
        log(
            f"[3/{steps}] warm start (SFT): {m['turns']} examples{hindsight}, {m['optimizer_steps']} steps, "
            f"mean loss {m['loss']:.3f}"
        )
        return {"step": m["optimizer_steps"]}
    low, high = cfg.warm_start.band
    log(
        f"[3/{steps}] warm start: SFT until success on {cfg.warm_start.rooms} train rooms it has not seen "
        f"is in {low:.2f}-{high:.2f}, checked every {cfg.warm_start.every} steps, {cfg.warm_start.every_near} near it"
    )
    w = sft_to_band(str(run), sft, cfg.warm_start, cfg.env, overwrite=True, log=log)
    note = {
        IN_BAND: "in the band",
        STEPPED_OVER: "the nearest to the band: SFT stepped over it between two checks",
        BELOW: f"below the band: the best of {w['max_steps']} steps, all SFT may run",
    }[w["outcome"]]
    log(f"      warm start: SFT step {w['step']}, success {w['success']:.3f} ({note})")
    keep = ("step", "success", "success_ci95", "outcome", "band", "validation_rooms", "temperature")
    return {k: w[k] for k in keep}


def best_iteration(run: Path) -> dict | None:
    """The iteration of an online run whose periodic evaluation (``iter_XXXX/eval.json``) scored
    highest among those that kept a checkpoint, ties to the later: {"iteration" (counted from 1),
    "success", "checkpoint"}. None where no iteration has both (no periodic evaluation)."""
    scored = []
    for it in sorted(run.glob("iter_*")):
        if (it / "eval.json").is_file() and (it / "checkpoint" / "config.json").is_file():
            scored.append((io.read_json(it / "eval.json")["success_rate"], int(it.name.removeprefix("iter_")), it))
    if not scored:
        return None
    success, k, it = max(scored, key=lambda x: (x[0], x[1]))
    return {"iteration": k + 1, "success": success, "checkpoint": str(it / "checkpoint")}


def _evaluate(cfg: DemoConfig, name: str, model_dir: str | None, log, steps: int) -> tuple[dict, dict[int, float]]:
    """One row of the table: ``name`` on the test panel (:func:`panel_eval_config`), with its
    success room by room ({task_id: 0 or 1}), which the gains pair."""
    out = Path(cfg.out) / f"eval_{name.replace(' + ', '+').replace(' ', '_')}"
    result = run_eval(panel_eval_config(cfg, model_dir, out), overwrite=True)
    log(f"[{steps}/{steps}] eval {name}: success {result['success_rate']:.3f}")
    rooms = {row["task_id"]: float(row["success"]) for row in io.iter_jsonl(out / "episodes.jsonl")}
    return result, rooms


def _evaluation_job(cfg: DemoConfig, name: str, model_dir: str | None, steps: int, log) -> tuple[dict, dict]:
    """:func:`_evaluate` in a worker of :func:`run_side_by_side`."""
    return _evaluate(cfg, name, model_dir, log, steps)


def teacher_signal(run: Path) -> dict | None:
    """SERL's teacher signal over an online run: each iteration's
    ``selection_report.json["teacher"]["teacher_signal"]`` (``method.teacher_signal``),
    pooled weighted by scored turns. None where no iteration measured one."""
    signals = []
    for path in sorted(run.glob(f"iter_*/{SELECTION_REPORT_FILE}")):
        try:
            signal = io.read_json(path)["teacher"]["teacher_signal"]
            turns, right, gain = int(signal["turns"]), signal["right_direction"], signal["expert_prob_gain"]
        except (SerlError, KeyError, TypeError, ValueError):
            continue  # an iteration that measured none (or an older report): left out
        if turns > 0 and isinstance(right, (int, float)) and isinstance(gain, (int, float)):
            signals.append((turns, float(right), float(gain)))
    if not signals:
        return None
    n = sum(t for t, _, _ in signals)
    return {
        "turns": n,
        "iterations": len(signals),
        "right_direction": sum(t * r for t, r, _ in signals) / n,
        "expert_prob_gain": sum(t * g for t, _, g in signals) / n,
    }
