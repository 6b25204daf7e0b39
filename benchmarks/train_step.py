"""Cost of one update step: grpo against serl, rlsd and sdpo on the same rollouts and model.

    python -m benchmarks.train_step [--catalog auto|real|synthetic] [--rollouts model|scripted]
                                    [--tasks 4] [--group-size 4] [--max-turns 6] [--max-new-tokens 24]
                                    [--temperature 1.0] [--deviate 0.3] [--threads 1] [--model DIR]
                                    [--seed 0] [--repeats 3] [--no-fresh-process-memory] [--out FILE]

Writes ``benchmarks/results/train_step.json`` (``train_step_scripted.json`` with
``--rollouts scripted``) unless ``--out`` is given.

One step is what the online loop (``serl_cli.online.loop``) does between a rollout and the
next: for serl, rlsd and sdpo ``annotate_episodes`` (feedback sources and the hindsight
block, the placement rule, teacher scoring of the turns that need it, the weights), then
``Learner.update`` (prepare + the gradient step); for grpo ``Learner.update`` alone.
Variants, as ``serl online`` configures them:

* ``grpo``: no annotate;
* ``serl``: sources ``ref|error``, step granularity, placement ``feedback``;
* ``rlsd``: the same with placement ``all`` (SERL's weights on every turn with a block);
* ``sdpo``: placement ``feedback``, ``skip_zero_advantage`` false, ``distill_coef`` 1.0.

Rollouts (collected once, untimed; every variant trains on the same episodes):

* ``--rollouts model`` (default): ``run_rollout`` with the default tiny model on the train
  split (``--tasks`` x ``--group-size`` G episodes, temperature 1, fixed seed).
* ``--rollouts scripted``: the same tasks and groups, but the actions are scripted and
  only scored by the tiny model. The randomly initialised model never writes a
  well-formed action, so on its own rollouts the ``error`` source fires on every turn and
  placement ``feedback`` selects exactly what ``all`` does (see the JSON's
  ``selection``): the default measures serl's worst case, where it costs what rlsd does.
  The scripted rollouts look like a policy partway through training: the successful half of
  each group follows the expert; in the other half each turn takes, with probability
  ``--deviate`` (seeded per episode and turn), a random admissible action
  (``serl_cli.rollout.policies.RandomPolicy``) instead of the expert's, and the expert recovers
  from wherever that leads. Each reply is ``<action>...</action>`` + end-of-turn,
  tokenized; its behaviour log-probs are the tiny model's teacher-forced log-probs at
  ``--temperature`` -- what the model would have recorded had it sampled those tokens.

Synthetic rewards: the randomly initialised model never succeeds, so every group's
rewards would be equal, every advantage 0, and no algorithm would do any work. The
benchmark therefore overwrites the outcome in memory: in every group the episodes with
``rollout_index < G // 2`` get reward 1.0 / success True, the others reward 0.0 / success
False (so with an even G every episode's advantage is +-1). This reward assignment is
synthetic. What an algorithm costs does not depend on *which* episodes succeed, only on
how many turns have a nonzero advantage (the update skips the others), how many turns
the teacher scores and how long they are -- all reported.

Timing: every variant starts from the same weights (a fresh ``Learner`` with the same
seed, built untimed) and its teacher is a copy of the learner's policy (the online loop's
teacher at a sync step; copying it is not timed, nor is writing annotations to disk).
Runs on ``--threads`` torch threads, 1 by default. An untimed full serl step pays the
lazy setup first (and grows the heap to its working size); then the variants run
``--repeats`` times, interleaved (the order rotates each repeat), and the median of each
time is reported. Times are CPU seconds of the process (``benchmarks.common.Stopwatch``):
the machine is shared, and CPU time leaves out the time the process waited for a core;
the JSON has the wall-clock seconds beside them. Columns:
``annotate CPU s`` is the whole ``annotate_episodes`` call (the JSON splits off
``teacher_s``, its part that builds the teacher prompts and scores them, and the rest:
hindsight blocks, action masks, placement, weights, the expert's trajectories for the
``ref`` fallback, with the last two also timed apart, all wall-clock); ``update CPU s`` is
the whole ``Learner.update`` call (prepare + the gradient step); ``x grpo`` is the total
over grpo's (the JSON adds ``annotate_over_grpo_update``: where a variant's gradient step
does grpo's work -- serl and rlsd, the same turns and tokens -- 1 + it is the ratio without
the noise of two update timings). A second table counts the work: turns the placement
chose, turns and tokens (prompt with the hindsight block + action) the teacher scored, scored turns whose
action mask is empty (their weights stay 1 and they carry no distillation term: teacher
work without effect), turns carrying the distillation term, turns run through the
gradient step.

Memory, two ways. In the timing process: before each variant's step the process's
peak-RSS mark is reset (``5`` written to ``/proc/self/clear_refs``, Linux 4.0+); after it,
``VmHWM`` from ``/proc/self/status`` is the step's own RSS high-water mark, and ``+RSS MB
(in run)`` is that minus the RSS at the start of the step (taken after ``gc`` and glibc's
``malloc_trim``, with the model, the teacher copy and the rollouts already resident): what
the step itself adds -- activations, gradients, the AdamW state -- but measured in a heap
that earlier variants have already grown. So each variant also runs once in a fresh
Python process (``--one-step``, skipped with ``--no-fresh-process-memory``) that loads the
model, the teacher copy and the rollouts and runs that one step: ``peak RSS MB (fresh)`` is
that process's ``VmHWM`` (imports and model included; not ``ru_maxrss``, which Linux
carries over from the parent through fork and exec), ``+RSS MB (fresh)`` that minus its
RSS just before the step. Memory in the
timing process is the maximum over repeats. tracemalloc is not used: it does not see
torch's tensor allocations and slows Python code down.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    RESULTS_DIR,
    Stopwatch,
    max_rss_mb,
    report,
    reset_peak_rss,
    run_module,
    status_kb,
    write_json,
)
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.errors import SerlError
from serl_cli.method import annotation as annotate_mod
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.policies import Decision, ExpertPolicy, RandomPolicy
from serl_cli.rollout.prompts import PromptConfig, format_action
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import RolloutConfig, episode_specs, run_rollout, sample_tasks
from serl_cli.training.learner import Learner
from serl_cli.training.train_config import TrainConfig

VARIANTS = ("grpo", "serl", "rlsd", "sdpo")


def variant_configs(name: str, cfg: UpdateBench) -> tuple[TrainConfig, AnnotateConfig | None]:
    """The train and annotate settings of a variant, as ``serl online`` derives them."""
    tcfg = TrainConfig(algo=name, seed=cfg.seed, threads=cfg.threads, distill_coef=1.0 if name == "sdpo" else 0.0)
    if name == "grpo":
        return tcfg, None
    acfg = AnnotateConfig(
        sources="ref|error",
        granularity="step",
        placement="all" if name == "rlsd" else "feedback",
        tokens="reply" if name == "rlsd" else "action",
        unparsed="whole",
        skip_zero_advantage=name != "sdpo",
        seed=cfg.seed,
        update_step=0,
        threads=cfg.threads,
    )
    return tcfg, acfg


# -- memory ----------------------------------------------------------------------------------
def _trim_heap() -> None:
    """Hand freed heap back to the OS (glibc), so a step's RSS starts from what is live."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- timers around annotate's parts (module attributes: wrapped, not changed) ----------------
class PartTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, module, attr: str):
        fn = getattr(module, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[attr] = self.seconds.get(attr, 0.0) + time.perf_counter() - t0

        setattr(module, attr, timed)


# -- rollouts ----------------------------------------------------------------------------------
class ScriptedPolicy:
    """Expert replies with seeded random deviations in the failing half of each group,
    tokenized as a model's reply and scored by ``model`` for the behaviour log-probs."""

    name = "scripted"

    def __init__(
        self, model, tokenizer, prompt: PromptConfig, group_size: int, deviate: float, seed: int, temperature: float
    ):
        from serl_cli.rollout.engines import ModelPolicy

        self.model, self.tokenizer, self.group_size = model, tokenizer, group_size
        self.deviate, self.seed, self.temperature = deviate, seed, temperature
        self._prompter = ModelPolicy(engine=_TokenizerOnly(tokenizer), sampling=SamplingConfig(), prompt=prompt)
        self._expert, self._random = ExpertPolicy(), RandomPolicy(seed)
        self._episode: dict[int, int] = {}  # id of the record's turn list -> spec index

    def act(self, steps, contexts) -> list[Decision]:
        from serl_cli.training.scoring import ScoreItem, score

        prompt_ids = self._prompter.prompts(steps, contexts)
        out = []
        for step, ctx, ids in zip(steps, contexts, prompt_ids, strict=True):
            ep = self._episode.setdefault(id(ctx["turns"]), len(self._episode))  # run_episodes starts specs in order
            turn = len(ctx["turns"])
            failing = ep % self.group_size >= self.group_size // 2
            action = self._expert.act([step], [ctx])[0].action
            if failing and random.Random(f"{self.seed}:{ep}:{turn}").random() < self.deviate:
                action = self._random.act([step], [ctx])[0].action
            reply = format_action(action)
            action_ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Decision(action=action, text=reply, prompt_ids=ids, action_ids=action_ids))
        logps = score(
            self.model, self.tokenizer, [ScoreItem(d.prompt_ids, d.action_ids) for d in out], self.temperature
        )
        for d, lp in zip(out, logps, strict=True):
            d.logprobs = lp
        return out


class _TokenizerOnly:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def collect_rollouts(bench: UpdateBench, env: EnvConfig, world, model_name: str) -> list[Episode]:
    sampling = SamplingConfig(temperature=bench.temperature, top_p=1.0, max_new_tokens=bench.max_new_tokens)
    n = bench.tasks * bench.group_size
    if bench.rollouts == "model":
        with tempfile.TemporaryDirectory(prefix="serl-train-step-") as tmp:
            cfg = RolloutConfig(
                env=env,
                model=model_name,
                tasks=bench.tasks,
                group_size=bench.group_size,
                sampling=sampling,
                batch_size=n,
                seed=bench.seed,
                threads=bench.threads,
                out=tmp,
            )
            run_rollout(cfg, overwrite=True)
            return read_rollouts(tmp)
    from serl_cli.models.loading import load_model
    from serl_cli.rollout.runner import run_episodes

    model, tokenizer = load_model(model_name)
    model.eval()
    specs = episode_specs(sample_tasks(world.num_tasks("train"), bench.tasks, bench.seed), bench.group_size)
    policy = ScriptedPolicy(
        model, tokenizer, PromptConfig(), bench.group_size, bench.deviate, bench.seed, bench.temperature
    )
    records = run_episodes(world, "train", specs, policy, max_turns=bench.max_turns, batch_size=n)
    return records


def assign_synthetic_rewards(episodes: list[Episode], group_size: int) -> None:
    """In every group the first half (rollout_index < G // 2) succeeds, the rest fails."""
    for e in episodes:
        win = e.rollout_index < group_size // 2
        e.reward, e.success = (1.0 if win else 0.0), win


# -- one step ----------------------------------------------------------------------------------
def run_step(
    name: str,
    bench: UpdateBench,
    model_name: str,
    episodes: list[Episode],
    env: EnvConfig,
    parts: PartTimer,
    reset_peak: bool = True,
) -> dict:
    tcfg, acfg = variant_configs(name, bench)
    learner = Learner(model_name, tcfg)
    teacher = copy.deepcopy(learner.model).eval().requires_grad_(False) if acfg else None
    episodes = copy.deepcopy(episodes)
    gc.collect()
    _trim_heap()
    parts.seconds.clear()
    rss_start_kb = status_kb("VmRSS")
    reset = reset_peak_rss() if reset_peak else False
    annotations = meta = None
    stats: dict = {}
    with Stopwatch() as annotate_sw:
        if acfg is not None:
            annotations, stats = annotate_episodes(
                episodes, acfg, teacher, learner.tokenizer, env_cfg=io.to_plain(env), temperature=bench.temperature
            )
            meta = {"config": io.to_plain(acfg), "stats": stats}
    with Stopwatch() as update_sw:
        metrics = learner.update(episodes, bench.temperature, annotations, meta)
    hwm_kb, maxrss = status_kb("VmHWM"), max_rss_mb()
    scored = [a for a in annotations or [] if a["teacher_logprobs"] is not None]
    out = {
        "variant": name,
        "annotate_s": annotate_sw.wall_s,
        "annotate_cpu_s": annotate_sw.cpu_s,
        "teacher_s": float(stats.get("teacher_s", 0.0)),
        "expert_trajectories_s": parts.seconds.get("expert_trajectories", 0.0),
        "action_mask_s": parts.seconds.get("action_span_mask", 0.0),
        "update_s": update_sw.wall_s,
        "update_cpu_s": update_sw.cpu_s,
        "gradient_loop_s": metrics["timing"]["update_s"],
        "total_s": annotate_sw.wall_s + update_sw.wall_s,
        "total_cpu_s": annotate_sw.cpu_s + update_sw.cpu_s,
        "turns": metrics["turns"],
        "action_tokens": metrics["action_tokens"],
        "turns_with_gradient": metrics["turns_with_gradient"],
        "selected_turns": int(stats.get("selected", 0)),
        "teacher_turns_scored": int(stats.get("teacher_turns_scored", 0)),
        "teacher_tokens_scored": int(stats.get("teacher_tokens_scored", 0)),
        "teacher_action_tokens": int(stats.get("teacher_action_tokens", 0)),
        # a scored turn with an empty action mask keeps weight 1 and adds no distillation term
        "teacher_turns_empty_mask": sum(not any(a["action_mask"]) for a in scored),
        "distill_turns": sum(bool(a["distill"]) for a in annotations or []),
        "loss": metrics.get("loss"),
        "rss_start_mb": (rss_start_kb or 0) / 1024.0,
        "peak_rss_mb": (hwm_kb / 1024.0) if hwm_kb is not None else maxrss,
        "ru_maxrss_mb": maxrss,
        "peak_reset": reset,
    }
    out["step_extra_mb"] = out["peak_rss_mb"] - out["rss_start_mb"]
    out["annotate_other_s"] = out["annotate_s"] - out["teacher_s"]
    del learner, teacher
    gc.collect()
    return out


def summarize(runs: list[dict]) -> dict:
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    out = dict(runs[0])
    for k in (
        "annotate_s",
        "annotate_cpu_s",
        "teacher_s",
        "annotate_other_s",
        "expert_trajectories_s",
        "action_mask_s",
        "update_s",
        "update_cpu_s",
        "gradient_loop_s",
        "total_s",
        "total_cpu_s",
    ):
        out[k] = med(k)
    for k in ("peak_rss_mb", "ru_maxrss_mb", "step_extra_mb"):
        out[k] = max(r[k] for r in runs)
    out["peak_reset"] = all(r["peak_reset"] for r in runs)
    out["all_total_s"] = [r["total_s"] for r in runs]
    out["all_total_cpu_s"] = [r["total_cpu_s"] for r in runs]
    del out["rss_start_mb"]
    return out


@dataclass
class UpdateBench:
    catalog: str = "auto"
    rollouts: str = "model"  # model | scripted (module docstring)
    model: str | None = None  # None: the embedded tiny model for WebShop
    tasks: int = 4
    group_size: int = 4
    max_turns: int = 6
    max_new_tokens: int = 24
    temperature: float = 1.0
    deviate: float = 0.3
    threads: int = 1
    seed: int = 0
    repeats: int = 3
    fresh_process_memory: bool = True  # also run each variant once in its own process for its peak RSS


@dataclass
class Batch:
    """The rollouts every variant trains on, with what produced them."""

    episodes: list[Episode]
    env: EnvConfig
    world: object
    model_name: str
    rollout_s: float

    @property
    def turns(self) -> int:
        return sum(len(e.turns) for e in self.episodes)


def check(cfg: UpdateBench) -> None:
    if cfg.group_size < 2:
        raise SerlError("--group-size must be at least 2: half of each group succeeds")
    if cfg.temperature <= 0:
        raise SerlError("--temperature must be positive (behaviour log-probs are taken at it)")
    if cfg.rollouts not in ("model", "scripted"):
        raise SerlError(f"--rollouts must be model or scripted, got {cfg.rollouts!r}")


def make_batch(cfg: UpdateBench) -> Batch:
    """Collect the rollouts (untimed) and give them their synthetic rewards."""
    from serl_cli.models.loading import set_torch_threads

    check(cfg)
    set_torch_threads(cfg.threads)
    env = EnvConfig(name="webshop", split="train", max_turns=cfg.max_turns, settings={"catalog": cfg.catalog})
    world = build_world(env)
    if cfg.model:
        model_name = cfg.model
    else:
        from serl_cli.rollout.default_model import default_model_dir

        model_name = str(default_model_dir(world, "webshop"))
    t0 = time.perf_counter()
    episodes = collect_rollouts(cfg, env, world, model_name)
    rollout_s = time.perf_counter() - t0
    assign_synthetic_rewards(episodes, cfg.group_size)
    return Batch(episodes, env, world, model_name, rollout_s)


def warm_up(batch: Batch, cfg: UpdateBench, parts: PartTimer) -> None:
    """Untimed: spaCy (the expert's purchases), bm25s, torch's first forward/backward."""
    from envs.webshop.reward import title_nouns

    batch.world.engine.search("warm up")
    title_nouns("warm up the tagger")
    run_step("serl", cfg, batch.model_name, batch.episodes, batch.env, parts)


def measure(cfg: UpdateBench, batch: Batch | None = None, log=print) -> dict:
    """Every variant's step on the same batch, interleaved; medians, ratios to grpo, peak memory."""
    batch = batch or make_batch(cfg)
    log(f"rollouts ({cfg.rollouts}): {len(batch.episodes)} episodes, {batch.turns} turns in {batch.rollout_s:.1f} s")
    parts = PartTimer()
    parts.wrap(annotate_mod, "expert_trajectories")
    parts.wrap(annotate_mod, "action_span_mask")
    warm_up(batch, cfg, parts)

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(cfg.repeats):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            res = run_step(v, cfg, batch.model_name, batch.episodes, batch.env, parts)
            runs[v].append(res)
            log(
                f"  repeat {r + 1}/{cfg.repeats} {v}: annotate {res['annotate_cpu_s']:.2f} CPU s, "
                f"update {res['update_cpu_s']:.2f} CPU s ({res['total_s']:.2f} s wall in all)"
            )
    results = [summarize(runs[v]) for v in VARIANTS]
    base = results[0]
    ratios = {f"{r['variant']}/grpo": r["total_cpu_s"] / base["total_cpu_s"] for r in results[1:]}
    for r in results:
        r["total_over_grpo"] = r["total_cpu_s"] / base["total_cpu_s"]
        r["update_over_grpo"] = r["update_cpu_s"] / base["update_cpu_s"]
        # robust to noise in equal-work updates
        r["annotate_over_grpo_update"] = r["annotate_cpu_s"] / base["update_cpu_s"]
    if cfg.fresh_process_memory:
        for r in results:
            r["fresh_process"] = fresh_process_memory(r["variant"], cfg, batch)
            log(f"  {r['variant']} in a fresh process: peak RSS {r['fresh_process'].get('peak_rss_mb', 0):.0f} MB")
    sel = {r["variant"]: r["selected_turns"] for r in results[1:]}
    selection = {
        "turns": batch.turns,
        "selected": sel,
        "feedback_scores_fewer_than_all": results[1]["teacher_turns_scored"] < results[2]["teacher_turns_scored"],
    }
    return {
        "catalog": batch.world.catalog.source,
        "model": batch.model_name,
        "rollouts": cfg.rollouts,
        "split": "train",
        "tasks": cfg.tasks,
        "group_size": cfg.group_size,
        "episodes": len(batch.episodes),
        "turns": batch.turns,
        "action_tokens": base["action_tokens"],
        "max_turns": cfg.max_turns,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "deviate": cfg.deviate if cfg.rollouts == "scripted" else None,
        "threads": cfg.threads,
        "seed": cfg.seed,
        "repeats": cfg.repeats,
        "rollout_s": batch.rollout_s,
        "synthetic_rewards": "rollout_index < G // 2: reward 1.0, success True; else reward 0.0, success False",
        "memory": MEMORY_NOTE,
        "selection": selection,
        "variants": results,
        "ratios_total": ratios,
    }


MEMORY_NOTE = (
    "peak_rss_mb / step_extra_mb: in the timing process, VmHWM after a /proc/self/clear_refs reset "
    "(the step's own high-water mark) and that minus the RSS at the step's start; fresh_process: "
    "a new Python process that loads the model, the teacher copy and the rollouts and "
    "runs this one step (its VmHWM: peak_rss_mb), and that minus its RSS just before the step (step_extra_mb)"
)


# -- one variant in a fresh process, for its peak memory ------------------------------------------
def fresh_process_memory(variant: str, cfg: UpdateBench, batch: Batch) -> dict:
    with tempfile.TemporaryDirectory(prefix="serl-train-step-") as tmp:
        episodes_file = Path(tmp) / "episodes.json"
        episodes_file.write_text(json.dumps(batch.episodes))
        flags = [
            "--one-step",
            variant,
            "--episodes-file",
            str(episodes_file),
            "--model",
            batch.model_name,
            "--catalog",
            cfg.catalog,
            "--max-turns",
            str(cfg.max_turns),
            "--temperature",
            str(cfg.temperature),
            "--threads",
            str(cfg.threads),
            "--seed",
            str(cfg.seed),
        ]
        data, why = run_module("benchmarks.train_step", flags, timeout_s=900)
    return data if data is not None else {"error": why}


def one_step(variant: str, cfg: UpdateBench, episodes_file: str, out: str | None) -> None:
    """The body of the fresh process: load everything, note the RSS, run one step, note the peak."""
    from serl_cli.models.loading import set_torch_threads

    set_torch_threads(cfg.threads)
    env = EnvConfig(name="webshop", split="train", max_turns=cfg.max_turns, settings={"catalog": cfg.catalog})
    episodes = json.loads(Path(episodes_file).read_text())
    res = run_step(variant, cfg, cfg.model, episodes, env, PartTimer(), reset_peak=False)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and
    # exec, so a child of a large process would report the parent's size
    peak = res["peak_rss_mb"]
    data = {
        "variant": variant,
        "peak_rss_mb": peak,
        "rss_before_step_mb": res["rss_start_mb"],
        "step_extra_mb": peak - res["rss_start_mb"],
        "ru_maxrss_mb": res["ru_maxrss_mb"],
        "step_cpu_s": res["total_cpu_s"],
    }
    write_json(out or RESULTS_DIR / f"train_step_{variant}_memory.json", data)


def table_rows(data: dict) -> list[list]:
    rows = []
    for r in data["variants"]:
        fresh = r.get("fresh_process") or {}
        rows.append(
            [
                r["variant"],
                *(f"{r[k]:.2f}" for k in ("annotate_cpu_s", "update_cpu_s", "total_cpu_s", "total_over_grpo")),
                f"{fresh['peak_rss_mb']:.0f}" if "peak_rss_mb" in fresh else "-",
                f"{fresh['step_extra_mb']:.0f}" if "step_extra_mb" in fresh else "-",
                f"{r['step_extra_mb']:.0f}",
            ]
        )
    return rows


COLUMNS = [
    "algo",
    "annotate CPU s",
    "update CPU s",
    "total CPU s",
    "x grpo",
    "peak RSS MB (fresh)",
    "+RSS MB (fresh)",
    "+RSS MB (in run)",
]


def main() -> None:
    d = UpdateBench()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default=d.catalog, choices=["auto", "real", "synthetic"])
    ap.add_argument(
        "--rollouts",
        default=d.rollouts,
        choices=["model", "scripted"],
        help="model: the tiny model's own; scripted: the expert with random deviations (module docstring)",
    )
    ap.add_argument("--model", default=None, help="model directory or hub name (default: the embedded tiny model)")
    ap.add_argument("--tasks", type=int, default=d.tasks, help="train tasks to sample")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task (G, at least 2)")
    ap.add_argument("--max-turns", type=int, default=d.max_turns)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument(
        "--deviate", type=float, default=d.deviate, help="scripted: chance a failing episode's turn is random"
    )
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--repeats", type=int, default=d.repeats, help="interleaved runs of each variant; the median is kept"
    )
    ap.add_argument(
        "--no-fresh-process-memory",
        dest="fresh_process_memory",
        action="store_false",
        help="skip the per-variant fresh-process peak-RSS runs",
    )
    ap.add_argument("--one-step", choices=VARIANTS, default=None, help=argparse.SUPPRESS)  # the fresh process
    ap.add_argument("--episodes-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = vars(ap.parse_args())
    out, variant, episodes_file = args.pop("out"), args.pop("one_step"), args.pop("episodes_file")
    cfg = UpdateBench(**args)
    try:
        if variant is not None:
            return one_step(variant, cfg, episodes_file, out)
        data = measure(cfg)
    except SerlError as e:
        ap.exit(2, f"error: {e}\n")
    base = data["variants"][0]
    source = data["catalog"].split(":")[0]
    report(
        "train_step" if cfg.rollouts == "model" else f"train_step_{cfg.rollouts}",
        f"One update step (WebShop {source}, train, {cfg.rollouts} rollouts, {data['episodes']} episodes = "
        f"{cfg.tasks} x G={cfg.group_size}, {data['turns']} turns, {base['action_tokens']} action tokens, synthetic "
        f"rewards, {cfg.threads} thread(s), median of {cfg.repeats})",
        COLUMNS,
        table_rows(data),
        data,
        out,
    )
    work = Table(title="Work per step: turns the placement chose, what the teacher scored, turns with a gradient")
    for c in (
        "algo",
        "chosen turns",
        "teacher turns",
        "teacher tokens",
        "of them action",
        "empty mask",
        "distill turns",
        "grad turns",
    ):
        work.add_column(c, justify="left" if c == "algo" else "right")
    for r in data["variants"]:
        work.add_row(
            r["variant"],
            *(
                str(r[k])
                for k in (
                    "selected_turns",
                    "teacher_turns_scored",
                    "teacher_tokens_scored",
                    "teacher_action_tokens",
                    "teacher_turns_empty_mask",
                    "distill_turns",
                    "turns_with_gradient",
                )
            ),
        )
    Console().print(work)
    print("  ".join(f"{k} x{v:.2f}" for k, v in data["ratios_total"].items()))
    if not data["selection"]["feedback_scores_fewer_than_all"]:
        print(
            f"note: placement feedback scored as many turns as all ({data['variants'][1]['teacher_turns_scored']}): "
            "every turn carries evidence that fires (try --rollouts scripted)"
        )


if __name__ == "__main__":
    main()
