"""The transformers engine: one batched ``generate`` with a KV cache over all live episodes.

Prompts are left-padded into one batch, so every row's next token sits in the last
column and the cache is shared by the whole batch. The logits of each sampled token are
kept (``output_logits``) and turned into behaviour log-probs here, so nothing is
recomputed after generation.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopPLogitsWarper

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
                out = self._generate(input_ids, attention, sampling, greedy, coupled)
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [B, new, V], raw (before sampling processors)
        scale = 1.0 if greedy else sampling.temperature
        logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        gens = []
        for row, lp in zip(new_tokens.tolist(), logprobs.tolist()):
            stops = [i for i, t in enumerate(row) if t in self.stop_ids]
            n = stops[0] + 1 if stops else len(row)  # keep the stop token: the policy learns to end its turn
            gens.append(Generation(token_ids=row[:n], logprobs=lp[:n]))
        return gens

    def _generate(self, input_ids, attention, sampling: SamplingConfig, greedy: bool, coupled=None):
        if coupled is not None:  # the draw is the argmax of the noised scores (GumbelRows)
            greedy = True
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            logits_processor=LogitsProcessorList([coupled] if coupled is not None else []),
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,  # no hidden top-k truncation: sample the full distribution
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
        )


class GumbelRows(LogitsProcessor):
    """Sampling with a random stream per row (coupled sampling, ``SamplingConfig.coupled``):
    the scores at temperature T, top-p truncated, plus Gumbel noise drawn from the row's own
    generator; the argmax of that is a draw from the truncated softmax(logits / T) (the
    Gumbel-max trick). A row's draws depend on its seed alone, not on the rows batched with it,
    and two policies given the same stream pick the same token wherever their scores agree
    closely enough."""

    def __init__(self, seeds: list[int], sampling: SamplingConfig):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = sampling.temperature
        self.top_p = TopPLogitsWarper(sampling.top_p) if sampling.top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return scores + gumbel.to(device=scores.device, dtype=scores.dtype)
