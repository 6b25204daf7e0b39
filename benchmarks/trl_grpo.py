"""A GRPO update in serl against one in TRL's ``GRPOTrainer``: same model, same batch, same loss.

    python -m benchmarks.trl_grpo [--catalog auto|real|synthetic] [--model DIR] [--tasks 4] [--group-size 4]
                                  [--max-turns 6] [--max-new-tokens 24] [--threads 1] [--seed 0]
                                  [--repeats 3] [--out FILE]

Needs ``trl`` (``pip install -e '.[bench]'``). The batch is ``benchmarks.train_step``'s: the
tiny model's own rollouts on the WebShop train split with its synthetic rewards (half of
every group succeeds, so every turn has advantage +-1 and no turn is skipped). Each turn
is one training row: its stored prompt ids + generated ids, its episode's group-normalized
advantage, its behaviour log-probs as the old log-probs of the PPO ratio.

The same update on both sides: fp32, ``--threads`` torch threads, token-level PPO-clip
(eps 0.2) divided by the batch's action-token count (serl's ``/ N_tokens``; TRL's
``loss_type="dapo"``), no KL term (TRL ``beta=0``), no entropy bonus, gradient clipping
at norm 1, AdamW (lr 1e-6, betas 0.9/0.999, eps 1e-8, no weight decay, constant
schedule), one optimizer step over the whole batch, no gradient checkpointing (TRL's
default is on; off here because serl does not checkpoint). Micro-batches get the same
budget: at most ``micro_batch_tokens`` (serl's default, 16384) padded tokens per forward.
serl packs length-sorted turns up to it; TRL takes ``per_device_train_batch_size`` rows per
forward, set to the largest divisor of the row count whose rows x padded width fits it
(TRL pads every row to the batch's longest prompt + longest completion), with
``gradient_accumulation_steps`` = rows / that.

What each timing holds:

* serl: the whole ``Learner.update`` call: flattening episodes to turns, advantages,
  collating the micro-batches from token-id lists, forward + backward of each, gradient
  clipping, ``AdamW.step`` (``foreach=False``).
* TRL: one optimizer step of ``Trainer``'s own loop, from the ``on_step_begin`` to the
  ``on_step_end`` callback: per micro-batch ``training_step`` (GRPO's ``_prepare_inputs``
  shuffling and splitting the batch, ``compute_loss`` with TRL's fused LM head that also
  computes the entropy it logs, backward), gradient clipping, ``optimizer.step`` (TRL's
  AdamW, ``fused=True`` on CPU), the scheduler step and ``zero_grad``. Generation is
  bypassed: ``_generate_and_score_completions`` returns the fixed batch, already padded
  into tensors (so TRL is not charged for collation, advantages or reward calls, and not
  for fetching its prompt rows from the dataloader or for logging).

Pairing: a ``TrainerCallback`` runs one serl update right after each TRL step ends, so
every TRL step has a serl step next to it in time; the first pair warms both up and is
dropped, and the medians of the next ``--repeats`` are reported, with their ratio
(target: serl <= 0.8 x TRL). Times are CPU seconds of the process (the machine is
shared; see ``benchmarks.common.Stopwatch``), wall-clock in the JSON. Both sides start
from the same weights, so the first pair's
losses and pre-clip gradient norms must agree: they are reported as the check that both
compute the same objective (``first_grad_norm_rel_diff`` in the JSON).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass

import torch

from benchmarks.common import Stopwatch, report, require
from benchmarks.train_step import Batch, UpdateBench, make_batch
from serl_cli.algos.batch import make_micro_batches
from serl_cli.algos.objectives import episode_advantages
from serl_cli.artifacts.schema import TurnSample, turn_samples
from serl_cli.errors import SerlError
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


@dataclass
class PeerBench:
    repeats: int = 3
    threads: int = 1
    seed: int = 0
    lr: float = 1e-6
    clip_eps: float = 0.2
    grad_clip: float = 1.0
    micro_batch_tokens: int = OptimConfig.micro_batch_tokens


# -- the batch as TRL holds it -----------------------------------------------------------------
def trl_inputs(samples: list[TurnSample], advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """What GRPO's ``_generate_and_score_completions`` hands to the loss: prompts left-padded,
    completions right-padded, one advantage per row, old log-probs, the action-token count."""
    n = len(samples)
    width_p = max(len(s.prompt_ids) for s in samples)
    width_c = max(len(s.action_ids) for s in samples)
    prompt_ids = torch.full((n, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    completion_ids = torch.full((n, width_c), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width_c), dtype=torch.long)
    old_logps = torch.zeros((n, width_c), dtype=torch.float32)
    for row, s in enumerate(samples):
        p, a = len(s.prompt_ids), len(s.action_ids)
        prompt_ids[row, width_p - p :] = torch.tensor(s.prompt_ids)
        prompt_mask[row, width_p - p :] = 1
        completion_ids[row, :a] = torch.tensor(s.action_ids)
        completion_mask[row, :a] = 1
        old_logps[row, :a] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.to(torch.float32),
        "old_per_token_logps": old_logps,
        "num_items_in_batch": completion_mask.sum().to(torch.float32),
    }


def rows_per_micro_batch(n_rows: int, width: int, max_tokens: int) -> int:
    """The largest divisor of ``n_rows`` whose ``rows x width`` padded tokens fit ``max_tokens`` (at least 1):
    TRL splits a batch into equal micro-batches of ``per_device_train_batch_size`` rows."""
    fits = [d for d in range(1, n_rows + 1) if n_rows % d == 0 and d * width <= max_tokens]
    return max(fits, default=1)


def serl_padded_tokens(samples: list[TurnSample], max_tokens: int, pad_id: int) -> tuple[int, int]:
    """(padded tokens, forwards) of serl's micro-batches over the whole batch, as ``Learner.update`` packs them."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].action_ids))
    mbs = make_micro_batches(samples, order, max_tokens, pad_id)
    return sum(mb.input_ids.numel() for mb in mbs), len(mbs)


# -- TRL, with generation replaced by the fixed batch ------------------------------------------------
def make_trl_trainer(
    model_name: str, inputs: dict, rows: int, accumulation: int, cfg: PeerBench, steps: int, out_dir: str, callback
):
    require("trl", "bench")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from serl_cli.models.loading import load_model

    class FixedBatchGRPOTrainer(GRPOTrainer):
        """GRPO whose generation step returns the same prepared batch every time."""

        def _generate_and_score_completions(self, generation_batch):
            return dict(inputs)

        def training_step(self, model, batch, num_items_in_batch):
            loss = super().training_step(model, batch, num_items_in_batch)
            self.losses.append(float(loss))
            return loss

        def _clip_grad_norm(self, model):  # the pre-clip norm, to check both sides take the same gradient
            norm = super()._clip_grad_norm(model)
            self.grad_norms.append(float(norm))
            return norm

    n = inputs["prompt_ids"].shape[0]
    model, tokenizer = load_model(model_name)
    model.config.use_cache = False
    args = GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation,
        num_generations=min(d for d in range(2, n + 1) if n % d == 0) if n > 1 else 1,
        max_completion_length=inputs["completion_ids"].shape[1],
        temperature=1.0,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=cfg.grad_clip,
        loss_type="dapo",
        beta=0.0,
        epsilon=cfg.clip_eps,
        activation_checkpointing=False,
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = FixedBatchGRPOTrainer(
        model=model,
        reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["-"] * n}),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.losses, trainer.grad_norms = [], []
    return trainer


def paired_callback(serl_step):
    from transformers import TrainerCallback

    class PairedSteps(TrainerCallback):
        """Times each TRL optimizer step, then runs one serl update next to it."""

        def __init__(self):
            self.trl, self.serl, self.serl_metrics, self.threads = [], [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self._watch = Stopwatch().__enter__()

        def on_step_end(self, args, state, control, **kw):
            self._watch.__exit__(None, None, None)
            self.trl.append(self._watch)
            self.threads.append(torch.get_num_threads())
            watch, metrics = serl_step()
            self.serl.append(watch)
            self.serl_metrics.append(metrics)

    return PairedSteps()


def measure(cfg: PeerBench, batch: Batch, temperature: float = 1.0, log=print) -> dict:
    require("trl", "bench")
    samples = turn_samples(batch.episodes)
    advantages = episode_advantages(samples, TrainConfig.adv_eps)
    if bool((advantages == 0).any()):
        raise SerlError("the batch has turns with advantage 0: serl would skip them and TRL would not")
    learner = Learner(
        batch.model_name,
        TrainConfig(
            algo="grpo",
            seed=cfg.seed,
            threads=cfg.threads,
            clip_eps=cfg.clip_eps,
            optim=OptimConfig(lr=cfg.lr, grad_clip=cfg.grad_clip, micro_batch_tokens=cfg.micro_batch_tokens),
        ),
    )
    pad = learner.tokenizer.pad_token_id
    inputs = trl_inputs(samples, advantages, pad)
    n = len(samples)
    width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    rows = rows_per_micro_batch(n, width, cfg.micro_batch_tokens)

    def serl_step():
        with Stopwatch() as watch:
            metrics = learner.update(batch.episodes, temperature)
        return watch, metrics

    callback = paired_callback(serl_step)
    with tempfile.TemporaryDirectory(prefix="serl-trl-") as tmp:
        trainer = make_trl_trainer(batch.model_name, inputs, rows, n // rows, cfg, cfg.repeats + 1, tmp, callback)
        torch.set_num_threads(cfg.threads)  # as the learner set it; TRL's setup must not change it
        log(
            f"TRL GRPOTrainer vs serl: {n} rows, {rows} rows x {n // rows} micro-batches in TRL, "
            f"{cfg.repeats} timed pairs after one warm-up pair"
        )
        trainer.train()
        checkpointing = bool(getattr(trainer.model, "is_activation_checkpointing", False))
    if len(callback.trl) != cfg.repeats + 1:
        raise SerlError(f"TRL ran {len(callback.trl)} steps, expected {cfg.repeats + 1}")
    trl_s, serl_s = [w.cpu_s for w in callback.trl[1:]], [w.cpu_s for w in callback.serl[1:]]
    real_tokens = sum(len(s.prompt_ids) + len(s.action_ids) for s in samples)
    action_tokens = int(inputs["completion_mask"].sum())
    serl_padded, serl_forwards = serl_padded_tokens(samples, cfg.micro_batch_tokens, pad)
    first = callback.serl_metrics[0]
    trl_first_loss = sum(trainer.losses[: n // rows])
    med_trl, med_serl = statistics.median(trl_s), statistics.median(serl_s)
    return {
        "model": batch.model_name,
        "rows": n,
        "episodes": len(batch.episodes),
        "real_tokens": real_tokens,
        "action_tokens": action_tokens,
        "threads": cfg.threads,
        "threads_seen_by_trl_steps": sorted(set(callback.threads)),
        "repeats": cfg.repeats,
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "serl": {
            "update_cpu_s": med_serl,
            "all_update_cpu_s": serl_s,
            "all_update_wall_s": [w.wall_s for w in callback.serl[1:]],
            "gradient_loop_wall_s": [m["timing"]["update_s"] for m in callback.serl_metrics[1:]],
            "padded_tokens": serl_padded,
            "forwards": serl_forwards,
            "first_loss": first["loss"],
            "first_grad_norm": first["grad_norm"],
            "turns_with_gradient": first["turns_with_gradient"],
        },
        "trl": {
            "step_cpu_s": med_trl,
            "all_step_cpu_s": trl_s,
            "all_step_wall_s": [w.wall_s for w in callback.trl[1:]],
            "padded_tokens": rows * (n // rows) * width,
            "forwards": n // rows,
            "rows_per_micro_batch": rows,
            "first_loss": trl_first_loss,
            "first_grad_norm": trainer.grad_norms[0],
            "activation_checkpointing": checkpointing,
            "version": _version("trl"),
        },
        "ratio_serl_over_trl": med_serl / med_trl,
        "pair_ratios": [s / t for s, t in zip(serl_s, trl_s, strict=True)],
        "first_loss_abs_diff": abs(first["loss"] - trl_first_loss),
        # same weights, same batch, same objective: the first step's gradients must agree
        "first_grad_norm_rel_diff": abs(first["grad_norm"] - trainer.grad_norms[0]) / max(trainer.grad_norms[0], 1e-12),
    }


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main() -> None:
    d, u = PeerBench(), UpdateBench()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default=u.catalog, choices=["auto", "real", "synthetic"])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    ap.add_argument("--tasks", type=int, default=u.tasks)
    ap.add_argument("--group-size", type=int, default=u.group_size)
    ap.add_argument("--max-turns", type=int, default=u.max_turns)
    ap.add_argument("--max-new-tokens", type=int, default=u.max_new_tokens)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--repeats", type=int, default=d.repeats, help="timed pairs after the warm-up pair")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        batch = make_batch(
            UpdateBench(
                catalog=a.catalog,
                model=a.model,
                tasks=a.tasks,
                group_size=a.group_size,
                max_turns=a.max_turns,
                max_new_tokens=a.max_new_tokens,
                threads=a.threads,
                seed=a.seed,
            )
        )
        data = measure(PeerBench(repeats=a.repeats, threads=a.threads, seed=a.seed), batch)
    except SerlError as e:
        ap.exit(2, f"error: {e}\n")
    s, t = data["serl"], data["trl"]
    rows = [
        [
            "serl Learner.update",
            s["update_cpu_s"],
            s["forwards"],
            s["padded_tokens"],
            s["first_loss"],
            s["first_grad_norm"],
        ],
        [
            f"TRL {t['version']} GRPOTrainer step",
            t["step_cpu_s"],
            t["forwards"],
            t["padded_tokens"],
            t["first_loss"],
            t["first_grad_norm"],
        ],
        ["serl / TRL", data["ratio_serl_over_trl"], "", "", "", ""],
    ]
    report(
        "trl_grpo",
        f"GRPO update, serl vs TRL ({data['rows']} turns, {data['real_tokens']} tokens of which "
        f"{data['action_tokens']} action, {a.threads} thread(s), median of {a.repeats} pairs)",
        ["update", "CPU s", "forwards", "padded tokens", "first-step loss", "first-step grad norm"],
        rows,
        data,
        a.out,
    )


if __name__ == "__main__":
    main()
