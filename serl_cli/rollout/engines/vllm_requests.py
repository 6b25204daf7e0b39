"""One vLLM request as serl makes it: sampling settings as ``SamplingParams`` (with the seed each request
draws from), and the reply back as a :class:`Generation`, or vLLM's refusal as one line. Used by the engine
(:mod:`serl_cli.rollout.engines.vllm`) for a round's call and for one episode's turn alike; importing it
needs no vLLM."""

from __future__ import annotations

import numpy as np

from serl_cli.errors import SerlError
from serl_cli.rollout.engines import Generation, SamplingConfig


def check_sampling(sampling: SamplingConfig) -> None:
    if sampling.temperature > 0 and sampling.top_p < 1:
        raise SerlError(
            f"--engine vllm samples with top_p = 1 only (got {sampling.top_p}): vLLM's log-probs under "
            f"top-p are of the truncated distribution, not the log_softmax(logits / T) serl stores"
        )


def request_seeds(seed: int, n: int) -> list[int]:
    """One seed per prompt of a call: vLLM seeds each request on its own, and two equal
    prompts (a group's first turn) given one seed would draw the same reply."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(n, dtype=np.uint32)]


def sampling_params(vllm, sampling: SamplingConfig, stop_ids: list[int], seed: int):
    """serl's sampling settings as vLLM ``SamplingParams``, one to one."""
    greedy = sampling.temperature <= 0
    return vllm.SamplingParams(
        temperature=0.0 if greedy else sampling.temperature,  # vLLM: 0 = greedy
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0,  # no hidden top-k truncation, as in the hf engine
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=stop_ids,  # the stop token stays in the output: the policy learns to end its turn
        logprobs=0,  # the sampled token's log-prob only
        seed=None if greedy else seed,
        detokenize=False,  # serl decodes the ids itself
    )


def refused(e: Exception) -> SerlError:
    """vLLM's refusal of a request (a prompt longer than max_model_len, a token id outside the vocabulary)
    as one line."""
    return SerlError(f"vLLM refused a prompt: {str(e).strip().splitlines()[0]}")


def generation_of(out) -> Generation:
    """A vLLM ``RequestOutput``'s one sample: its token ids and their log-probs."""
    sample = out.outputs[0]
    ids = list(sample.token_ids)
    return Generation(token_ids=ids, logprobs=[lp[t].logprob for t, lp in zip(ids, sample.logprobs, strict=True)])


def request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError, and its own client error
    class in recent versions."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return ValueError, VLLMClientError
