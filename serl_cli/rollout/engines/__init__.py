"""Generation engines behind one small interface, and the model policy built on them.

An engine turns a batch of prompt token-id lists into generations: the generated token
ids and each token's log-probability under the sampling policy (``log_softmax(logits /
T)``, T the temperature; greedy decoding scores at T = 1). Top-p truncation changes what
can be drawn, not the stored log-probs, as in verl and TRL. Engines: ``hf``
(transformers, generating with the caller's model object) and ``vllm`` (the optional
vLLM extra, holding its own copy of the weights: see :func:`refresh_weights`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from envs.base import Step
from serl_cli.config import at_least, setting, within
from serl_cli.errors import SerlError
from serl_cli.rollout.policies import Decision, ExpertPolicy
from serl_cli.rollout.prompts import (
    DEFAULT_ACTION_FORMAT,
    PromptConfig,
    authors_messages,
    build_messages,
    format_reply,
    parse_action,
    render_prompt_ids,
    reply_ids,
)

EngineName = Literal["hf", "vllm"]


@dataclass(frozen=True)
class EngineTraits:
    """What a generation engine is, as the plan and the loop need to know it without loading it."""

    own_weights: bool  # holds its own copy of the policy (vLLM): the weights go to it after each update
    batched_server: bool  # one engine serves every process's groups (vLLM); else each process generates its own


ENGINE_TRAITS = {
    "hf": EngineTraits(own_weights=False, batched_server=False),
    "vllm": EngineTraits(own_weights=True, batched_server=True),
}


def engine_traits(name: str) -> EngineTraits:
    if name not in ENGINE_TRAITS:
        raise SerlError(f"unknown engine {name!r}: choose one of {', '.join(ENGINE_TRAITS)}")
    return ENGINE_TRAITS[name]


ENGINES = get_args(EngineName)


@dataclass
class SamplingConfig:
    temperature: float = setting(1.0, "0: greedy", limit=at_least(0, "0 (greedy) or positive"))
    top_p: float = setting(1.0, "nucleus sampling mass", limit=within(0, 1, open_low=True))
    max_new_tokens: int = setting(48, "the reply's token budget", limit=at_least(1, whole=True))
    coupled: bool = setting(
        False,
        "common random numbers: each episode's turn draws from its own stream, keyed by the run's seed, the "
        "room's group, the rollout and the turn (row_seed), not from one stream per batch. Two runs with the "
        "same seed then draw the same reply for the same turn wherever their policies agree closely "
        "(Gumbel-max on hf, per-request seeds on vLLM), so arms paired by seed stay paired after they diverge",
    )


def row_seed(seed: int, row: tuple, turn: int) -> int:
    """The seed of one episode's turn under coupled sampling: a hash of the policy's seed, the
    episode's (group, rollout) and the turn, the same in every run that shares the seed."""
    digest = hashlib.blake2b(f"{seed}|{'|'.join(map(str, row))}|{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


class Engine(Protocol):
    tokenizer: Any  # a Hugging Face tokenizer (transformers' or the one vLLM loads)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, row_seeds: list[int] | None = None
    ) -> list[Generation]: ...


def prompts_of(tokenizer: Any, prompt: PromptConfig, steps: list[Step], contexts: list[dict]) -> list[list[int]]:
    """The token ids of each live episode's prompt, as ``prompt`` lays it out."""
    out = []
    for step, ctx in zip(steps, contexts, strict=True):
        history = [{"observation": t.observation, "action": t.action} for t in ctx["turns"]]
        if prompt.style == "authors":
            messages = authors_messages(
                ctx.get("authors_prompt"),
                ctx["instruction"],
                history,
                step.observation,
                step.admissible_actions,
                prompt,
            )
        else:
            messages = build_messages(
                ctx["rules"],
                ctx["instruction"],
                history,
                step.observation,
                step.admissible_actions,
                prompt,
                ctx.get("action_format") or DEFAULT_ACTION_FORMAT,
            )
        out.append(render_prompt_ids(tokenizer, messages, prompt.chat_template_kwargs))
    return out


class ModelPolicy:
    """Prompt -> engine -> parsed action, for every live episode at once."""

    name = "model"

    def __init__(self, engine: Engine, sampling: SamplingConfig, prompt: PromptConfig, seed: int = 0):
        self.engine, self.sampling, self.prompt, self.seed = engine, sampling, prompt, seed
        self.calls = 0
        self._asked: dict[int, tuple[list[int], dict]] = {}  # dispatch episode: the turns being decided

    def prompts(self, steps: list[Step], contexts: list[dict]) -> list[list[int]]:
        return prompts_of(self.engine.tokenizer, self.prompt, steps, contexts)

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        prompt_ids = self.prompts(steps, contexts)
        # one seed per call: a run's sampling is fixed by its seed, and no two calls share draws
        seed = self.seed * 1_000_003 + self.calls
        if self.sampling.coupled and self.sampling.temperature > 0:
            rows = [
                row_seed(self.seed, ctx.get("row", ("batch", i)), len(ctx["turns"])) for i, ctx in enumerate(contexts)
            ]
            gens = self.engine.generate(prompt_ids, self.sampling, seed=seed, row_seeds=rows)
        else:
            gens = self.engine.generate(prompt_ids, self.sampling, seed=seed)
        self.calls += 1
        return [self.decision(ids, gen, ctx) for ids, gen, ctx in zip(prompt_ids, gens, contexts, strict=True)]

    def decision(self, prompt_ids: list[int], gen: Generation, ctx: dict) -> Decision:
        """One reply, decoded and parsed into the action the environment is given."""
        text = self.engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        invalid = None
        if self.prompt.style == "authors":  # their projection: the action, and whether the reply is invalid
            action, error = ctx["authors_prompt"].project(text)
            invalid = error is not None
        else:
            action, error = parse_action(text, ctx.get("action_format") or DEFAULT_ACTION_FORMAT)
        return Decision(
            action=action,
            text=text,
            prompt_ids=prompt_ids,
            action_ids=gen.token_ids,
            logprobs=gen.logprobs,
            parse_error=error,
            invalid=invalid,
        )

    # dispatch episode (serl_cli.rollout.runner.run_per_episode): one episode's turn at a time, on an
    # engine that takes requests one by one (vLLM); each turn's draw is its own (greedy, or coupled)

    def submit(self, key: int, step: Step, ctx: dict) -> None:
        (prompt_ids,) = self.prompts([step], [ctx])
        seed = row_seed(self.seed, ctx["row"], len(ctx["turns"])) if self.sampling.temperature > 0 else 0
        self.engine.submit(key, prompt_ids, self.sampling, seed)  # type: ignore[attr-defined]
        self._asked[key] = (prompt_ids, ctx)

    def finished(self) -> list[tuple[int, Decision]]:
        out = []
        for key, gen in self.engine.finished():  # type: ignore[attr-defined]
            prompt_ids, ctx = self._asked.pop(key)
            out.append((key, self.decision(prompt_ids, gen, ctx)))
        return out

    @property
    def busy(self) -> bool:
        return bool(self._asked)

    def cancel(self) -> None:
        """Drop the turns being decided (the rollout stopped): the engine stops generating them."""
        if self._asked:
            self.engine.cancel()  # type: ignore[attr-defined]
            self._asked.clear()


class TokenizedExpertPolicy:
    """The expert (``expert``, by default the plain one), recorded as a model would see it:
    the same prompt ids, and its action written as a reply (tagged, or bare with
    ``prompt.bare_replies``) and tokenized with the end-of-turn token -- SFT data."""

    name = "expert"

    def __init__(self, tokenizer, prompt: PromptConfig, expert: ExpertPolicy | None = None):
        self.tokenizer, self.prompt = tokenizer, prompt
        self.expert = expert or ExpertPolicy()

    @property
    def calls(self) -> int:  # a resumed rollout sets it: the noisy expert's draws go on where they stood
        return self.expert.calls

    @calls.setter
    def calls(self, value: int) -> None:
        self.expert.calls = value

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        prompts = prompts_of(self.tokenizer, self.prompt, steps, contexts)
        out = []
        bare = self.prompt.bare_replies
        for ids, d in zip(prompts, self.expert.act(steps, contexts), strict=True):
            out.append(
                Decision(
                    action=d.action,
                    text=format_reply(d.action, bare),
                    prompt_ids=ids,
                    action_ids=reply_ids(self.tokenizer, d.action, bare),
                    off_expert=d.off_expert,
                )
            )
        return out


def check_dispatch(dispatch: str, policy: str, engine: str, temperature: float, coupled: bool) -> None:
    """``rollout.dispatch``: ``episode`` runs a model policy on an engine that takes requests one by one
    (vLLM), and each turn's draw must be its own (greedy, or coupled) for the episodes to be round dispatch's."""
    from serl_cli.rollout.runner import DISPATCH

    if dispatch not in DISPATCH:
        raise SerlError(f"unknown rollout.dispatch {dispatch!r}: choose one of {', '.join(DISPATCH)}")
    if dispatch == "round":
        return
    if policy != "model":
        raise SerlError(f"rollout.dispatch episode is for a model policy; the {policy} policy decides in rounds")
    if engine != "vllm":
        raise SerlError(
            f"rollout.dispatch episode needs --engine vllm: the {engine} engine decodes a round's prompts as one batch"
        )
    if temperature > 0 and not coupled:
        raise SerlError(
            "rollout.dispatch episode draws each turn from its own seed: set rollout.sampling.coupled true "
            "(or sample greedily); batch seeding draws a reply from its place in a round"
        )


def check_engine(kind: str) -> None:
    """Fail before any model is loaded: an unknown engine, or vLLM without its extra."""
    from serl_cli.errors import SerlError

    if kind not in ENGINES:
        raise SerlError(f"unknown engine {kind!r}: choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        from serl_cli.rollout.engines.vllm import import_vllm

        import_vllm()


def make_engine(
    kind: str,
    model,
    tokenizer,
    threads: int | None = None,
    *,
    model_dir: str | None = None,
    vllm=None,
    seed: int = 0,
    gpus: list[int] | None = None,
) -> Engine:
    """``hf`` generates with ``model`` itself; ``vllm`` loads its own copy of the policy from
    ``model_dir`` (default: the directory ``model`` was loaded from), with ``vllm`` a
    :class:`serl_cli.rollout.engines.vllm.VLLMConfig`, on the CUDA devices ``gpus`` when
    given (``rollout.gpus``: split from the trainer's), else where vLLM puts it."""
    from serl_cli.errors import SerlError

    check_engine(kind)
    if kind == "hf":
        from serl_cli.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer)
    from serl_cli.rollout.engines.vllm import VLLMEngine

    source = model_dir or getattr(model, "name_or_path", None)
    if not source:
        raise SerlError("--engine vllm loads the policy from a model directory, and this model has none")
    return VLLMEngine(str(source), tokenizer, vllm, seed=seed, gpus=gpus)


def refresh_weights(engine: Engine, checkpoint_dir) -> None:
    """After an update: an engine with its own copy of the weights (vLLM) reloads them from
    the checkpoint just saved; the hf engine shares the learner's model and is current."""
    reload = getattr(engine, "load_weights", None)
    if reload is not None:
        reload(checkpoint_dir)


def sleep_engine(engine: Engine | None) -> None:
    """Let an engine free its accelerator memory while the trainer updates (vLLM with
    ``sleep: true``); it wakes when the next weights arrive. A no-op for the others."""
    sleep = getattr(engine, "sleep", None)
    if sleep is not None:
        sleep()


def model_engine(
    model_name: str,
    *,
    seed: int = 0,
    threads: int | None = None,
    engine: str = "hf",
    device: str = "auto",
    dtype: str = "auto",
    vllm=None,
    gpus: list[int] | None = None,
):
    """An engine generating with ``model_name``: hf on ``device`` in ``dtype`` (``models.device``),
    or a vLLM engine of its own (``vllm``: its ``VLLMConfig``; close it with :func:`close_engine`)."""
    from serl_cli.models.device import resolve
    from serl_cli.models.loading import load_for_inference, set_torch_threads

    check_engine(engine)
    set_torch_threads(threads)
    if engine == "vllm":
        return make_engine("vllm", None, None, model_dir=model_name, vllm=vllm, seed=seed, gpus=gpus)
    model, tokenizer = load_for_inference(model_name, resolve(device, dtype))
    return make_engine(engine, model, tokenizer)


def model_policy(
    model_name: str,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    prompt: PromptConfig | None = None,
    max_new_tokens: int = 48,
    coupled: bool = False,
    **engine,
) -> ModelPolicy:
    """A policy generating with ``model_name`` on :func:`model_engine` (``engine``: its settings)."""
    eng = model_engine(model_name, seed=seed, **engine)
    return ModelPolicy(
        eng, SamplingConfig(temperature, top_p, max_new_tokens, coupled), prompt or PromptConfig(), seed=seed
    )


def close_engine(engine) -> None:
    """Free an engine's own resources (vLLM's engine process and its memory); hf has none."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
