"""The Sokoban runs the asynchronous-pipeline tests compare (tests/test_async_rollouts.py), and the
reference the synchronous loop left before the pipeline existed (tests/fixtures/sync_loop_reference.json).

``python tests/async_runs.py`` writes that reference again (only ever from a commit whose
synchronous loop is the one to keep: it is what ``max_staleness: 0`` must reproduce).

The policy is serl's micro model with the four move words' output rows pointed along the mean
final hidden state of its reply positions (:func:`boost_moves`): a random model writes no move
and earns the same reward in every episode (every advantage 0, nothing trained); this one moves
at random with one-token replies, so episodes differ and every iteration's update has turns
with gradient.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from envs.sokoban.env import SokobanWorld
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.models.loading import load_model
from serl_cli.models.tiny import init_model
from serl_cli.online.config import OnlineConfig
from serl_cli.rollout.default_model import tokenizer_corpus
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig, run_rollout
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

REFERENCE = Path(__file__).parent / "fixtures" / "sync_loop_reference.json"
COMPACT = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)
MOVES = ("up", "down", "left", "right")
ITERATIONS = 4


@torch.no_grad()
def boost_moves(model, tokenizer, prompts: list[list[int]], mean_logit: float = 6.0) -> None:
    """The move words' (tied) embedding rows along the mean final hidden state after ``prompts``,
    in place, so each move's logit there averages ``mean_logit``: the other ~530 ids' logits are
    about N(0, 0.3), so a one-token reply is a move nine times in ten."""
    g = torch.Generator().manual_seed(0)
    hidden = []
    for ids in prompts:
        reply = torch.randint(0, len(tokenizer), (3,), generator=g).tolist()
        out = model(torch.tensor([ids + reply]), output_hidden_states=True)
        hidden.append(out.hidden_states[-1][0, len(ids) - 1 :])
    hidden = torch.cat(hidden)
    direction = hidden.mean(0) / hidden.mean(0).norm()
    scale = mean_logit / (hidden @ direction).mean()
    rows = model.get_input_embeddings().weight
    for word in MOVES:
        rows[tokenizer.encode(word, add_special_tokens=False)[0]] = scale * direction


def mover_model(base: Path) -> Path:
    """The micro model on Sokoban text, its moves boosted; saved under ``base``."""
    torch.set_num_threads(1)
    micro = init_model("micro", base / "micro", tokenizer_corpus(SokobanWorld(), episodes=50), seed=0)
    probe = run_rollout(
        RolloutConfig(
            env=sokoban_env(),
            model=str(micro),
            tasks=2,
            group_size=2,
            sampling=SamplingConfig(1.0, 1.0, 3),
            prompt=COMPACT,
            threads=1,
            out=str(base / "probe"),
        )
    )
    del probe
    prompts = [t["prompt_ids"] for t in turns(base / "probe")]
    model, tokenizer = load_model(str(micro))
    boost_moves(model, tokenizer, prompts[:8])
    out = base / "mover"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sokoban_env() -> EnvConfig:
    return EnvConfig(name="sokoban", split="train", max_turns=4, settings={"end_on_deadlock": True})


def run_config(algo: str, model: Path, out: Path, **top) -> OnlineConfig:
    """A 4-iteration Sokoban run of ``algo`` (grpo, serl): 3 rooms x 2, one-token replies, one thread."""
    return OnlineConfig(
        env=sokoban_env(),
        model=str(model),
        iterations=ITERATIONS,
        seed=5,
        out=str(out),
        rollout=RolloutConfig(tasks=3, group_size=2, sampling=SamplingConfig(1.0, 1.0, 1), prompt=COMPACT, threads=1),
        train=TrainConfig(algo=algo, optim=OptimConfig(lr=1e-4), mini_batches=2, invalid_action_penalty=0.1, threads=1),
        # the teacher signal on every iteration, as the loop checked it when the reference was recorded
        annotate=AnnotateConfig(sources="error,diff", placement="feedback", teacher_signal_every=1),
        **{"keep_last": 0, **top},
    )


def turns(rollout: Path) -> list[dict]:
    """Every stored turn of ``rollout``/rollouts.jsonl, in order."""
    return [t for line in (rollout / "rollouts.jsonl").open() for t in json.loads(line)["turns"]]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def machine() -> str:
    """What CPU arithmetic depends on: two machines that agree here give the same bytes. The CPU's
    model counts: the same torch build at the same capability (AVX512) rounds differently on an
    AMD EPYC than where the reference was recorded (its model was not kept, so no machine matches
    it now and the reference is compared as numbers)."""
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {cpu_model()}"


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def summary(run: Path) -> dict:
    """What a run left, for comparison: file hashes, and the numbers where bytes may differ."""
    from safetensors.torch import load_file

    its = [run / f"iter_{k:04d}" for k in range(ITERATIONS)]
    weights = load_file(run / "checkpoint" / "model.safetensors")
    return {
        "rollouts_sha256": [sha(it / "rollouts.jsonl") for it in its],
        "annotations_sha256": [
            sha(it / "annotations.jsonl") if (it / "annotations.jsonl").exists() else None for it in its
        ],
        "actions": [[t["action_ids"] for t in turns(it)] for it in its],
        "metrics": [json.loads(line) for line in (run / "metrics.jsonl").open()],
        "weights_sha256": sha(run / "checkpoint" / "model.safetensors"),
        "weight_sums": {name: float(t.double().sum()) for name, t in sorted(weights.items())},
    }


def write_reference(base: Path) -> None:
    from serl_cli.online.loop import run_online

    model = mover_model(base)
    reference = {"machine": machine()}
    for algo in ("grpo", "serl"):
        run_online(run_config(algo, model, base / algo))
        reference[algo] = summary(base / algo)
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_reference(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
