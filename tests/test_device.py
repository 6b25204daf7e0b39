"""Device and precision (``serl_cli.models.device``): ``--device auto|cpu|cuda``, ``--dtype
auto|fp32|bf16|fp16``, SDPA attention, gradient checkpointing -- on the CPU.

Acceptance: ``--device cpu --dtype bf16`` trains and evaluates through ``torch.autocast``
(the matmuls run in bf16, the master weights stay fp32); the fp32 default runs the code it
ran before (no autocast, nothing moved). The CUDA paths are the same code with another
device; they are listed as untested in docs/SCALING.md.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from support import assert_one_line_error, rollout_config, serl, synthetic_env

from serl_cli.artifacts.schema import read_rollouts
from serl_cli.errors import SerlError
from serl_cli.models import device as dev
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.deepspeed_config import DeepSpeedConfig, resolve_config
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig, check_train_config

torch.set_num_threads(1)
NO_CUDA = not torch.cuda.is_available()


# ------------------------------------------------------------------------------ the words
def test_auto_is_the_cpu_here_and_fp32_there():
    if NO_CUDA:
        p = dev.resolve()
        assert p.device == torch.device("cpu") and p.dtype == torch.float32 and not p.half
        assert p.attn_implementation == "sdpa"  # transformers' own default here: the fp32 path is unchanged
        assert isinstance(p.autocast(), type(dev.Precision(torch.device("cpu"), torch.float32).autocast()))
    p = dev.resolve("cpu", "bf16")
    assert p.dtype == torch.bfloat16 and p.half and p.storage_dtype(training=False) == torch.float32
    assert dev.resolve("cpu", "fp16").dtype == torch.float16
    assert dev.attention_implementation("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"  # flash-attn: CUDA only


def test_bad_words_and_missing_cuda_are_one_line():
    with pytest.raises(SerlError, match="unknown device 'gpu': choose one of auto, cpu, cuda"):
        dev.resolve("gpu")
    with pytest.raises(SerlError, match="unknown dtype 'half': choose one of auto, fp32, bf16, fp16"):
        dev.resolve("cpu", "half")
    with pytest.raises(SerlError, match="unknown dtype"):
        check_train_config(TrainConfig(dtype="float8"))
    if NO_CUDA:
        with pytest.raises(SerlError, match="--device cuda: torch sees no CUDA device"):
            check_train_config(TrainConfig(device="cuda"))


def test_cli_refuses_cuda_without_a_gpu_before_writing(tiny_model_dir, tmp_path):
    if not NO_CUDA:
        pytest.skip("this machine has a GPU")
    out = tmp_path / "run"
    p = serl(
        "train",
        "--iterations",
        "1",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cuda",
        "--out",
        str(out),
        "--set",
        "env.settings.catalog=synthetic",
    )
    assert_one_line_error(p, "--device cuda: torch sees no CUDA device")
    assert not out.exists()
    p = serl(
        "eval",
        "--env",
        "webshop",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "fp8",
        "--episodes",
        "1",
        "--out",
        str(tmp_path / "e"),
        "--set",
        "env.settings.catalog=synthetic",
    )
    assert_one_line_error(p, "'--dtype'", "'fp8' is not one of")


def test_deepspeed_config_follows_train_dtype():
    optim = OptimConfig()
    for dtype, bf16, fp16 in (("bf16", True, False), ("fp16", False, True), ("fp32", False, False)):
        cfg = resolve_config(DeepSpeedConfig(), optim, bf16_available=True, dtype=dtype)
        assert (cfg["bf16"]["enabled"], cfg["fp16"]["enabled"]) == (bf16, fp16), dtype
    assert resolve_config(DeepSpeedConfig(), optim, bf16_available=True)["bf16"]["enabled"] is True  # auto: as before
    assert resolve_config(DeepSpeedConfig(), optim, bf16_available=False)["bf16"]["enabled"] is False


def test_deepspeed_file_that_contradicts_dtype_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(SerlError, match="bf16.enabled is True but train.dtype is fp32"):
        resolve_config(DeepSpeedConfig(config=str(path)), OptimConfig(), bf16_available=False, dtype="fp32")


# ------------------------------------------------------------------------------ on the tiny model
@pytest.fixture(scope="module")
def expert_episodes(tiny_model_dir, tmp_path_factory):
    """Expert turns for SFT: every turn has a gradient whatever the rewards."""
    run = tmp_path_factory.mktemp("device") / "expert"
    run_rollout(
        rollout_config(tiny_model_dir, run, policy="expert", tasks=1, group_size=1, env=synthetic_env(max_turns=2))
    )
    return read_rollouts(run)


class LinearDtypes:
    """The dtypes every nn.Linear computed in while active (a global forward hook)."""

    def __enter__(self):
        self.seen: set[torch.dtype] = set()
        self.handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output):
        if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            self.seen.add(output.dtype)

    def __exit__(self, *exc):
        self.handle.remove()


def _learner(model_dir, **train) -> Learner:
    return Learner(str(model_dir), TrainConfig(algo="sft", optim=OptimConfig(lr=1e-2), threads=1, seed=0, **train))


def _update(learner, episodes) -> dict:
    return learner.update(episodes, 1.0)


def test_bf16_on_cpu_trains_through_autocast_with_fp32_master_weights(tiny_model_dir, expert_episodes):
    fp32 = _learner(tiny_model_dir, device="cpu", dtype="fp32")
    bf16 = _learner(tiny_model_dir, device="cpu", dtype="bf16")
    before = {k: v.clone() for k, v in bf16.model.state_dict().items()}
    with LinearDtypes() as f32_seen:
        m32 = _update(fp32, expert_episodes)
    with LinearDtypes() as bf_seen:
        m16 = _update(bf16, expert_episodes)
    assert f32_seen.seen == {torch.float32}  # the default: no autocast anywhere
    assert bf_seen.seen == {torch.bfloat16}  # every matmul of the forward ran in bf16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # ... the weights stay fp32
    moved = max((bf16.model.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    assert moved > 0 and m16["optimizer_steps"] == 1 and m16["skipped_steps"] == 0
    # the same update in another precision: close, not equal
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05) and m16["loss"] != m32["loss"]


def test_fp16_on_cpu_scales_the_loss_and_saves_the_scaler(tiny_model_dir, expert_episodes, tmp_path):
    learner = _learner(tiny_model_dir, device="cpu", dtype="fp16")
    assert learner.backend.scaler is not None and learner.backend.scaler.get_scale() == 65536.0
    one_turn = [replace(expert_episodes[0], turns=expert_episodes[0].turns[:1])]  # fp16 matmuls are slow on CPUs
    with LinearDtypes() as seen:
        m = _update(learner, one_turn)
    assert seen.seen == {torch.float16} and m["optimizer_steps"] == 1
    path = learner.save(tmp_path / "ckpt")
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    assert "grad_scaler" in state
    resumed = Learner(str(path), learner.cfg, state_file=path / "trainer_state.pt")
    assert resumed.backend.scaler.get_scale() == learner.backend.scaler.get_scale()


def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, expert_episodes):
    plain = _learner(tiny_model_dir, device="cpu", dtype="fp32")
    ckpt = _learner(tiny_model_dir, device="cpu", dtype="fp32", gradient_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.model.modules())
    a, b = _update(plain, expert_episodes), _update(ckpt, expert_episodes)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for (k, p), q in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), k


def test_cli_trains_and_evaluates_in_bf16_on_cpu(tiny_model_dir, tmp_path):
    """`serl train --device cpu --dtype bf16` (the online loop: rollouts on the trainer's
    autocast model, the update, a periodic evaluation) and `serl eval --dtype bf16`."""
    run, ev = tmp_path / "run", tmp_path / "eval"
    common = ["--set", "env.settings.catalog=synthetic"]
    p = serl(
        "train",
        "--iterations",
        "1",
        "--algo",
        "grpo",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "1",
        "--group-size",
        "2",
        "--max-turns",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--out",
        str(run),
        "-q",
        "--set",
        "rollout.sampling.max_new_tokens=6",
        "--set",
        "eval.episodes=1",
        *common,
    )
    assert p.returncode == 0, p.stderr
    cfg = (run / "online.yaml").read_text()
    assert "dtype: bf16" in cfg and "device: cpu" in cfg
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "eval_success_rate" in metrics
    p = serl(
        "eval",
        "--env",
        "webshop",
        "--model",
        str(run / "checkpoint"),
        "--episodes",
        "1",
        "--max-turns",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--out",
        str(ev),
        "-q",
        "--set",
        "max_new_tokens=6",
        *common,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads((ev / "eval.json").read_text())["episodes"] == 1
    assert "dtype: bf16" in (ev / "eval_config.yaml").read_text()


def test_hf_engine_and_eval_policy_run_under_autocast(tiny_model_dir):
    from serl_cli.rollout.engines import model_policy

    policy = model_policy(str(tiny_model_dir), device="cpu", dtype="bf16", max_new_tokens=4)
    model = policy.engine.model
    assert dev.precision_of(model).dtype == torch.bfloat16 and model.dtype == torch.float32  # fp32 weights on the CPU
    with LinearDtypes() as seen:
        gens = policy.engine.generate([[1, 2, 3, 4]], SamplingConfig(0.0, 1.0, 4), seed=0)
    assert seen.seen == {torch.bfloat16} and len(gens[0].token_ids) == 4
    with LinearDtypes() as seen:
        model_policy(str(tiny_model_dir), max_new_tokens=4).engine.generate(
            [[1, 2, 3, 4]], SamplingConfig(0.0, 1.0, 4), 0
        )
    assert seen.seen == {torch.float32}


def test_annotate_scores_with_the_teacher_in_bf16(tiny_model_dir, tmp_path):
    """`serl annotate RUN --device cpu --dtype bf16`: the teacher's log-probs are bf16 autocast
    numbers, close to the fp32 ones and not equal to them."""
    run = tmp_path / "run"
    run_rollout(
        rollout_config(tiny_model_dir, run, tasks=1, group_size=2, max_new_tokens=6, env=synthetic_env(max_turns=2))
    )
    scores = {}
    for dtype in ("fp32", "bf16"):
        p = serl(
            "annotate",
            str(run),
            "--sources",
            "obs",
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--overwrite",
            "-q",
            "--set",
            "skip_zero_advantage=false",
            "--set",
            "mixing_lambda=1.0",
        )
        assert p.returncode == 0, p.stderr
        rows = [json.loads(line) for line in (run / "annotations.jsonl").read_text().splitlines()]
        scores[dtype] = [x for r in rows for x in (r.get("teacher_logprobs") or [])]
    assert scores["fp32"] and len(scores["fp32"]) == len(scores["bf16"])
    gap = max(abs(a - b) for a, b in zip(scores["fp32"], scores["bf16"], strict=True))
    assert 0 < gap < 0.5
