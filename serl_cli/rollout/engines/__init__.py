"""Generation engines behind one small interface, and the model policy built on them.

An engine turns a batch of prompt token-id lists into generations: the generated token
ids and each token's log-probability under the sampling policy (``log_softmax(logits /
T)``, T the temperature; greedy decoding scores at T = 1). Top-p truncation changes what
can be drawn, not the stored log-probs, as in verl and TRL. Engines: ``hf``
(transformers, generating with the caller's model object) and ``vllm`` (the optional
vLLM extra, holding its own copy of the weights: see :func:`refresh_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from envs.base import Step
from serl_cli.rollout.policies import Decision
from serl_cli.rollout.prompts import (
    DEFAULT_ACTION_FORMAT,
    PromptConfig,
    build_messages,
    parse_action,
    render_prompt_ids,
)

ENGINES = ("hf", "vllm")


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 48


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


class Engine(Protocol):
    tokenizer: object

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[Generation]: ...


class ModelPolicy:
    """Prompt -> engine -> parsed action, for every live episode at once."""

    name = "model"

    def __init__(self, engine: Engine, sampling: SamplingConfig, prompt: PromptConfig, seed: int = 0):
        self.engine, self.sampling, self.prompt, self.seed = engine, sampling, prompt, seed
        self.calls = 0

    def prompts(self, steps: list[Step], contexts: list[dict]) -> list[list[int]]:
        out = []
        for step, ctx in zip(steps, contexts):
            history = [{"observation": t["observation"], "action": t["action"]} for t in ctx["turns"]]
            messages = build_messages(ctx["rules"], ctx["instruction"], history, step.observation,
                                      step.admissible_actions, self.prompt,
                                      ctx.get("action_format") or DEFAULT_ACTION_FORMAT)
            out.append(render_prompt_ids(self.engine.tokenizer, messages))
        return out

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        prompt_ids = self.prompts(steps, contexts)
        # one seed per call: a run's sampling is fixed by its seed, and no two calls share draws
        gens = self.engine.generate(prompt_ids, self.sampling, seed=self.seed * 1_000_003 + self.calls)
        self.calls += 1
        decisions = []
        for ids, gen, ctx in zip(prompt_ids, gens, contexts):
            text = self.engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            action, error = parse_action(text, ctx.get("action_format") or DEFAULT_ACTION_FORMAT)
            decisions.append(Decision(action=action, text=text, prompt_ids=ids, action_ids=gen.token_ids,
                                      logprobs=gen.logprobs, parse_error=error))
        return decisions


class TokenizedExpertPolicy:
    """The expert, recorded as a model would see it: the same prompt ids, and the expert's
    action written as a reply and tokenized (with the end-of-turn token) -- SFT data."""

    name = "expert"

    def __init__(self, tokenizer, prompt: PromptConfig):
        from serl_cli.rollout.prompts import format_action

        self.tokenizer, self.prompt, self._format = tokenizer, prompt, format_action
        self._prompter = ModelPolicy(engine=_TokenizerOnly(tokenizer), sampling=SamplingConfig(), prompt=prompt)

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        prompt_ids = self._prompter.prompts(steps, contexts)
        out = []
        for ids, step in zip(prompt_ids, steps):
            reply = self._format(step.expert_action or "")
            action_ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Decision(action=step.expert_action or "", text=reply, prompt_ids=ids, action_ids=action_ids))
        return out


@dataclass
class _TokenizerOnly:
    tokenizer: object


def check_engine(kind: str) -> None:
    """Fail before any model is loaded: an unknown engine, or vLLM without its extra."""
    from serl_cli.errors import SerlError

    if kind not in ENGINES:
        raise SerlError(f"unknown engine {kind!r}: choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        from serl_cli.rollout.engines.vllm import import_vllm

        import_vllm()


def make_engine(kind: str, model, tokenizer, threads: int | None = None, *, model_dir: str | None = None,
                vllm=None, seed: int = 0) -> Engine:
    """``hf`` generates with ``model`` itself; ``vllm`` loads its own copy of the policy from
    ``model_dir`` (default: the directory ``model`` was loaded from), with ``vllm`` a
    :class:`serl_cli.rollout.engines.vllm.VLLMConfig`."""
    from serl_cli.errors import SerlError

    check_engine(kind)
    if kind == "hf":
        from serl_cli.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer)
    from serl_cli.rollout.engines.vllm import VLLMEngine

    source = model_dir or getattr(model, "name_or_path", None)
    if not source:
        raise SerlError("--engine vllm loads the policy from a model directory, and this model has none")
    return VLLMEngine(str(source), tokenizer, vllm, seed=seed)


def refresh_weights(engine: Engine, checkpoint_dir) -> None:
    """After an update: an engine with its own copy of the weights (vLLM) reloads them from
    the checkpoint just saved; the hf engine shares the learner's model and is current."""
    reload = getattr(engine, "load_weights", None)
    if reload is not None:
        reload(checkpoint_dir)


def model_policy(model_name: str, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 prompt: PromptConfig | None = None, max_new_tokens: int = 48, threads: int | None = None,
                 engine: str = "hf") -> ModelPolicy:
    from serl_cli.models.loading import load_model, set_torch_threads

    set_torch_threads(threads)
    model, tokenizer = load_model(model_name)
    model.eval()
    return ModelPolicy(make_engine(engine, model, tokenizer), SamplingConfig(temperature, top_p, max_new_tokens),
                       prompt or PromptConfig(), seed=seed)
