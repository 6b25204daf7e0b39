"""``serl ablate``: grid rule, end to end on a tiny model, the SLURM array, kill and resume, bad input, report maths.

Commands run through ``serl_cli.ablate.runners.SELF_CMD`` (``python -m serl_cli``), the way the
runners start cells themselves.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from scipy import stats
from support import assert_one_line_error, run, tiny_grid

from serl_cli.ablate import cells as ab_cells
from serl_cli.ablate import grid as ab
from serl_cli.ablate import grid_record as ab_record
from serl_cli.ablate.report import write_report
from serl_cli.ablate.reuse import same_cell
from serl_cli.ablate.runners import SELF_CMD
from serl_cli.errors import SerlError

WRAPPER = "from serl_cli.cli import main\nmain()\n"


def _csv(path: Path) -> dict[str, dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return {r["arm"]: r for r in csv.DictReader(f)}


# -- the grid rule (no training) ------------------------------------------------------------


def test_flags_shorthand_builds_each_all_and_grpo():
    grid = ab.load_grid(flags={"env": "webshop", "sources": "error,obs,ref", "seeds": 3})
    names = [a["name"] for a in ab.arms(grid)]
    assert names == [
        "webshop-grpo",
        "webshop-serl-error-step-all",
        "webshop-serl-obs-step-all",
        "webshop-serl-ref-step-all",
        "webshop-serl-error+obs+ref-step-all",
    ]  # serl's default placement: all
    cells = ab.cells(grid)
    assert len(cells) == 15 and [c["seed"] for c in cells[:3]] == [0, 1, 2]
    assert cells[0]["name"] == "webshop-grpo-s0" and cells[3]["overrides"]["annotate"]["sources"] == "error"
    assert cells[-1]["overrides"]["annotate"]["sources"] == "error,obs,ref"


def test_final_eval_panel_is_optional_and_checked(tmp_path, tiny_model_dir):
    path = tiny_grid(tmp_path, tiny_model_dir)
    assert "panel" not in ab.load_grid(str(path)).final_eval  # absent: the first tasks, as grids always meant
    data = yaml.safe_load(path.read_text())
    data["final_eval"]["panel"] = "spread"
    path.write_text(yaml.safe_dump(data))
    assert ab.load_grid(str(path)).final_eval == {"episodes": 2, "split": "test", "panel": "spread"}
    data["final_eval"]["panel"] = "last"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SerlError, match="final_eval.panel 'last' is unknown"):
        ab.load_grid(str(path))


def test_non_annotating_algos_get_one_arm_and_names_are_safe():
    grid = ab.load_grid(
        flags={
            "algo": "grpo,gigpo,serl,rlsd",
            "sources": "ref|error",
            "placement": "feedback,random",
            "granularity": "step,anchor",
        }
    )
    names = [a["name"] for a in ab.arms(grid)]
    assert names.count("webshop-grpo") == 1 and names.count("webshop-gigpo") == 1
    assert len([n for n in names if "-serl-" in n]) == 4  # 2 granularities x 2 placements
    assert len([n for n in names if "-rlsd-" in n]) == 2 and all(n.endswith("-all") for n in names if "-rlsd-" in n)
    assert "webshop-serl-ref_or_error-step-feedback" in names
    assert len(set(names)) == len(names)
    assert all(c not in n for n in names for c in "|/ ,")


def test_explicit_arms_carry_their_settings_and_name_the_baseline(tmp_path):
    path = tmp_path / "arms.yaml"
    spec = {
        "base": {"env": {"name": "sokoban"}, "annotate": {"sources": "obs", "placement": "all"}},
        "grid": {"seeds": 2},
        "arms": [
            {"name": "grpo", "algo": "grpo", "set": {"train": {"optim": {"lr": 3.0e-4}}}},
            {
                "name": "serl plain",
                "algo": "serl",
                "placement": "feedback",
                "sources": "error",
                "set": {"model": "other/warm_start", "annotate": {"weight_clip": 0.5}},
            },
            {"name": "sdpo", "algo": "sdpo"},
        ],
        "baseline": "grpo",
    }
    path.write_text(yaml.safe_dump(spec))
    grid = ab.load_grid(str(path))
    arms = ab.arms(grid)
    assert [a["name"] for a in arms] == ["grpo", "serlplain", "sdpo"]  # only the listed arms: no axis was given
    assert grid.baseline == "grpo" and ab_record.grid_record(grid, [])["baseline"] == "grpo"
    cells = {c["name"]: c["overrides"] for c in ab.cells(grid)}
    assert cells["grpo-s1"]["train"] == {"algo": "grpo", "seed": 1, "optim": {"lr": 3.0e-4}}
    serl = cells["serlplain-s0"]
    assert serl["model"] == "other/warm_start" and serl["annotate"] == {
        "weight_clip": 0.5,
        "sources": "error",
        "granularity": "step",
        "placement": "feedback",
    }  # the arm's own win
    assert cells["sdpo-s0"]["annotate"]["sources"] == "obs" and cells["sdpo-s0"]["train"]["distill_coef"] == 1.0
    # with an axis given, the product's arms come first
    path.write_text(yaml.safe_dump({**spec, "grid": {"algo": ["gigpo"], "seeds": 1}}))
    assert [a["name"] for a in ab.arms(ab.load_grid(str(path)))] == ["sokoban-gigpo", "grpo", "serlplain", "sdpo"]
    for bad, message in (
        (dict(spec, baseline="nope"), "baseline 'nope' is not an arm"),
        (dict(spec, arms=[{"name": "x", "algo": "serl", "set": {"trian": {}}}]), "trian"),
        (dict(spec, arms=[{"name": "x", "algo": "serl", "placement": "sometimes"}]), "sometimes"),
        (dict(spec, arms=[{"name": "x", "algo": "grpo"}, {"name": "x", "algo": "serl"}]), "share the name x"),
        (dict(spec, arms=[{"algo": "grpo"}]), "needs a name"),
    ):
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(SerlError, match=message):
            ab.load_grid(str(path))


def test_grid_json_is_fixed_and_a_different_grid_is_refused(tmp_path):
    rec = ab_record.grid_record(ab.load_grid(flags={"sources": "error,ref", "seeds": 2}), ["--sources", "error,ref"])
    ab_record.write_grid(tmp_path, rec)
    first = (tmp_path / "grid.json").read_bytes()
    again = ab_record.grid_record(ab.load_grid(flags={"sources": "error,ref", "seeds": 2}), ["x"])
    ab_record.write_grid(tmp_path, again)
    assert (tmp_path / "grid.json").read_bytes() == first
    with pytest.raises(SerlError, match="different ablation grid"):
        ab_record.write_grid(tmp_path, ab_record.grid_record(ab.load_grid(flags={"sources": "error", "seeds": 2}), []))
    # a grid.json written before a setting existed (here: without rollout.sampling.coupled) is the same grid
    older = json.loads(first)
    del older["base"]["rollout"]["sampling"]["coupled"]
    (tmp_path / "grid.json").write_text(json.dumps(older))
    ab_record.write_grid(tmp_path, rec)
    older["base"]["rollout"]["sampling"]["temperature"] = 0.5
    (tmp_path / "grid.json").write_text(json.dumps(older))
    with pytest.raises(SerlError, match="different ablation grid"):
        ab_record.write_grid(tmp_path, rec)


def test_ready_made_grids_load():
    folder = Path(__file__).parent.parent / "experiments" / "ablations"
    files = sorted(folder.glob("*.yaml"))
    assert {f.stem for f in files} >= {
        "sources",
        "granularity",
        "placement",
        "baselines",
        "sources_paper",
        "granularity_paper",
        "placement_paper",
        "baselines_paper",
    }
    for f in files:
        grid = ab.load_grid(str(f))
        assert ab.cells(grid), f


@pytest.mark.parametrize("env", ["webshop", "alfworld"])
def test_study_grids_load_and_share_the_serl_arm(env):
    """docs/RESULTS.md's grids: 5 seeds per arm, and the placement grid's feedback arm is the
    baselines grid's serl arm (same base), so its finished cells can be reused."""
    folder = Path(__file__).parent.parent / "experiments" / "study"
    grids = {f"{env}_{q}": ab.load_grid(str(folder / f"{env}_{q}.yaml")) for q in ("baselines", "sources", "placement")}
    for g in grids.values():
        assert g.axes["seeds"] == [0, 1, 2, 3, 4] and g.base["env"]["name"] == env
    assert grids[f"{env}_sources"].axes["sources"] == ["error", "ref", "diff", "obs", "future"]
    assert grids[f"{env}_sources"].axes["placement"] == ["all"]  # obs and future never fire at feedback placement
    baseline_cells = {c["name"]: c for c in ab.cells(grids[f"{env}_baselines"])}
    placement_cells = {c["name"]: c for c in ab.cells(grids[f"{env}_placement"])}
    shared = sorted(set(baseline_cells) & set(placement_cells))
    assert shared == [f"{env}-serl-ref_or_error-step-feedback-s{s}" for s in range(5)]
    assert all(
        ab.cell_overrides(grids[f"{env}_baselines"], baseline_cells[n]["params"], baseline_cells[n]["seed"])
        == ab.cell_overrides(grids[f"{env}_placement"], placement_cells[n]["params"], placement_cells[n]["seed"])
        for n in shared
    )
    assert grids[f"{env}_baselines"].base == grids[f"{env}_placement"].base
    assert len({json.dumps(g.final_eval, sort_keys=True) for g in grids.values()}) == 1  # one panel for all


def test_study_v3_webshop_grid_is_grpo_against_the_authors_serl():
    grid = ab.load_grid(str(Path(__file__).parent.parent / "experiments" / "study" / "webshop_v3_methods.yaml"))
    assert grid.base["env"]["name"] == "webshop" and grid.baseline == "grpo" and grid.axes["seeds"] == [0, 1]
    serl = {a["name"]: a for a in ab.arms(grid)}["serl-obs"]
    assert list({a["name"]: a for a in ab.arms(grid)}) == ["grpo", "serl-obs"]
    assert (serl["sources"], serl["placement"], grid.base["annotate"]["tokens"]) == ("obs", "all", "action")


def test_study_v3_grids_share_arms_cell_for_cell(tmp_path):
    """Study v3's five grids: 10 seeds per arm, one base and panel, and an arm in two grids is the
    same cell in both (``serl ablate --reuse`` copies it instead of training it again)."""
    folder = Path(__file__).parent.parent / "experiments" / "study"
    names = ("methods", "sources", "placement", "granularity", "mechanism")
    records = {n: ab_record.grid_record(ab.load_grid(str(folder / f"sokoban_v3_{n}.yaml")), []) for n in names}
    for rec in records.values():
        assert rec["axes"]["seeds"] == list(range(10)) and rec["base"] == records["methods"]["base"]
        assert (
            rec["baseline"] in [a["name"] for a in rec["arms"]]
            and rec["final_eval"] == records["methods"]["final_eval"]
        )
    cells = {}
    for rec in records.values():
        for c in rec["cells"]:
            if c["name"] in cells:
                assert same_cell(cells[c["name"]][1], cells[c["name"]][0], rec, c), c["name"]
            cells.setdefault(c["name"], (c, rec))
    assert len(cells) == 160  # 16 distinct arms x 10 seeds
    assert {c["overrides"]["train"]["algo"] for c, _ in cells.values()} == {"grpo", "gigpo", "rlsd", "sdpo", "serl"}
    plain = cells["serl-error+diff-feedback-plain-warm-start-s0"][0]["overrides"]
    assert plain["model"].endswith("warm_start_plain") and plain["annotate"]["placement"] == "feedback"
    assert cells["serl-error+diff-feedback-loose-s3"][0]["overrides"]["annotate"]["weight_clip"] == 1.0
    assert cells["grpo-plain-warm-start-s2"][0]["overrides"]["model"].endswith("warm_start_plain")


def _finish(out: Path, cell: dict, success: float, start_model: str | None = "embedded") -> None:
    """A cell as a finished run leaves it: its books (with the model it started from: the grid's
    base is the embedded default), its evaluation, its curve and a selection report."""
    d = ab_cells.cell_dir(out, cell)
    (d / "train" / "iter_0001").mkdir(parents=True)
    (d / "train" / "iter_0001" / "selection_report.json").write_text(json.dumps({"teacher": {}}))
    (d / "train" / "iter_0001" / "rollouts.jsonl").write_text("{}\n")  # a large artifact, not a summary
    (d / "train" / "metrics.jsonl").write_text(
        json.dumps({"iteration": 0, "env_steps": 10, "success_rate": success}) + "\n"
    )
    (d / "eval.json").write_text(json.dumps({"success_rate": success, "score": 100 * success, "episodes": 20}))
    (d / "cell.json").write_text(
        json.dumps(
            {
                "index": cell["index"],
                "name": cell["name"],
                "status": "done",
                "wall_time_s": 1.0,
                "start_model": start_model,
            }
        )
    )


@pytest.mark.slow
def test_reuse_copies_only_the_same_finished_cells_and_keep_rebuilds_the_report(tmp_path):
    src, dst, kept = tmp_path / "src", tmp_path / "dst", tmp_path / "kept"
    rec_src = ab_record.grid_record(ab.load_grid(flags={"algo": "grpo,gigpo", "seeds": 2}), [])
    ab_record.write_grid(src, rec_src)
    for cell in rec_src["cells"][:-1]:  # gigpo seed 1 unfinished
        _finish(src, cell, 0.25)
    grid = tmp_path / "grid.yaml"  # shares grpo; its gigpo arm has other settings, so it is another cell
    grid.write_text(
        yaml.safe_dump(
            {
                "grid": {"seeds": 2},
                "arms": [
                    {"name": "webshop-gigpo", "algo": "gigpo", "set": {"iterations": 7}},
                    {"name": "webshop-grpo", "algo": "grpo"},
                ],
            }
        )
    )
    p = run(str(grid), "--out", str(dst), "--reuse", str(src), "--emit", "slurm")  # books only, nothing trains
    assert p.returncode == 0, p.stderr
    assert "2 finished cells reused" in p.stdout
    rec_dst = json.loads((dst / "grid.json").read_text())
    done = {c["name"]: c["index"] for c in rec_dst["cells"] if ab_cells.is_done(dst, c)}
    assert done == {"webshop-grpo-s0": 2, "webshop-grpo-s1": 3}  # renumbered to this grid's cells
    assert json.loads((dst / "cells" / "webshop-grpo-s1" / "cell.json").read_text())["index"] == 3
    assert not (dst / "cells" / "webshop-gigpo-s0").exists()
    assert not list(dst.glob("cells/*.copying"))
    assert run(str(grid), "--out", str(dst), "--reuse", str(src), "--emit", "slurm").stdout.count("0 finished") == 1

    # the same cell by name and settings, but trained from another checkpoint (or one not recorded): not copied
    other = tmp_path / "other"
    ab_record.write_grid(other, rec_src)
    _finish(other, rec_src["cells"][0], 0.5, start_model="sha256:0123456789abcdef")  # grpo s0
    _finish(other, rec_src["cells"][1], 0.5, start_model=None)  # grpo s1
    dst2 = tmp_path / "dst2"
    p = run(str(grid), "--out", str(dst2), "--reuse", str(other), "--emit", "slurm")
    assert p.returncode == 0, p.stderr
    assert "0 finished cells reused" in p.stdout and "2 cells of" in p.stderr and "another model" in p.stderr
    assert not (dst2 / "cells").exists() or not list((dst2 / "cells").iterdir())

    p = run("--report", str(src), "--keep", str(kept))
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in (kept / "cells").iterdir()) == [
        "webshop-gigpo-s0",
        "webshop-grpo-s0",
        "webshop-grpo-s1",
    ]
    assert (kept / "cells" / "webshop-grpo-s0" / "train" / "iter_0001" / "selection_report.json").is_file()
    assert not (kept / "cells" / "webshop-grpo-s0" / "train" / "iter_0001" / "rollouts.jsonl").exists()
    assert float(_csv(kept / "report.csv")["webshop-grpo"]["success_mean"]) == 0.25  # built from the kept files
    assert not (src / "report.csv").exists()
    for args, line in (
        (("--report", str(src), "--keep", str(src)), "is the ablation directory itself"),
        ((str(grid), "--out", str(dst), "--keep", str(kept)), "--keep goes with --report"),
        ((str(grid), "--out", str(dst), "--reuse", str(tmp_path / "nope")), "not an ablation directory"),
    ):
        assert_one_line_error(run(*args), line)


# -- the report's numbers, on cells with known results -----------------------------------------


def test_report_numbers_match_scipy_on_known_cells(tmp_path):
    grid = ab.load_grid(flags={"sources": "error", "seeds": 3})  # grpo, serl-error
    rec = ab_record.grid_record(grid, [])
    ab_record.write_grid(tmp_path, rec)
    results = {"webshop-grpo": [0.2, 0.4, 0.3], "webshop-serl-error-step-all": [0.5, 0.45, 0.6]}
    for cell in rec["cells"][:-1]:  # leave the last one unfinished
        d = ab_cells.cell_dir(tmp_path, cell)
        d.mkdir(parents=True)
        s = results[cell["arm"]][cell["seed"]]
        (d / "eval.json").write_text(json.dumps({"success_rate": s, "score": 100 * s, "episodes": 20}))
        (d / "cell.json").write_text(json.dumps({"status": "done", "wall_time_s": 2.0, "teacher_tokens_scored": 10}))
    res = write_report(tmp_path)
    assert [u["index"] for u in res["unfinished"]] == [5]
    rows = _csv(tmp_path / "report.csv")
    g, s = rows["webshop-grpo"], rows["webshop-serl-error-step-all"]
    assert float(g["success_mean"]) == pytest.approx(0.3) and int(s["seeds_done"]) == 2
    lo, hi = stats.t.interval(0.95, 2, loc=0.3, scale=stats.sem([0.2, 0.4, 0.3]))
    assert float(g["success_ci_lo"]) == pytest.approx(lo) and float(g["success_ci_hi"]) == pytest.approx(hi)
    ref = stats.ttest_rel([0.5, 0.45], [0.2, 0.4])  # paired by seed over the seeds both finished
    assert float(s["p_success"]) == pytest.approx(ref.pvalue) and float(s["diff_success"]) == pytest.approx(0.175)
    assert float(s["teacher_tokens_total"]) == 20 and float(s["wall_time_s_total"]) == 4.0
    md = (tmp_path / "report.md").read_text()
    assert "0.300 ± 0.100" in md and "+0.175" in md and "Unfinished cells" in md
    assert "webshop-serl-error-step-all-s2" in md


def test_panel_curve_auc_budgets_and_holm_on_known_cells(tmp_path):
    from serl_cli.ablate.report import curve_auc, success_at_budget

    # trapezoids over env steps 100..400: (100 (0.2+0.4)/2 + 200 (0.4+0.4)/2) / 300 = (30 + 80) / 300
    points = [(100.0, 0.2), (200.0, 0.4), (400.0, 0.4)]
    assert curve_auc(points) == pytest.approx(110 / 300) and curve_auc(points[:1]) == 0.2 and curve_auc([]) is None
    assert success_at_budget(points, 99) is None and success_at_budget(points, 250) == 0.4
    assert success_at_budget(points, 150) == 0.2

    grid = ab.load_grid(flags={"algo": "grpo,serl,gigpo", "sources": "error", "seeds": 2})
    rec = ab_record.grid_record(grid, [])
    ab_record.write_grid(tmp_path, rec)
    panel = {
        "webshop-grpo": [[0.1, 0.3], [0.2, 0.2]],
        "webshop-serl-error-step-all": [[0.2, 0.5], [0.3, 0.3]],
        "webshop-gigpo": [[0.1, 0.2], [0.1, 0.4]],
    }
    for cell in rec["cells"]:
        d = ab_cells.cell_dir(tmp_path, cell)
        (d / "train").mkdir(parents=True)
        ys = panel[cell["arm"]][cell["seed"]]
        lines = [
            {
                "iteration": k,
                "env_steps": 50,
                "success_rate": 0.0,
                "advantage_mass_moved": 0.1 * k,
                **({"eval_success_rate": ys[k // 2]} if k % 2 else {}),
            }
            for k in range(4)
        ]
        (d / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (d / "eval.json").write_text(json.dumps({"success_rate": ys[-1], "score": 100 * ys[-1], "episodes": 20}))
        (d / "cell.json").write_text(json.dumps({"status": "done", "wall_time_s": 1.0}))
    write_report(tmp_path)
    rows = _csv(tmp_path / "report.csv")
    # evaluations at 100 and 200 cumulative steps: AUC is the mean of the two points
    aucs = {arm: [sum(y) / 2 for y in v] for arm, v in panel.items()}
    s, g = rows["webshop-serl-error-step-all"], rows["webshop-gigpo"]
    assert float(s["auc_mean"]) == pytest.approx(sum(aucs["webshop-serl-error-step-all"]) / 2)
    assert float(s["diff_auc"]) == pytest.approx((0.35 - 0.2 + 0.3 - 0.2) / 2)
    assert float(s["advantage_mass_moved"]) == pytest.approx(0.15)  # mean of 0, .1, .2, .3
    # every cell takes 50 steps an iteration: the two evaluation rounds fall at 100 and 200 steps
    assert float(s["success_at_100_steps"]) == pytest.approx(0.25) and float(
        s["success_at_200_steps"]
    ) == pytest.approx(0.4)
    assert "success_at_50_steps" not in s
    (p_lo, lo), (p_hi, hi) = sorted([(float(r["p_success"]), r) for r in (s, g)], key=lambda x: x[0])
    assert float(lo["p_success_holm"]) == pytest.approx(min(1.0, 2 * p_lo))  # two comparisons: x2, then x1
    assert float(hi["p_success_holm"]) == pytest.approx(max(min(1.0, 2 * p_lo), p_hi))
    md = (tmp_path / "report.md").read_text()
    assert "Holm p" in md and "100 steps" in md and "200 steps" in md and "panel AUC" in md


def test_contrasts_of_arms_are_paired_by_seed_on_known_cells(tmp_path):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(
        yaml.safe_dump(
            {
                "grid": {"seeds": 3},
                "arms": [
                    {"name": "grpo", "algo": "grpo"},
                    {"name": "gigpo", "algo": "gigpo"},
                    {"name": "rlsd", "algo": "rlsd"},
                ],
                "contrasts": [
                    {"name": "gigpo - grpo", "plus": ["gigpo"], "minus": ["grpo"]},
                    {"name": "both - twice grpo", "plus": ["gigpo", "rlsd"], "minus": ["grpo", "grpo"]},
                ],
            }
        )
    )
    rec = ab_record.grid_record(ab.load_grid(str(grid_file)), [])
    assert rec["contrasts"][1] == {"name": "both - twice grpo", "plus": ["gigpo", "rlsd"], "minus": ["grpo", "grpo"]}
    ab_record.write_grid(tmp_path / "abl", rec)
    success = {"grpo": [0.2, 0.4, 0.3], "gigpo": [0.3, 0.5, 0.5], "rlsd": [0.1, 0.2, None]}  # rlsd seed 2 unfinished
    for cell in rec["cells"]:
        s = success[cell["arm"]][cell["seed"]]
        if s is None:
            continue
        d = ab_cells.cell_dir(tmp_path / "abl", cell)
        d.mkdir(parents=True)
        (d / "eval.json").write_text(json.dumps({"success_rate": s, "score": 100 * s, "episodes": 20}))
        (d / "cell.json").write_text(json.dumps({"status": "done", "wall_time_s": 1.0}))
    res = write_report(tmp_path / "abl")
    first, second = res["contrasts"]
    # gigpo - grpo per seed: 0.1, 0.1, 0.2 (all three seeds)
    assert first["pairs_success"] == 3 and first["diff_success"] == pytest.approx(0.4 / 3)
    lo, hi = stats.t.interval(0.95, 2, loc=0.4 / 3, scale=stats.sem([0.1, 0.1, 0.2]))
    assert (first["diff_success_ci_lo"], first["diff_success_ci_hi"]) == (pytest.approx(lo), pytest.approx(hi))
    p1 = stats.ttest_rel([0.3, 0.5, 0.5], [0.2, 0.4, 0.3]).pvalue
    assert first["p_success"] == pytest.approx(p1)
    # gigpo + rlsd - 2 grpo over the seeds every named arm finished (0, 1):
    # 0.3 + 0.1 - 0.4 = 0.0, 0.5 + 0.2 - 0.8 = -0.1
    assert second["pairs_success"] == 2 and second["diff_success"] == pytest.approx(-0.05)
    p2 = stats.ttest_rel([0.4, 0.7], [0.4, 0.8]).pvalue
    assert second["p_success"] == pytest.approx(p2)
    # Holm over the two contrasts: the smaller p doubled, the larger kept (never below the smaller's adjusted)
    small, large = sorted([p1, p2])
    adjusted = sorted([first["p_success_holm"], second["p_success_holm"]])
    assert adjusted == [pytest.approx(min(1.0, 2 * small)), pytest.approx(max(min(1.0, 2 * small), large))]
    assert first["diff_auc"] is None and first["pairs_auc"] == 0  # no evaluations during training
    rows = list(csv.DictReader(open(tmp_path / "abl" / "contrasts.csv", newline="", encoding="utf-8")))
    assert [r["contrast"] for r in rows] == ["gigpo - grpo", "both - twice grpo"]
    md = (tmp_path / "abl" / "report.md").read_text()
    assert "## Contrasts (paired by seed)" in md and "| gigpo - grpo | gigpo | grpo | 3 | +0.133 |" in md


def test_contrasts_name_known_arms(tmp_path):
    def grid_with(contrasts) -> Path:
        path = tmp_path / "grid.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "grid": {"seeds": 1},
                    "contrasts": contrasts,
                    "arms": [{"name": "a", "algo": "grpo"}, {"name": "b", "algo": "gigpo"}],
                }
            )
        )
        return path

    for contrasts, message in [
        ([{"name": "x", "plus": ["a"], "minus": ["c"]}], "contrast 'x' names arm 'c'"),
        ([{"name": "x", "plus": [], "minus": ["a"]}], "contrast 'x' needs at least one plus arm"),
        ([{"name": "x", "plus": ["a"], "minus": ["b"], "sign": 1}], "unknown key contrasts[0].sign"),
        ([{"plus": ["a"]}], "contrasts[0] needs a name"),
        ([{"name": "x", "plus": ["a"]}, {"name": "x", "plus": ["b"]}], "two contrasts are named 'x'"),
        ({"name": "x"}, "contrasts: must be a list"),
    ]:
        with pytest.raises(SerlError, match=re.escape(message)):
            ab.load_grid(str(grid_with(contrasts)))
    assert_one_line_error(
        run(str(grid_with([{"name": "x", "plus": ["z"]}])), "--out", str(tmp_path / "o")), "names arm 'z'"
    )
    assert not (tmp_path / "o").exists()


def test_grid_json_takes_the_grid_files_new_contrasts_and_baseline(tmp_path):
    arms = [{"name": "a", "algo": "grpo"}, {"name": "b", "algo": "gigpo"}]
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"grid": {"seeds": 2}, "arms": arms}))
    ab_record.write_grid(tmp_path / "abl", ab_record.grid_record(ab.load_grid(str(path)), []))
    # the same cells with a baseline and a contrast added: the same grid, its report settings refreshed
    path.write_text(
        yaml.safe_dump(
            {
                "grid": {"seeds": 2},
                "arms": arms,
                "baseline": "b",
                "contrasts": [{"name": "a - b", "plus": ["a"], "minus": ["b"]}],
            }
        )
    )
    ab_record.write_grid(tmp_path / "abl", ab_record.grid_record(ab.load_grid(str(path)), []))
    rec = ab_record.load_grid_record(tmp_path / "abl")
    assert rec["baseline"] == "b" and rec["contrasts"] == [{"name": "a - b", "plus": ["a"], "minus": ["b"]}]


# -- end to end on the tiny model ----------------------------------------------------------


def test_tiny_grid_end_to_end(tmp_path, tiny_model_dir):
    grid = tiny_grid(tmp_path, tiny_model_dir)
    out = tmp_path / "abl"
    p = run(str(grid), "--out", str(out))
    assert p.returncode == 0, p.stderr
    for name in ("report.md", "report.csv", "curves.png", "grid.json"):
        assert (out / name).is_file(), name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec = json.loads((out / "grid.json").read_text())
    assert len(rec["cells"]) == 4
    rows = _csv(out / "report.csv")
    md = (out / "report.md").read_text()
    for arm in rec["arms"]:
        evals = [
            json.loads((out / "cells" / c["name"] / "eval.json").read_text())
            for c in rec["cells"]
            if c["arm"] == arm["name"]
        ]
        mean_success = sum(e["success_rate"] for e in evals) / len(evals)
        mean_score = sum(e["score"] for e in evals) / len(evals)
        assert float(rows[arm["name"]]["success_mean"]) == pytest.approx(mean_success)
        assert float(rows[arm["name"]]["score_mean"]) == pytest.approx(mean_score)
        assert f"| {arm['name']} | 2 | {mean_success:.3f} ±" in md
    for c in rec["cells"]:
        info = json.loads((out / "cells" / c["name"] / "cell.json").read_text())
        assert info["status"] == "done" and info["params"] == c["params"] and info["wall_time_s"] > 0
    assert sorted(p.name for p in (out / "cells").iterdir()) == sorted(c["name"] for c in rec["cells"])
    # --report over the finished directory alone
    p = run("--report", str(out))
    assert p.returncode == 0, p.stderr
    # the study's summary (experiments/study/summarize.py) adds up the cells' own metrics
    sys.path.insert(0, str(Path(__file__).parent.parent / "experiments" / "study"))
    import summarize

    for row in summarize.arm_rows(out):
        metrics = [
            json.loads(line)
            for c in rec["cells"]
            if c["arm"] == row["arm"]
            for line in (out / "cells" / c["name"] / "train" / "metrics.jsonl").read_text().splitlines()
        ]
        assert row["cells"] == 2 and row["turns"] == sum(m["turns"] for m in metrics) > 0
        assert row["optimizer_steps"] == sum(m.get("optimizer_steps", 0) for m in metrics)
        assert row["final_score_exact"] == [
            json.loads((out / "cells" / c["name"] / "eval.json").read_text())["score"]
            for c in rec["cells"]
            if c["arm"] == row["arm"]
        ]
    assert "(baseline)" in summarize.outcome_table(out)


def test_emit_slurm_is_valid_bash_and_task_k_runs_cell_k(tmp_path, tiny_model_dir):
    grid = tiny_grid(tmp_path, tiny_model_dir)
    out = tmp_path / "abl"
    p = run(str(grid), "--out", str(out), "--emit", "slurm")
    assert p.returncode == 0, p.stderr
    script = out / "ablate.sbatch"
    text = script.read_text()
    assert "#SBATCH --array=0-3" in text and "#SBATCH --partition=gpu" in text and "#SBATCH --gres=gpu:1" in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert '--cell "$SLURM_ARRAY_TASK_ID"' in text
    assert not (out / "cells").exists()
    # a task reads the grid the directory recorded: editing (here, breaking) the grid file after
    # submission changes no cell
    grid.write_text("grid: {algo: [grpo]\n", encoding="utf-8")
    wrapper = tmp_path / "serl_wrapper.py"
    wrapper.write_text(WRAPPER)
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "2", "SERL": f"{sys.executable} {wrapper}", "SERL_THREADS": "1"}
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    rec = json.loads((out / "grid.json").read_text())
    assert [d.name for d in (out / "cells").iterdir()] == [rec["cells"][2]["name"]]
    assert json.loads((out / "cells" / rec["cells"][2]["name"] / "cell.json").read_text())["status"] == "done"


def test_a_cell_runs_from_grid_json_after_the_grid_file_is_edited(tmp_path, tiny_model_dir):
    """`serl ablate GRID --out OUT --cell i` (how a cell runs by hand, or on a cluster of your
    own) once the ablation has started: the cell runs as OUT/grid.json records the grid, so an
    edit of the grid file meanwhile (here: 2 iterations instead of 1) breaks no later cell;
    a note says so. Before, every later cell failed: "holds a different ablation grid"."""
    grid = tiny_grid(tmp_path, tiny_model_dir, algos=("grpo",), seeds=2, iterations=1)
    out = tmp_path / "abl"
    assert run(str(grid), "--out", str(out), "--emit", "slurm").returncode == 0  # the ablation starts: grid.json
    recorded = (out / "grid.json").read_bytes()
    data = yaml.safe_load(grid.read_text())
    data["base"]["iterations"] = 2
    grid.write_text(yaml.safe_dump(data))
    p = run(str(grid), "--out", str(out), "--cell", "1")
    assert p.returncode == 0, p.stderr
    assert "has changed since the ablation started" in p.stderr and "runs as" in p.stderr
    rec = json.loads(recorded)
    cell = out / "cells" / rec["cells"][1]["name"]
    assert json.loads((cell / "cell.json").read_text())["status"] == "done"
    assert len((cell / "train" / "metrics.jsonl").read_text().splitlines()) == 1  # the recorded grid's 1 iteration
    assert (out / "grid.json").read_bytes() == recorded
    # a grid file broken or gone since: the same
    grid.write_text("grid: {algo: [grpo]\n")
    p = run(str(grid), "--out", str(out), "--cell", "1")
    assert p.returncode == 0 and "cannot be read now" in p.stderr, p.stderr
    grid.unlink()
    p = run(str(grid), "--out", str(out), "--cell", "1")
    assert p.returncode == 0 and "is gone" in p.stderr, p.stderr
    # a new ablation directory still reads the grid file as it is now
    p = run(str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "other"), "--cell", "0")
    assert p.returncode == 2 and "grid file not found" in p.stderr


def test_user_template(tmp_path):
    tpl = tmp_path / "tpl.sh"
    tpl.write_text("#!/bin/bash\n#SBATCH --array={array}\n#SBATCH --qos=low\nmodule load cuda\n{command}\n")
    p = run("--sources", "error", "--out", str(tmp_path / "abl"), "--emit", "slurm", "--slurm-template", str(tpl))
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "abl" / "ablate.sbatch").read_text()
    assert "#SBATCH --array=0-1\n" in text and "#SBATCH --qos=low" in text
    assert f"ablate --out {(tmp_path / 'abl').resolve()} --cell" in text  # the grid from OUT/grid.json
    assert subprocess.run(["bash", "-n", str(tmp_path / "abl" / "ablate.sbatch")]).returncode == 0


def test_killed_cell_resumes_and_finished_cells_are_not_redone(tmp_path, tiny_model_dir):
    grid = tiny_grid(tmp_path, tiny_model_dir, algos=("grpo",), iterations=3, tasks=2, max_turns=3)
    out = tmp_path / "abl"
    p = run(str(grid), "--out", str(out), "--cell", "0")
    assert p.returncode == 0, p.stderr
    rec = json.loads((out / "grid.json").read_text())
    done0 = out / "cells" / rec["cells"][0]["name"] / "eval.json"
    mtime0 = done0.stat().st_mtime_ns

    cell1 = out / "cells" / rec["cells"][1]["name"]
    proc = subprocess.Popen(
        [*SELF_CMD, "ablate", str(grid), "--out", str(out), "--cell", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "SERL_THREADS": "1"},
    )
    manifest = cell1 / "train" / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(manifest.read_text())["stages"].get("iter_0000", {}).get("status") == "done":
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not ab_cells.is_done(out, rec["cells"][1]), "the cell finished before it could be killed"
    iter0 = (cell1 / "train" / "iter_0000" / "rollouts.jsonl").stat().st_mtime_ns

    p = run(str(grid), "--out", str(out))  # rerun the whole array
    assert p.returncode == 0, p.stderr
    assert "skipped" in p.stdout and "resuming" in p.stdout
    assert done0.stat().st_mtime_ns == mtime0
    assert (cell1 / "train" / "iter_0000" / "rollouts.jsonl").stat().st_mtime_ns == iter0  # not redone
    info = json.loads((cell1 / "cell.json").read_text())
    assert info["status"] == "done" and info["attempts"] == 2 and (cell1 / "eval.json").is_file()
    iters = [json.loads(x)["iteration"] for x in (cell1 / "train" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(iters)) == [0, 1, 2]


# -- bad input -------------------------------------------------------------------------------


def test_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid: {algo: [grpo]}\nbase: {iterations: 1}\nsedes: 3\n")
    assert_one_line_error(run(str(bad), "--out", str(tmp_path / "a")), "unknown key sedes")
    bad.write_text("grid: {algoz: [grpo]}\n")
    assert_one_line_error(run(str(bad), "--out", str(tmp_path / "a")), "grid.algoz")
    bad.write_text("base: {iterationz: 2}\ngrid: {algo: [grpo]}\n")
    assert_one_line_error(run(str(bad), "--out", str(tmp_path / "a")), "base.iterationz")
    bad.write_text("grid: {algo: []}\n")
    assert_one_line_error(run(str(bad), "--out", str(tmp_path / "a")), "empty grid")
    bad.write_text("grid: {}\n")
    assert_one_line_error(run(str(bad), "--out", str(tmp_path / "a")), "empty grid")
    assert_one_line_error(
        run("--sources", "error", "--out", str(tmp_path / "b"), "--cell", "7"), "--cell 7 out of range"
    )
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    assert_one_line_error(run("--report", str(tmp_path / "c")), "not an ablation")


def test_report_names_how_the_final_evaluation_decoded():
    from serl_cli.ablate.report_render import _decoding

    assert _decoding({"base": {"eval": {"temperature": 0.4}}}) == "sampled at T 0.4"  # the paper's validation setting
    assert _decoding({"base": {"eval": {"temperature": 0.0}}}) == "greedy"
    assert _decoding({"base": {}}) == "greedy"  # a grid whose base sets no eval section: the default, greedy


def test_start_model_identity_is_by_content():
    """--reuse's check: a checkpoint retrained under the same path is another start; where it lies, its
    optimizer state and its update record (whose wall-clock timings differ on every rebuild) are not."""
    import tempfile

    with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
        a, b = Path(a_dir), Path(b_dir)
        for d in (a, b):
            (d / "config.json").write_text('{"hidden_size": 8}')
            (d / "model.safetensors").write_bytes(bytes(range(256)) * 4)
        (b / "trainer_state.pt").write_bytes(b"optimizer moments")
        (b / "serl_update.json").write_text('{"timing": {"update_s": 812.4}}')
        ident = ab_cells.start_model_identity(str(a))
        assert ident.startswith("sha256:") and ident == ab_cells.start_model_identity(str(b))
        weights = bytearray(bytes(range(256)) * 4)
        weights[100] ^= 1  # one bit retrained
        (b / "model.safetensors").write_bytes(bytes(weights))
        assert ab_cells.start_model_identity(str(b)) != ident
    assert ab_cells.start_model_identity(None) == "embedded"
    assert ab_cells.start_model_identity("Qwen/Qwen2.5-0.5B-Instruct") == "name:Qwen/Qwen2.5-0.5B-Instruct"
