"""``serl show RUN``: a run directory rendered for a person, or one episode as JSON.

Without an episode: the manifest's stages, a table of episodes and, where the annotation
measured it, the teacher signal (``method.teacher_signal``). With one: every turn --
what the policy saw and wrote, what the environment said and, where ``annotations.jsonl``
exists, whether the turn is selected, its hindsight block and its per-token weights, each
action token shaded by its weight. Everything from the run is shown as plain text, never
as rich markup: observations hold ``[SEP]`` and ``click[...]``.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Annotation, Episode, Manifest, StageRecord, Turn
from serl_cli.artifacts.schema import (
    ANNOTATIONS_FILE,
    ROLLOUTS_FILE,
    iter_annotations,
    read_manifest,
    read_rollouts,
    rollouts_fingerprint,
)
from serl_cli.errors import SerlError

OBS_CHARS = 400  # an observation is cut here unless --full
DEFAULT_CLIP = 0.2  # weights are shaded by |w - 1| / clip (annotate's weight_clip when recorded)


# -- reading ----------------------------------------------------------------------------------
def load_run(run_dir: str | Path) -> tuple[Manifest, list[Episode], Annotations | None]:
    """(manifest, episodes, annotations by (episode, turn) or None where the run has none)."""
    run = Path(run_dir)
    manifest = read_manifest(run)
    episodes = read_rollouts(run, need_tokens=False)
    return manifest, episodes, read_annotations(run, manifest, episodes)


Annotations = dict[tuple[int, int], Annotation]  # a run's annotation records by (episode, turn)


def read_annotations(run: Path, manifest: Manifest, episodes: list[Episode]) -> Annotations | None:
    path = io.stored(run / ANNOTATIONS_FILE)
    if not path.exists():
        return None
    made_from = manifest.stage("annotate").get("rollouts_sha256")
    if made_from and rollouts_fingerprint(run) != made_from:
        raise SerlError(
            f"{path} was made from other rollouts than {run / ROLLOUTS_FILE}: run `serl annotate {run} --overwrite`"
        )
    out: Annotations = {}
    for n, rec in enumerate(iter_annotations(path), 1):
        e, t = rec.episode, rec.turn
        if not (0 <= e < len(episodes) and 0 <= t < len(episodes[e].turns)):
            raise SerlError(f"{path}:{n}: episode {e!r} turn {t!r} is not a turn of {run / ROLLOUTS_FILE}")
        if (e, t) in out:
            raise SerlError(f"{path}:{n}: a second record for episode {e} turn {t}")
        if rec.weights is not None and len(rec.weights) != len(episodes[e].turns[t].action_ids):
            n_ids = len(episodes[e].turns[t].action_ids)
            raise SerlError(f"{path}:{n}: weights must be a list of one number per action token ({n_ids})")
        out[e, t] = rec
    return out


def _check_index(what: str, i: int | None, n: int) -> None:
    if i is not None and not 0 <= i < n:
        raise SerlError(f"{what} {i} out of range: there are {n} (0 to {n - 1})")


# -- the run: stages and episodes ----------------------------------------------------------------
def _stage_detail(entry: StageRecord) -> str:
    cfg = entry.config
    keys = ("model", "policy", "sources", "granularity", "placement", "tokens", "algo", "teacher")
    parts = [f"{k} {cfg[k]}" for k in keys if cfg.get(k) not in (None, "")]
    if "expert" in str(cfg.get("sources", "")).replace("|", ",").split(","):
        parts.append("expert = privileged oracle information")
    if entry.get("checkpoint"):
        parts.append(f"checkpoint {entry.get('checkpoint')}")
    return ", ".join(parts)


def run_view(
    run_dir: str | Path, manifest: Manifest, episodes: list[Episode], ann: Annotations | None
) -> RenderableType:
    commit = (manifest.git_commit or "unknown")[:10]
    head = Text(
        f"run {run_dir}: serl {manifest.serl_version}, seed {manifest.seed}, commit {commit}",
        style="bold",
    )
    stages = Table(title="stages", title_justify="left", header_style="bold")
    for col in ("stage", "status", "detail"):
        stages.add_column(col)
    for name, entry in manifest.stages.items():
        status = str(entry.get("status", "?"))
        stages.add_row(
            Text(name), Text(status, style="green" if status == "done" else "yellow"), Text(_stage_detail(entry))
        )
    table = Table(title="episodes", title_justify="left", header_style="bold")
    for col in ("#", "task_id", "group_id", "rollout", "reward", "success", "turns", "invalid"):
        table.add_column(col, justify="right")
    if ann is not None:
        table.add_column("selected", justify="right")
    rows = episode_rows(episodes, ann)
    for e, row in enumerate(rows):
        cells: list[str | Text] = [
            str(e),
            str(row["task_id"]),
            str(row["group_id"]),
            str(row["rollout_index"]),
            f"{row['reward']:.3f}",
            Text("yes", style="green") if row["success"] else Text("no", style="red"),
            str(row["turns"]),
            str(row["invalid_actions"]),
        ]
        if ann is not None:
            cells.append(str(row["selected_turns"]))
        table.add_row(*[c if isinstance(c, Text) else Text(c) for c in cells])
    total = f"{len(rows)} episodes, success {sum(r['success'] for r in rows) / len(rows):.3f}"
    if ann is not None:
        total += f", {sum(r['selected_turns'] for r in rows)} of {len(ann)} turns selected"
    parts: list[RenderableType] = [head, stages, table]
    signal = manifest.stage("annotate").stats.get("teacher_signal")
    if signal:
        parts.append(teacher_signal_text(signal))
    return Group(*parts, Text(total + "; `serl show RUN --episode N` for one episode", style="dim"))


def teacher_signal_text(s: dict) -> Text:
    """How often the teacher moves the student's action the right way, and what its block does to the expert's."""
    off, on, sides = s["off_expert_turns"], s["on_expert_turns"], []
    if off:
        sides.append(f"lowers {s['off_expert_right_direction']:.0%} of the {off} actions off the expert's")
    if on:
        sides.append(f"raises {s['on_expert_right_direction']:.0%} of the {on} on it")
    t = Text("teacher signal", style="bold")
    t.append(
        f", {s['turns']} scored turns with an expert action: the teacher moves the action the right way on "
        f"{s['right_direction']:.1%} ({', '.join(sides)}); the hindsight block moves the expert "
        f"action's probability by {s['expert_prob_gain']:+.3g} "
        f"({s['expert_prob_without_block']:.3g} -> {s['expert_prob_with_block']:.3g})"
    )
    return t


def episode_rows(episodes: list[Episode], ann: Annotations | None) -> list[dict]:
    rows = []
    for e, ep in enumerate(episodes):
        row = {k: getattr(ep, k) for k in ("task_id", "group_id", "rollout_index", "reward", "success")}
        row["turns"] = ep.num_turns
        row["invalid_actions"] = ep.invalid_actions
        if ann is not None:
            row["selected_turns"] = sum(1 for t in range(len(ep.turns)) if (a := ann.get((e, t))) and a.selected)
        rows.append(row)
    return rows


# -- one episode --------------------------------------------------------------------------------
def episode_json(episodes: list[Episode], ann: Annotations | None, index: int, turn: int | None = None) -> dict:
    """The episode's record with each turn's annotation record under ``annotation`` (None: not annotated)."""
    _check_index("episode", index, len(episodes))
    ep = dict(episodes[index].to_dict(), episode=index)
    _check_index("turn", turn, len(ep["turns"]))
    records = ann or {}
    ep["turns"] = [
        dict(t, annotation=_record(records.get((index, i))))
        for i, t in enumerate(ep["turns"])
        if turn is None or i == turn
    ]
    return ep


def _record(a: Annotation | None) -> dict | None:
    return None if a is None else a.to_dict()


def load_tokenizer(manifest: Manifest):
    """(tokenizer or None, why not): the rollout model's tokenizer, to decode action tokens."""
    name = manifest.rollout_config.get("model")
    if not name:
        return None, "the manifest names no rollout model"
    path = Path(name).expanduser()
    if not path.exists() and str(name).startswith((".", "/", "~")):
        return None, f"model directory {name} not found"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path) if path.exists() else name), ""
    except Exception as e:  # any failure just means: show numbers instead
        return None, f"cannot load the tokenizer of {name} ({type(e).__name__})"


def weight_style(w: float, clip: float) -> str:
    if abs(w - 1.0) < 1e-6:
        return ""
    level = round(60 + 170 * min(abs(w - 1.0) / clip, 1.0))
    return f"black on rgb(0,{level},0)" if w > 1 else f"white on rgb({level},0,0)"


def weights_text(action_ids: list[int], weights: list[float], mask: list | None, tokenizer, clip: float) -> Text:
    text = Text()
    for i, (tid, w) in enumerate(zip(action_ids, weights, strict=True)):
        style = weight_style(w, clip) + (" dim" if mask and i < len(mask) and not mask[i] else "")
        piece = tokenizer.decode([tid]).replace("\n", "⏎") if tokenizer is not None else f"{i}:{w:.3f}"
        text.append(piece, style=style.strip() or None)
        if tokenizer is None:
            text.append(" ")
    return text


def reply_parts(action_ids: list[int], weights: list[float], mask: list | None) -> tuple[list[int], list[int]]:
    """Token indices of the reply outside the parsed action (reasoning, tags, the end token) and inside it."""
    inside = [i for i in range(len(weights)) if mask is None or (i < len(mask) and mask[i])]
    chosen = set(inside)
    return [i for i in range(len(weights)) if i not in chosen], inside


def token_weights_text(action_ids: list[int], weights: list[float], indices: list[int], tokenizer, clip: float) -> Text:
    """The tokens at ``indices``, each shaded by its weight and followed by it: ``go·1.120 to·1.080``."""
    text = Text()
    for n, i in enumerate(indices):
        piece = tokenizer.decode([action_ids[i]]).replace("\n", "⏎") if tokenizer is not None else f"#{i}"
        text.append(piece, style=weight_style(weights[i], clip) or None)
        text.append(f"·{weights[i]:.3f}" + (" " if n < len(indices) - 1 else ""), style="dim")
    return text


def reasoning_text(action_ids: list[int], weights: list[float], indices: list[int], tokenizer, clip: float) -> Text:
    """The reply outside the parsed action, as written; its weights (1 under ``tokens: action``)."""
    ws = [weights[i] for i in indices]
    runs: list[list[int]] = []  # contiguous stretches: the action between them is shown as " … "
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    if tokenizer is not None:
        pieces = [tokenizer.decode([action_ids[i] for i in run], skip_special_tokens=True) for run in runs]
    else:
        pieces = [f"tokens {run[0]}..{run[-1]}" for run in runs]
    text = Text(" … ".join(pieces).replace("\n", "⏎"))
    if all(abs(w - 1.0) < 1e-6 for w in ws):
        text.append(f"  ({len(ws)} tokens, weight 1)", style="dim")
    else:
        text = token_weights_text(action_ids, weights, indices, tokenizer, clip)
    return text


def weights_summary(weights: list[float]) -> str:
    up, down = [w for w in weights if w > 1 + 1e-6], [w for w in weights if w < 1 - 1e-6]
    s = f"{len(weights)} tokens: {len(up)} up"
    s += f" (max {max(up):.3f})" if up else ""
    s += f", {len(down)} down" + (f" (min {min(down):.3f})" if down else "")
    return s + f", {len(weights) - len(up) - len(down)} at 1"


def legend(clip: float, by_index: bool, tokens: str = "action") -> Text:
    t = Text()
    t.append("weights: ", style="bold")
    for label, w in (
        (f"w={1 + clip:g}", 1 + clip),
        (f"w={1 + clip / 2:g}", 1 + clip / 2),
        ("w=1", 1.0),
        (f"w={1 - clip / 2:g}", 1 - clip / 2),
        (f"w={1 - clip:g}", 1 - clip),
    ):
        t.append(f" {label} ", style=weight_style(w, clip) or None)
        t.append(" ")
    t.append(f"  green: up-weighted, red: down-weighted, shade: |w-1|/{clip:g}; dim: outside the parsed action")
    t.append(
        "; reweighted: every reply token (rlsd)"
        if tokens == "reply"
        else "; reweighted: the parsed action's tokens only (a reply with none keeps 1)"
    )
    if by_index:
        t.append("; shown as token-index:weight")
    return t


def _field(grid: Table, label: str, value, style: str = "") -> None:
    grid.add_row(Text(label, style="bold cyan"), value if isinstance(value, Text) else Text(str(value), style=style))


def turn_view(i: int, turn: Turn, rec: Annotation | None, full: bool, tokenizer, clip: float) -> Panel:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    obs = str(turn.observation)
    if not full and len(obs) > OBS_CHARS:
        obs = obs[:OBS_CHARS] + f" … ({len(obs) - OBS_CHARS} more characters; --full shows all)"
    _field(grid, "observation", obs)
    _field(grid, "wrote", turn.action_text)
    _field(grid, "action", turn.action, "bold")
    fb = turn.feedback
    _field(grid, "error", fb.get("error") or "-", "red" if fb.get("error") else "dim")
    if turn.invalid is not None:  # prompt.style authors: their rule decides, not the environment's error
        _field(
            grid,
            "invalid",
            "yes (the authors' format rule)" if turn.invalid else "no",
            "red" if turn.invalid else "dim",
        )
    _field(grid, "diff", fb.get("diff") or "-")
    _field(grid, "reward", f"{float(turn.reward):.3f}   done {bool(turn.done)}")
    title = Text(f"turn {i}")
    if rec is not None:
        if rec.selected:
            title.append("  ").append(" SELECTED ", style="bold black on yellow")
        if rec.distill:
            title.append("  ").append(" DISTILL ", style="bold white on blue")
        _field(grid, "sources", ", ".join(rec.sources or []) or "-")
        _field(grid, "fired", ", ".join(rec.fired or []) or "-")
        _field(grid, "hindsight", rec.hindsight if rec.hindsight is not None else "(no block)", "italic")
        _field(grid, "advantage", f"{float(rec.advantage):+.3f}")
        lr = rec.log_ratio_mean
        _field(grid, "log-ratio", "(not scored)" if lr is None else f"{lr:+.4f}  (mean log pi_T - log pi_old)")
        if rec.weights is None:
            _field(grid, "weights", "all 1", "dim")
        elif rec.action_mask is not None and not any(rec.action_mask) and all(w == 1 for w in rec.weights):
            _field(grid, "weights", "all 1 (no parseable action: nothing to reweight)", "dim")
        else:
            _field(grid, "weights", weights_summary(rec.weights))
            _field(grid, "", weights_text(turn.action_ids, rec.weights, rec.action_mask, tokenizer, clip))
            # the reply split where the weights apply: reasoning (weight 1 under tokens: action) and the action
            ids, w = turn.action_ids, rec.weights
            outside, inside = reply_parts(ids, w, rec.action_mask)
            if outside:
                _field(grid, "reasoning", reasoning_text(ids, w, outside, tokenizer, clip))
            if inside:
                _field(grid, "action w", token_weights_text(ids, w, inside, tokenizer, clip))
    border = "yellow" if rec is not None and rec.selected else "dim"
    return Panel(grid, title=title, title_align="left", border_style=border)


def episode_view(
    manifest: Manifest,
    episodes: list[Episode],
    ann: Annotations | None,
    index: int,
    turn: int | None = None,
    full: bool = False,
    tokenizer_loader=load_tokenizer,
) -> RenderableType:
    _check_index("episode", index, len(episodes))
    ep = episodes[index]
    _check_index("turn", turn, len(ep.turns))
    head = Text(
        f"episode {index}: task {ep.task_id}, group {ep.group_id}, rollout {ep.rollout_index}, "
        f"reward {float(ep.reward):.3f}, ",
        style="bold",
    )
    head.append("success" if ep.success else "failure", style="bold green" if ep.success else "bold red")
    parts: list[RenderableType] = [head]
    if ep.instruction:
        parts.append(Text(f"instruction: {ep.instruction}"))
    if ann is None:
        parts.append(
            Text("not annotated: run `serl annotate RUN` to see selection, hindsight and weights", style="dim")
        )
    shown = range(len(ep.turns)) if turn is None else [turn]
    recs = {i: (ann or {}).get((index, i)) for i in shown}  # each shown turn's annotation record (None: none)
    weighted = any(r and r.weights is not None for r in recs.values())
    tokenizer, why = tokenizer_loader(manifest) if weighted else (None, "")
    acfg = manifest.stage("annotate").config
    clip = float(acfg.get("weight_clip", DEFAULT_CLIP))
    if weighted:
        parts.append(legend(clip, tokenizer is None, acfg.get("tokens", "action")))
        if tokenizer is None:
            parts.append(Text(f"({why}: weights by token index)", style="dim"))
    parts += [turn_view(i, ep.turns[i], recs[i], full, tokenizer, clip) for i in shown]
    return Group(*parts)
