"""Shared fixtures for tests that need a tokenizer or a tiny model, built offline in seconds.

Import the fixtures a module uses (``from fixtures_model import tiny_model_dir``);
conftest.py puts this folder on ``sys.path``. Session-scoped: built once per module that
imports them (each importing module registers its own copy), under a pytest temp dir.

* ``tiny_tokenizer``: a byte-level BPE trained with ``serl_cli.models.tiny.train_tokenizer`` on
  :func:`webshop_like_corpus` (about 500 lines generated here; ~680 ids).
* ``tiny_model_dir``: ``serl_cli.models.tiny.init_model("tiny", ...)`` on the same corpus, as it
  comes (random weights, seed 0). It practically never writes the end-of-turn token:
  its ids (a few hundred) are about equally likely at T = 1, and greedy repeats one id.
* ``stopping_model_dir``: that model with the end-of-turn token's (tied) embedding row
  pointed along the mean final hidden state (:func:`boost_eos`), so it ends a reply after a
  few tokens often but not always: replies that stop and replies cut at ``max_new_tokens``
  side by side in one batch, which is where padding and truncation bugs show.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from envs.webshop.env import RULES
from serl_cli.models.loading import load_model
from serl_cli.models.tiny import EOS_TOKEN, init_model, train_tokenizer
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import ACTION_FORMAT, PromptConfig, build_messages, render_prompt_ids
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig

_COLORS = ["red", "blue", "black", "white", "green", "navy blue", "gray"]
_ITEMS = ["running shoes", "hair dryer", "coffee mug", "t-shirt", "headphones", "water bottle", "desk lamp",
          "tea bags", "protein bars", "hair extension"]
_ADJECTIVES = ["lightweight", "organic", "wireless", "stainless steel", "large capacity", "fast drying", "slim fit"]


def webshop_like_corpus(n: int = 120) -> list[str]:
    """WebShop-like text (pages, instructions, tagged actions) plus the rules: ~500 lines."""
    texts = [RULES, ACTION_FORMAT]
    for i, (color, item, adj) in enumerate(itertools.islice(itertools.product(_COLORS, _ITEMS, _ADJECTIVES), n)):
        asin = f"B0{i % 10}X{i:04d}Q"
        texts += [
            f"WebShop [SEP] Instruction: [SEP] i need {adj} {color} {item}, and price lower than {10 + i % 90}.00 "
            f"dollars [SEP] Search",
            f"Instruction: [SEP] i need {adj} {item} [SEP] Back to Search [SEP] Page 1 (Total results: {i % 50}) "
            f"[SEP] Next > [SEP] {asin} [SEP] {adj.title()} {color.title()} {item.title()} [SEP] ${5 + i % 60}.{i % 100:02d}",
            f"<action>search[{adj} {color} {item}]</action>",
            f"<action>click[{asin.lower()}]</action>",
        ]
    texts += ["<action>click[buy now]</action>", "<action>click[< prev]</action>",
              "<action>click[back to search]</action>", "<action>click[next >]</action>"]
    return texts


def synthetic_env(max_turns: int | None = 4) -> EnvConfig:
    """WebShop on the synthetic catalog (no data needed), train split; few turns keep runs short."""
    return EnvConfig(name="webshop", split="train", max_turns=max_turns, settings={"catalog": "synthetic"})


def rollout_config(model_dir, out, *, temperature: float = 1.0, seed: int = 0, **kw) -> RolloutConfig:
    """The rollout the engine tests run: 2 tasks x 3 rollouts, 16 new tokens, one thread."""
    return RolloutConfig(env=kw.pop("env", synthetic_env()), model=str(model_dir), tasks=kw.pop("tasks", 2),
                         group_size=kw.pop("group_size", 3),
                         sampling=SamplingConfig(temperature=temperature, max_new_tokens=kw.pop("max_new_tokens", 16)),
                         threads=1, seed=seed, out=str(out), **kw)


@torch.no_grad()
def boost_eos(model, tokenizer, corpus: list[str], mean_logit: float = 3.0, contexts: int = 8) -> None:
    """Point the end-of-turn embedding row (tied: the output row too) along the mean final
    hidden state of reply positions, in place, so its logit there averages ``mean_logit``.

    The other logits of the random model are about N(0, 0.3) over the tokenizer's few hundred
    ids, so at T = 1 some replies stop within 16 tokens and others run to the budget, at
    T = 0.7 more of them stop, and greedy stops at once (the tests check both kinds occur).
    Reply positions are chat prompts followed by random ids: there the hidden states share
    one direction almost exactly.
    """
    g = torch.Generator().manual_seed(0)
    hidden = []
    for i in range(contexts):
        messages = build_messages(RULES, corpus[2 + 4 * i], [], corpus[3 + 4 * i], ["search[<query>]"], PromptConfig())
        ids = render_prompt_ids(tokenizer, messages)
        reply = torch.randint(0, len(tokenizer), (16,), generator=g).tolist()
        out = model(torch.tensor([ids + reply]), output_hidden_states=True)
        hidden.append(out.hidden_states[-1][0, len(ids) - 1:])  # after the final norm: what lm_head reads
    hidden = torch.cat(hidden)
    direction = hidden.mean(0) / hidden.mean(0).norm()
    scale = mean_logit / (hidden @ direction).mean()
    model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(EOS_TOKEN)] = scale * direction


# Fixtures take no other fixture except where noted, so a module imports only what it uses.

@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(webshop_like_corpus(), 4096)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", webshop_like_corpus(), seed=0)


@pytest.fixture(scope="session")
def stopping_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """Needs ``tiny_model_dir`` imported too."""
    model, tokenizer = load_model(str(tiny_model_dir))
    model.eval()
    boost_eos(model, tokenizer, webshop_like_corpus())
    out = tmp_path_factory.mktemp("models") / "tiny-stopping"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
