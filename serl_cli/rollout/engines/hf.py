"""The transformers engine: one batched ``generate`` with a KV cache over all live episodes.

Prompts are left-padded into one batch, so every row's next token sits in the last
column and the cache is shared by the whole batch. A logits processor (:class:`ChosenLogprobs`)
keeps each step's chosen token's behaviour log-prob as generation goes -- one ``[B, V]`` row
of scores at a time, never every step's logits (64 rows x 512 steps x 152k would be 20 GB) --
so nothing is recomputed after generation.

Sampling is serl's alone: temperature and top-p from ``SamplingConfig``, nothing else.
transformers fills every generation setting the call leaves unset from the checkpoint's
``generation_config.json`` (Qwen2.5-Instruct's has ``repetition_penalty: 1.05``, ``top_k: 20``,
``top_p: 0.8``), which would sample from another distribution than the one whose log-probs
are stored; :data:`NEUTRAL_GENERATION` sets each of them to "off".
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, TopPLogitsWarper

from serl_cli.models.device import autocast, model_device
from serl_cli.rollout.engines import Generation, SamplingConfig
from serl_cli.rollout.prompts import stop_token_ids


class HFEngine:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        # a reply ends at the end-of-turn token, or at the end-of-text token a model may also emit
        self.stop_ids = set(stop_token_ids(tokenizer))

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, row_seeds: list[int] | None = None
    ) -> list[Generation]:
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        greedy = sampling.temperature <= 0
        device = model_device(self.model)  # the model's device and precision (models.device); the CPU: unchanged
        if device.type != "cpu":
            input_ids, attention = input_ids.to(device), attention.to(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the caller's RNG untouched
            torch.manual_seed(seed)
            with autocast(self.model):
                coupled = None if greedy or row_seeds is None else GumbelRows(row_seeds, sampling)
                recorder = ChosenLogprobs(1.0 if greedy else sampling.temperature)
                out = self._generate(input_ids, attention, sampling, greedy, recorder, coupled)
        new_tokens = out.sequences[:, width:]
        logprobs = recorder.finish(out.sequences)
        gens = []
        for row, lp in zip(new_tokens.tolist(), logprobs.tolist(), strict=True):
            stops = [i for i, t in enumerate(row) if t in self.stop_ids]
            n = stops[0] + 1 if stops else len(row)  # keep the stop token: the policy learns to end its turn
            gens.append(Generation(token_ids=row[:n], logprobs=lp[:n]))
        return gens

    def _generate(self, input_ids, attention, sampling: SamplingConfig, greedy: bool, recorder, coupled=None):
        if coupled is not None:  # the draw is the argmax of the noised scores (GumbelRows)
            greedy = True
        # the recorder first: with every built-in processor off it sees the raw scores
        processors = [recorder] if coupled is None else [recorder, coupled]
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            logits_processor=LogitsProcessorList(processors),
            **neutral_generation(),
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
        )


# Every generation setting that changes what is drawn, "off": a value given to ``generate`` wins
# over the checkpoint's generation_config.json and over transformers' own defaults (top_k 50).
NEUTRAL_GENERATION = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "min_length": 0,
    "min_new_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "guidance_scale": None,
    "top_k": None,
    "min_p": None,
    "typical_p": 1.0,
    "top_h": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "watermarking_config": None,
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "dola_layers": None,
    "num_return_sequences": 1,
}


def neutral_generation() -> dict:
    """:data:`NEUTRAL_GENERATION`, less the names this transformers version does not know (an
    unknown name would be handed to the model's forward pass)."""
    known = GenerationConfig()
    return {k: v for k, v in NEUTRAL_GENERATION.items() if hasattr(known, k)}


class ChosenLogprobs(LogitsProcessor):
    """Behaviour log-probs recorded during ``generate``: ``log_softmax(raw / T)`` of the token
    drawn at each step, T the temperature (1 for greedy). It runs first at every step, on the
    raw scores, and keeps that step's log-softmax (one ``[B, V]`` tensor) until the next call,
    whose ``input_ids`` end with the token drawn from it; :meth:`finish` takes the last one
    from the finished sequences. It changes no score."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self._take(self.pending, input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, pending: torch.Tensor, chosen: torch.Tensor) -> None:
        self.columns.append(pending.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        self.pending = None

    def finish(self, sequences: torch.LongTensor) -> torch.Tensor:
        """``[B, new tokens]``: the log-prob of every generated token."""
        if self.pending is not None:
            self._take(self.pending, sequences[:, -1])
        if not self.columns:
            return torch.zeros((sequences.shape[0], 0))
        return torch.stack(self.columns, dim=1).cpu()


class GumbelRows(LogitsProcessor):
    """Sampling with a random stream per row (coupled sampling, ``SamplingConfig.coupled``):
    the scores at temperature T, top-p truncated, plus Gumbel noise drawn from the row's own
    generator; the argmax of that is a draw from the truncated softmax(logits / T) (the
    Gumbel-max trick). A row's draws depend on its seed alone, not on the rows batched with it,
    and two policies given the same stream pick the same token wherever their scores agree
    closely enough.

    The streams live on the device that decodes (drawn on the CPU, 24 rows'
    noise over a 152k vocabulary took 61 ms a step, against 20-25 ms for the GPU's decode): a
    row's draws depend on its seed and the device's generator, so arms on one kind of device
    stay coupled, and on a CPU the draws are what they always were."""

    def __init__(self, seeds: list[int], sampling: SamplingConfig):
        self.seeds = [int(s) for s in seeds]
        self.generators: list[torch.Generator] = []  # made on the first step, on the scores' device
        self.temperature = sampling.temperature
        self.top_p = TopPLogitsWarper(sampling.top_p) if sampling.top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # transformers types scores as the legacy FloatTensor, which torch's ops are not typed to return
        scores = cast(torch.FloatTensor, scores.float() / self.temperature)
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        device = scores.device
        if not self.generators:
            self.generators = [torch.Generator(device=device).manual_seed(s) for s in self.seeds]
        u = torch.stack(
            [torch.rand(scores.shape[-1], generator=g, dtype=torch.float64, device=device) for g in self.generators]
        )
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return cast(torch.FloatTensor, scores + gumbel.to(dtype=scores.dtype))
