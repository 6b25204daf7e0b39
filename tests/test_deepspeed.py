"""The DeepSpeed backend: its configuration, equivalence with the torch backend (ZeRO 1/2/3,
one process; stage 2 with two processes under torchrun), Hugging Face checkpoints gathered
from ZeRO-3, resume from DeepSpeed's own checkpoint, skipped non-finite steps, bad input.

DeepSpeed runs on the CPU here (gloo). Its first initialize on a machine compiles a small
shared-memory op (about a minute, cached under $TORCH_EXTENSIONS_DIR, by default in
$SERL_CACHE_DIR/torch_extensions/<one folder per Python environment>).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed_worker import full_parameters, make_episodes, run, train_config
from support import assert_one_line_error, file_size_limit, serl

from serl_cli.errors import SerlError
from serl_cli.training.deepspeed_config import DeepSpeedConfig, default_config, resolve_config
from serl_cli.training.step import OptimConfig

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
needs_deepspeed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed (serl[deepspeed])"
)


# -- configuration (no DeepSpeed needed) ----------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_experiment_files_are_the_stage_defaults(stage):
    path = ROOT / "experiments" / "deepspeed" / f"zero{stage}.json"
    assert json.loads(path.read_text()) == default_config(stage)


def test_resolve_fills_serls_keys_and_overrides_the_stage(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 1},
                "gradient_clipping": "auto",
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
            }
        )
    )
    optim = OptimConfig(lr=3e-6, grad_clip=0.5, weight_decay=0.01)
    cfg = resolve_config(DeepSpeedConfig(config=str(path), zero_stage=3, offload=True), optim, bf16_available=False)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}  # stage 3 offloads parameters too
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["optimizer"]["params"] == {"lr": 3e-6, "torch_adam": True, "betas": [0.9, 0.999], "weight_decay": 0.01}
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["managed_gradient_accumulation"] is False
    assert cfg["bf16"]["enabled"] is False
    default = resolve_config(DeepSpeedConfig(), optim, bf16_available=True)
    assert default["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in default["zero_optimization"]
    assert default["bf16"] == {"enabled": True, "check_grad_overflow": True}  # "auto" on a bf16 accelerator


@needs_deepspeed
@pytest.mark.parametrize("source", ["default", "zero3.json", "zero2.json --zero-stage 3", "own choice"])
def test_zero3_accumulates_and_reduces_gradients_in_fp32(tmp_path, source):
    """What serl writes for ZeRO-3, read by DeepSpeed's own config parser: fp32 gradient
    accumulation and reduce-scatter under bf16 (without the keys, the model's dtype: bf16)."""
    from deepspeed.runtime.config import DtypeEnum, get_communication_data_type, get_data_types_params

    own = tmp_path / "own.json"
    own.write_text(
        json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "communication_data_type": "bf16"})
    )
    ds = {
        "default": DeepSpeedConfig(zero_stage=3),
        "zero3.json": DeepSpeedConfig(config=str(ROOT / "experiments/deepspeed/zero3.json")),
        "zero2.json --zero-stage 3": DeepSpeedConfig(
            config=str(ROOT / "experiments/deepspeed/zero2.json"), zero_stage=3
        ),
        "own choice": DeepSpeedConfig(config=str(own)),
    }[source]
    cfg = resolve_config(ds, OptimConfig(), bf16_available=True)
    assert cfg["bf16"]["enabled"] is True
    # the engine's get_data_types: DtypeEnum(grad_accum_dtype).value, the model's dtype when absent
    assert DtypeEnum(get_data_types_params(cfg)["grad_accum_dtype"]).value == torch.float32
    want = torch.bfloat16 if source == "own choice" else torch.float32  # a file's explicit choice stands
    assert get_communication_data_type(cfg) == want
    stage2 = resolve_config(DeepSpeedConfig(zero_stage=2), OptimConfig(), bf16_available=True)
    assert "data_types" not in stage2 and "communication_data_type" not in stage2  # ZeRO-3's keys only


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"zero_optimization": {"stage": 2},}', "malformed DeepSpeed JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"zero_optimization": {"stage": 4}}', "ZeRO stage must be 1, 2 or 3, got 4"),
        ('{"gradient_clipping": 5.0}', "gradient_clipping is 5.0 but serl sets it to 1.0"),
        ('{"train_batch_size": 64}', "train_batch_size"),
    ],
)
def test_resolve_refuses_bad_files(tmp_path, content, needle):
    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(SerlError, match=needle):
        resolve_config(DeepSpeedConfig(config=str(path)), OptimConfig(), bf16_available=False)
    with pytest.raises(SerlError, match="ZeRO stage must be 1, 2 or 3, got 0"):
        resolve_config(DeepSpeedConfig(zero_stage=0), OptimConfig(), bf16_available=False)


# -- bad input at the command line: one line, exit 2, nothing written ------------------------------
def _online(model_dir, out, *extra, env=None, preexec_fn=None):
    return serl(
        "train",
        "--iterations",
        "1",
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--tasks",
        "1",
        "--group-size",
        "2",
        "--backend",
        "deepspeed",
        "--set",
        "env.settings.catalog=synthetic",
        *extra,
        env=env,
        preexec_fn=preexec_fn,
    )


def test_cli_bad_deepspeed_input(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2')
    out = tmp_path / "run"
    assert_one_line_error(
        _online(tiny_model_dir, out, "--deepspeed-config", str(bad)), "malformed DeepSpeed JSON", "bad.json"
    )
    assert_one_line_error(_online(tiny_model_dir, out, "--zero-stage", "5"), "ZeRO stage must be 1, 2 or 3, got 5")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # as if not installed\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    assert_one_line_error(_online(tiny_model_dir, out, env=env), "--backend deepspeed needs DeepSpeed")
    assert not out.exists()


@needs_deepspeed
def test_disk_full_in_deepspeeds_checkpoint_is_one_line(tiny_model_dir, tmp_path):
    """DeepSpeed writes its engine state with torch.save to a path, and torch reports a failed
    write there as a RuntimeError without an errno ("unexpected pos"). Under a 10 MB file limit
    its model states (13 MB, the first file it writes) do not fit; that is still one line naming
    the checkpoint, with no staging folder left."""
    out = tmp_path / "run"
    p = _online(tiny_model_dir, out, "-q", preexec_fn=file_size_limit(10_000_000))
    checkpoint = out / "iter_0000" / "checkpoint"
    assert_one_line_error(p, f"could not write {checkpoint}: torch.save's write failed (disk full?)")
    assert not checkpoint.exists() and not list(out.rglob(".*.partial"))


# -- equivalence ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_result(tiny_model_dir):
    return run(str(tiny_model_dir), train_config("torch"))


@pytest.fixture(scope="module")
def zero_results(tiny_model_dir):
    pytest.importorskip("deepspeed")
    return {stage: run(str(tiny_model_dir), train_config("deepspeed", stage)) for stage in (1, 2, 3)}


def assert_same_run(a: dict, b: dict, tol: float) -> None:
    assert len(a["losses"]) == len(b["losses"]) == 3
    for x, y in zip(a["losses"], b["losses"], strict=True):
        assert abs(x - y) <= tol, (a["losses"], b["losses"])
    assert sorted(a["params"]) == sorted(b["params"])
    worst = max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
    assert worst <= tol, worst


@needs_deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_torch(torch_result, zero_results, tiny_model_dir, stage):
    result = zero_results[stage]
    assert_same_run(result, torch_result, TOL)
    # the run really trained: the losses move and the weights moved far more than the tolerance
    assert abs(torch_result["losses"][2] - torch_result["losses"][0]) > 1e-2
    from serl_cli.models.loading import load_model

    start, _ = load_model(str(tiny_model_dir))
    moved = max((torch_result["params"][n] - p).abs().max().item() for n, p in start.named_parameters())
    assert moved > 2 * TOL


@needs_deepspeed
def test_stage2_two_processes_match_one(zero_results, tiny_model_dir, tmp_path):
    out = tmp_path / "two.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "tests" / "deepspeed_worker.py"),
            str(tiny_model_dir),
            str(out),
            "--zero-stage",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(torch.load(out), zero_results[2], 1e-4)


def _micro_batch_count(model_dir) -> int:
    from serl_cli.algos.batch import make_micro_batches
    from serl_cli.artifacts.schema import turn_samples
    from serl_cli.models.loading import load_model

    samples = turn_samples(make_episodes(str(model_dir)))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].action_ids))
    _, tok = load_model(str(model_dir))
    return len(make_micro_batches(samples, order, train_config().optim.micro_batch_tokens, tok.pad_token_id))


def test_the_batch_exercises_uneven_data_parallel_shares(tiny_model_dir):
    """An odd number of micro-batches: under two processes one of them runs a stand-in pass."""
    assert _micro_batch_count(tiny_model_dir) % 2 == 1


# -- checkpoints and resume -----------------------------------------------------------------------
@needs_deepspeed
def test_zero3_checkpoint_is_hf_and_resumes_exactly(zero_results, tiny_model_dir, tmp_path):
    from serl_cli.models.loading import load_model
    from serl_cli.training.learner import Learner

    cfg = train_config("deepspeed", 3)
    episodes = make_episodes(str(tiny_model_dir))
    learner = Learner(str(tiny_model_dir), cfg)
    first = learner.update(episodes, 1.0)["loss"]
    ckpt = learner.save(tmp_path / "ckpt")
    assert (ckpt / "config.json").is_file() and (ckpt / "deepspeed" / "state").is_dir()
    saved, _ = load_model(str(ckpt))  # what serl eval / serl rollout load
    for name, p in full_parameters(learner).items():
        assert torch.equal(dict(saved.named_parameters())[name].float(), p), name

    resumed = Learner(str(ckpt), cfg, state_file=ckpt / "trainer_state.pt")
    assert resumed.updates == 1
    losses = [first] + [resumed.update(episodes, 1.0)["loss"] for _ in range(2)]
    assert_same_run({"losses": losses, "params": full_parameters(resumed)}, zero_results[3], 1e-6)


@needs_deepspeed
def test_non_finite_loss_skips_the_step(tiny_model_dir):
    from serl_cli.training.learner import Learner

    episodes = make_episodes(str(tiny_model_dir))
    episodes[0].turns[0].behaviour_logprobs[0] = float("nan")
    learner = Learner(str(tiny_model_dir), train_config("deepspeed", 2))
    before = full_parameters(learner)
    metrics = learner.update(episodes, 1.0)
    assert metrics["skipped_steps"] == 1 and math.isnan(metrics["loss"])
    assert all(torch.equal(before[n], p) for n, p in full_parameters(learner).items())


SOLO_GROUP = """
import os, subprocess, sys
from serl_cli.training.distributed import import_deepspeed, init_distributed
init_distributed(import_deepspeed())  # this process's group of one, its store on MASTER_PORT
if sys.argv[1:] == ["parent"]:  # a child inherits RANK/MASTER_PORT: it must make its own group, on another port
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True)
    sys.stderr.write(child.stderr)
    print(child.stdout.strip(), os.environ["MASTER_PORT"])
    sys.exit(child.returncode)
print(os.environ["MASTER_PORT"])
"""


@needs_deepspeed
def test_a_child_of_a_group_of_one_makes_its_own_group(tmp_path):
    # pytest and `serl ablate` start serl processes from a process that already holds a group of one
    script = tmp_path / "solo.py"
    script.write_text(SOLO_GROUP)
    p = subprocess.run(
        [sys.executable, str(script), "parent"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SERL_THREADS": "1"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    child_port, parent_port = p.stdout.split()[-2:]
    assert child_port != parent_port


GROUP_TIMEOUTS = """
import torch, torch.distributed as dist
from deepspeed.utils import groups
from serl_cli.training.distributed import import_deepspeed, init_distributed
init_distributed(import_deepspeed(), timeout_s=77)
cpu = torch.device("cpu")
made = dist.new_group([0])  # as DeepSpeed makes its groups: comm/torch.py new_group(ranks), no timeout
print(dist.group.WORLD._get_backend(cpu).options._timeout.total_seconds(),
      made._get_backend(cpu).options._timeout.total_seconds(),
      groups._get_data_parallel_group()._get_backend(cpu).options._timeout.total_seconds())
"""


@needs_deepspeed
def test_every_process_group_times_out_after_dist_timeout_s(tmp_path):
    """train.dist_timeout_s bounds every group, not only the world group: DeepSpeed's own groups took
    torch's default (30 minutes under gloo, 10 under NCCL), so a rank whose peer died waited that long."""
    script = tmp_path / "timeouts.py"
    script.write_text(GROUP_TIMEOUTS)
    p = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SERL_THREADS": "1"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-3:] == ["77.0", "77.0", "77.0"]


@needs_deepspeed
def test_a_lock_left_by_a_killed_process_does_not_hold_the_next_one(tmp_path):
    """torch's JIT leaves its baton file (``lock``) in the op's build folder when the process that held
    it is killed, and every later DeepSpeed initialize waited for it forever: serl removes it under
    an flock that dies with its holder (training.distributed.load_shm_op)."""
    import fcntl

    from serl_cli.training.distributed import extensions_dir

    # a copy of the op's folder (built once, about 1 MB): the shared one is other tests' to use at the
    # same time, and another process's real baton there would look like the stale one left here
    extensions = tmp_path / "torch_extensions"
    if extensions_dir().is_dir():
        shutil.copytree(extensions_dir(), extensions, ignore=shutil.ignore_patterns("lock", "*.serl-lock"))
    (extensions / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    stale = extensions / "deepspeed_shm_comm" / "lock"
    with open(extensions / ".deepspeed_shm_comm.serl-lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # as a serl process would hold it, then be killed
        stale.touch()
    script = tmp_path / "timeouts.py"
    script.write_text(GROUP_TIMEOUTS)
    env = {**os.environ, "SERL_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions)}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not stale.exists()


@needs_deepspeed
def test_the_lr_schedule_runs_in_the_engine_and_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    """train.optim.schedule under DeepSpeed: the engine steps serl's scheduler after each applied
    step (the lrs the torch backend reports) and keeps its step in the engine's checkpoint."""
    import dataclasses

    from serl_cli.training.learner import Learner

    optim = {"lr": 1e-3, "schedule": "linear", "warmup_steps": 2, "total_steps": 8}

    def config(backend, stage=None):
        cfg = train_config(backend, stage)
        return dataclasses.replace(cfg, mini_batches=2, optim=dataclasses.replace(cfg.optim, **optim))

    episodes = make_episodes(str(tiny_model_dir))
    torch_lrs = [Learner(str(tiny_model_dir), config("torch")).update(episodes, 1.0)["lr"]]
    learner = Learner(str(tiny_model_dir), config("deepspeed", 1))
    assert learner.update(episodes, 1.0)["lr"] == pytest.approx(torch_lrs[0]) == 1e-3 * 0.25  # steps 0, 1: 0, 1/2
    ckpt = learner.save(tmp_path / "ckpt")
    resumed = Learner(str(ckpt), config("deepspeed", 1), state_file=ckpt / "trainer_state.pt")
    assert resumed.update(episodes, 1.0)["lr"] == pytest.approx(1e-3 * (1 + 5 / 6) / 2)  # steps 2, 3


@needs_deepspeed
def test_a_teacher_with_zero_hpz_partitions_is_refused_before_anything_loads(tmp_path):
    """ZeRO++'s node-local parameter copy would hide the teacher's swapped-in weights from every gather
    (docs/SCALING.md): a run with a teacher refuses zero_hpz_partition_size > 1; one without takes it."""
    from serl_cli.online.config import OnlineConfig, check_online_config

    hpz = tmp_path / "zero3_hpz.json"
    hpz.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}))

    def online(algo: str, config: str | None) -> OnlineConfig:
        cfg = OnlineConfig(iterations=2)
        cfg.train.algo, cfg.train.backend, cfg.train.deepspeed.config = algo, "deepspeed", config
        return cfg

    with pytest.raises(SerlError, match=r"zero_hpz_partition_size is 8 in .*zero3_hpz.json: serl's teacher"):
        check_online_config(online("serl", str(hpz)))
    check_online_config(online("grpo", str(hpz)))  # no teacher: the copy is safe
    check_online_config(online("serl", None))  # serl's own ZeRO configs leave it at 1
