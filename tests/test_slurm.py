"""``serl ablate --emit slurm``: a cell is a distributed job.

Acceptance: on a paper grid the sbatch asks for the cell's GPUs, launches torchrun across
them, caps concurrent tasks (``%N``), and a submit script chains the report job after the
array (``--dependency=afterany``). Then the emitted script itself, run by bash here (no
SLURM): a DeepSpeed cell under torchrun on two CPU processes, and a cell stopped by SIGUSR1
(SLURM's time-limit warning) that requeues itself through ``scontrol`` and resumes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import run, tiny_grid

from serl_cli.ablate import cells as ab_cells
from serl_cli.ablate import grid as ab
from serl_cli.ablate import grid_checks
from serl_cli.ablate import grid_record as ab_record
from serl_cli.errors import SerlError

ROOT = Path(__file__).resolve().parent.parent
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def bash_ok(path: Path) -> bool:
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, check=False).returncode == 0


def test_paper_grid_sbatch_runs_torchrun_on_the_cells_gpus(tmp_path):
    out = tmp_path / "abl"
    p = run(
        str(ROOT / "experiments" / "ablations" / "sources_paper.yaml"),
        "--out",
        str(out),
        "--emit",
        "slurm",
        "--max-parallel",
        "3",
    )
    assert p.returncode == 0, p.stderr
    text = (out / "ablate.sbatch").read_text()
    n = len(json.loads((out / "grid.json").read_text())["cells"])
    for line in (
        f"#SBATCH --array=0-{n - 1}%3",
        "#SBATCH --nodes=1",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --mem=256G",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=48:00:00",
        "#SBATCH --signal=B:USR1@900",
        "#SBATCH --requeue",
    ):
        assert line in text.splitlines(), line
    # the setup activates $SERL_VENV: its python runs torchrun (not the interpreter that wrote the script)
    assert "${TORCHRUN:-python -m torch.distributed.run} --standalone --nproc_per_node 8 " in text
    assert "--signals-to-handle SIGTERM,SIGINT,SIGUSR1" in text and "-m serl_cli ablate" in text
    assert '--cell "$SLURM_ARRAY_TASK_ID"' in text and 'source "${SERL_VENV:?' in text  # the grid's setup line
    assert 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in text
    submit, report = (out / "submit.sh").read_text(), (out / "report.sbatch").read_text()
    assert f"sbatch --parsable {out.resolve()}/ablate.sbatch" in submit
    assert f'sbatch --parsable --dependency=afterany:"$array" {out.resolve()}/report.sbatch' in submit
    assert f"ablate --report {out.resolve()}" in report and "--gres" not in report
    assert all(bash_ok(out / f) for f in ("ablate.sbatch", "submit.sh", "report.sbatch"))
    # the grid's own cap when no flag is given
    p = run(str(ROOT / "experiments" / "ablations" / "sources_paper.yaml"), "--out", str(out), "--emit", "slurm")
    assert f"#SBATCH --array=0-{n - 1}%4" in (out / "ablate.sbatch").read_text()


def _grid(tmp_path: Path, model: Path, slurm: dict, base: dict | None = None, **kw) -> Path:
    path = tiny_grid(tmp_path, model, **kw)
    data = yaml.safe_load(path.read_text())
    data["slurm"] = slurm
    for section, values in (base or {}).items():
        if isinstance(values, dict):
            data["base"].setdefault(section, {}).update(values)
        else:  # a top-level setting (max_staleness)
            data["base"][section] = values
    path.write_text(yaml.safe_dump(data))
    return path


def test_multi_node_and_deepspeed_launchers(tmp_path, tiny_model_dir):
    ds = {"train": {"backend": "deepspeed"}}
    grid = _grid(tmp_path, tiny_model_dir, {"nodes": 2, "gpus_per_node": 4, "account": "lab"}, ds, name="a.yaml")
    p = run(str(grid), "--out", str(tmp_path / "a"), "--emit", "slurm")
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "a" / "ablate.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --account=lab" in text
    # srun of Slurm 22.05-23.02 does not inherit sbatch's --cpus-per-task: the line asks for it again
    srun = "srun --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} --kill-on-bad-exit=1"
    assert f"{srun} ${{TORCHRUN:-{sys.executable} -m torch.distributed.run}} --nnodes 2" in text
    assert '--rdzv_endpoint "$head:$port"' in text and "--nproc_per_node 4" in text and "%" not in text.split("\n")[2]
    assert bash_ok(tmp_path / "a" / "ablate.sbatch")
    grid = _grid(
        tmp_path, tiny_model_dir, {"gpus_per_node": 2, "launcher": "deepspeed", "requeue": False}, ds, name="b.yaml"
    )
    assert run(str(grid), "--out", str(tmp_path / "b"), "--emit", "slurm").returncode == 0
    text = (tmp_path / "b" / "ablate.sbatch").read_text()
    assert f"${{DEEPSPEED:-{sys.executable} -m deepspeed.launcher.runner}} --num_nodes 1 --num_gpus 2" in text
    assert "--requeue" not in text and "--signal" not in text
    with pytest.raises(SerlError, match="unknown slurm.launcher 'mpirun'"):
        grid_checks.check_slurm({"launcher": "mpirun"})
    with pytest.raises(SerlError, match="not both"):
        grid_checks.check_slurm({"gpus": 1, "gpus_per_node": 2})
    with pytest.raises(SerlError, match="slurm.setup must be a list"):
        grid_checks.check_slurm({"setup": "module load cuda"})


def _fake_slurm(tmp_path: Path) -> dict:
    """scontrol on PATH that records what it was asked; the environment of an array task."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {log}\n')
    (bin_dir / "scontrol").chmod(0o755)
    wrapper = tmp_path / "serl_wrapper.py"
    wrapper.write_text("from serl_cli.cli import main\nmain()\n")
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_ARRAY_JOB_ID": "77",
        "SERL": f"{sys.executable} {wrapper}",
        "SERL_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "COLUMNS": "200",
    }


@pytest.mark.parametrize(
    ("how", "staleness"),
    [("USR1 to the batch shell", 0), ("TERM to every process of the job", 1)],
    ids=["usr1", "group-term"],
)
def test_a_stopped_task_is_requeued_and_the_rerun_resumes(tmp_path, tiny_model_dir, how, staleness):
    """SLURM's time-limit warning (``--signal=B:USR1@...``, to the batch shell), and its preemption
    (SIGTERM to every process of the job at once: the shell, the cell, its rollout producer): either
    way the cell checkpoints and exits 75, the task is requeued, and its rerun resumes."""
    grid = _grid(
        tmp_path,
        tiny_model_dir,
        {"signal_grace_s": 120},
        {"max_staleness": staleness} if staleness else None,
        algos=("grpo",),
        seeds=1,
        iterations=3,
    )
    out = tmp_path / "abl"
    assert run(str(grid), "--out", str(out), "--emit", "slurm").returncode == 0
    env = _fake_slurm(tmp_path)
    script = out / "ablate.sbatch"
    p = subprocess.Popen(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    rec = json.loads((out / "grid.json").read_text())
    manifest = out / "cells" / rec["cells"][0]["name"] / "train" / "manifest.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if manifest.is_file() and "iter_0000" in json.loads(manifest.read_text()).get("stages", {}):
            break
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1][-2000:]
    if staleness:
        os.killpg(p.pid, signal.SIGTERM)  # the shell leads its own session: every process of the task
    else:
        os.kill(p.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch shell
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 0, stderr[-2000:]
    assert "requeued" in stdout and (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77_0"]
    cell = json.loads((manifest.parent.parent / "cell.json").read_text())
    assert cell["status"] == "running" and not (manifest.parent.parent / "eval.json").exists()
    q = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=300, check=False
    )  # the requeued run
    assert q.returncode == 0, q.stderr[-2000:]
    assert json.loads((manifest.parent.parent / "cell.json").read_text())["status"] == "done"
    metrics = (manifest.parent / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["iteration"] for m in metrics] == [0, 1, 2]


@needs_deepspeed
def test_a_deepspeed_cell_runs_under_torchrun_from_the_sbatch(tmp_path, tiny_model_dir):
    """The emitted array task, run here: torchrun starts two DeepSpeed processes (CPU, gloo),
    both train the cell, rank 0 keeps the books and runs the final evaluation."""
    base = {"train": {"backend": "deepspeed", "threads": 1}}
    grid = _grid(tmp_path, tiny_model_dir, {"gpus_per_node": 2}, base, algos=("grpo",), seeds=1, iterations=1)
    data = yaml.safe_load(grid.read_text())
    data["base"]["rollout"]["sampling"]["coupled"] = True  # hf on two processes: a row's draws are its own
    grid.write_text(yaml.safe_dump(data))
    out = tmp_path / "abl"
    assert run(str(grid), "--out", str(out), "--emit", "slurm").returncode == 0
    text = (out / "ablate.sbatch").read_text()
    assert "--standalone --nproc_per_node 2" in text
    p = subprocess.run(
        ["bash", str(out / "ablate.sbatch")],
        capture_output=True,
        text=True,
        env=_fake_slurm(tmp_path),
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((out / "grid.json").read_text())
    d = out / "cells" / rec["cells"][0]["name"]
    assert json.loads((d / "cell.json").read_text())["status"] == "done" and (d / "eval.json").is_file()
    assert (d / "train" / "checkpoint" / "deepspeed").is_dir()  # trained by the DeepSpeed backend


def test_final_evaluation_runs_on_the_cells_engine_device_and_dtype(tmp_path, tiny_model_dir, monkeypatch):
    """The cell's online run is faked; its final evaluation gets the cell's engine (vLLM in the
    paper grids), vLLM settings and GPUs, and the trainer's device and dtype."""
    from serl_cli.online import loop as online
    from serl_cli.stages import evaluate

    grid = _grid(
        tmp_path,
        tiny_model_dir,
        {},
        {
            "rollout": {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}, "gpus": [6, 7]},
            "train": {"dtype": "bf16", "device": "cpu"},
        },
        algos=("grpo",),
        seeds=1,
    )
    rec = ab_record.grid_record(ab.load_grid(str(grid)), [str(grid)])
    out = tmp_path / "abl"
    ab_record.write_grid(out, rec)

    def fake_online(cfg, **kw):
        ckpt = Path(cfg.out) / "checkpoint"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text("{}")
        (Path(cfg.out) / "manifest.json").write_text(json.dumps({"stages": {"online": {"status": "done"}}}))

    seen = {}

    def fake_eval(ecfg, overwrite=False, **kw):
        seen.update(
            engine=ecfg.engine, tp=ecfg.vllm.tensor_parallel_size, gpus=ecfg.gpus, dtype=ecfg.dtype, device=ecfg.device
        )
        (Path(ecfg.out) / "eval.json").write_text(json.dumps({"success_rate": 0.0, "score": 0.0, "episodes": 2}))
        return {}

    monkeypatch.setattr(online, "run_online", fake_online)
    monkeypatch.setattr(evaluate, "run_eval", fake_eval)
    assert ab_cells.run_cell(rec, out, 0, log=lambda m: None) == "done"
    assert seen == {"engine": "vllm", "tp": 2, "gpus": [6, 7], "dtype": "bf16", "device": "cpu"}


def test_a_grid_without_resources_gets_defaults_and_this_interpreter(tmp_path, tiny_model_dir):
    """No time, CPUs or memory in the grid: the array asks for the documented defaults (and says
    so). The scripts run serl with the interpreter that wrote them, so a task runs with no
    `serl` on the job's PATH and no SERL override."""
    grid = _grid(tmp_path, tiny_model_dir, {}, algos=("grpo",), seeds=1, iterations=1)
    out = tmp_path / "abl"
    p = run(str(grid), "--out", str(out), "--emit", "slurm")
    assert p.returncode == 0, p.stderr
    assert "sets no time, cpus_per_task, mem" in p.stderr and "--time=24:00:00" in p.stderr
    lines = (out / "ablate.sbatch").read_text().splitlines()
    for line in ("#SBATCH --time=24:00:00", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=32G"):
        assert line in lines, line
    text = (out / "ablate.sbatch").read_text() + (out / "report.sbatch").read_text()
    assert "${SERL:-serl}" not in text and f"${{SERL:-{sys.executable} -m serl_cli}} ablate" in text
    # 8 GPUs per cell: 4 CPUs and 32G each
    grid8 = _grid(tmp_path, tiny_model_dir, {"gpus_per_node": 8, "time": "2:00:00"}, name="g8.yaml")
    p = run(str(grid8), "--out", str(tmp_path / "g8"), "--emit", "slurm")
    lines = (tmp_path / "g8" / "ablate.sbatch").read_text().splitlines()
    assert "#SBATCH --cpus-per-task=32" in lines and "#SBATCH --mem=256G" in lines and "#SBATCH --time=2:00:00" in lines
    assert "sets no cpus_per_task, mem" in p.stderr
    # the task itself, on a PATH without serl (nor this environment's bin folder)
    env = {k: v for k, v in _fake_slurm(tmp_path).items() if k != "SERL"}
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    q = subprocess.run(["bash", str(out / "ablate.sbatch")], capture_output=True, text=True, env=env, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    rec = json.loads((out / "grid.json").read_text())
    assert json.loads((out / "cells" / rec["cells"][0]["name"] / "cell.json").read_text())["status"] == "done"


@pytest.mark.parametrize(
    ("slurm", "needle"),
    [
        ({"partition": "gpu\n#SBATCH --wrap=rm"}, "slurm.partition must be one word"),
        ({"account": "my lab"}, "slurm.account must be one word"),
        ({"time": "1:00:00 --exclusive"}, "slurm.time must be one word"),
        ({"setup": ["module load cuda\nrm -rf ~"]}, "slurm.setup must not hold a line break"),
        ({"extra": ["--qos=high\n--wrap=x"]}, "slurm.extra must not hold a line break"),
    ],
)
def test_slurm_values_that_would_rewrite_the_script_are_refused(slurm, needle):
    with pytest.raises(SerlError, match=needle):
        grid_checks.check_slurm(slurm)


def test_slurm_values_of_the_usual_shapes_pass():
    grid_checks.check_slurm({"partition": "gpu-a100,gpu-h100", "account": "lab_1", "time": "2-00:00:00", "mem": "256G"})
