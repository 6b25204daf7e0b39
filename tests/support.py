"""Shared helpers for tests that need a tokenizer or a tiny model, built offline in seconds.

The fixtures built from them live in conftest.py (session-scoped, under a pytest temp dir);
this module holds the plain helpers test modules import (conftest.py puts this folder on
``sys.path``): the corpus, configs, and the CLI runners.

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

import importlib.util
import itertools
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, trainers
from tokenizers import pre_tokenizers as pre
from transformers import PreTrainedTokenizerFast

from envs.webshop.env import RULES
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import TurnSample, read_rollouts, write_rollouts
from serl_cli.models.tiny import EOS_TOKEN, _qwen2_pipeline
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import ACTION_FORMAT, PromptConfig, build_messages, render_prompt_ids
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig

_COLORS = ["red", "blue", "black", "white", "green", "navy blue", "gray"]
_ITEMS = [
    "running shoes",
    "hair dryer",
    "coffee mug",
    "t-shirt",
    "headphones",
    "water bottle",
    "desk lamp",
    "tea bags",
    "protein bars",
    "hair extension",
]
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
            f"[SEP] Next > [SEP] {asin} [SEP] {adj.title()} {color.title()} {item.title()} "
            f"[SEP] ${5 + i % 60}.{i % 100:02d}",
            f"<action>search[{adj} {color} {item}]</action>",
            f"<action>click[{asin.lower()}]</action>",
        ]
    texts += [
        "<action>click[buy now]</action>",
        "<action>click[< prev]</action>",
        "<action>click[back to search]</action>",
        "<action>click[next >]</action>",
    ]
    return texts


def synthetic_env(max_turns: int | None = 4) -> EnvConfig:
    """WebShop on the synthetic catalog (no data needed), train split; few turns keep runs short."""
    return EnvConfig(name="webshop", split="train", max_turns=max_turns, settings={"catalog": "synthetic"})


def rollout_config(model_dir, out, *, temperature: float = 1.0, seed: int = 0, **kw) -> RolloutConfig:
    """The rollout the engine tests run: 2 tasks x 3 rollouts, 16 new tokens, one thread."""
    return RolloutConfig(
        env=kw.pop("env", synthetic_env()),
        model=str(model_dir),
        tasks=kw.pop("tasks", 2),
        group_size=kw.pop("group_size", 3),
        sampling=SamplingConfig(temperature=temperature, max_new_tokens=kw.pop("max_new_tokens", 16)),
        threads=1,
        seed=seed,
        out=str(out),
        **kw,
    )


def turn_sample(
    episode: int, reward: float, *, turn: int = 0, group: int = 0, state: str = "s", turn_reward: float = 0.0, **extra
) -> TurnSample:
    """A training turn of one prompt token and one action token (behaviour log-prob -1) in group
    ``(group, 0)``, its episode a success where ``reward`` reaches 1; ``extra``: other fields."""
    return TurnSample(
        episode=episode,
        turn=turn,
        group_key=(group, 0),
        prompt_ids=[1],
        action_ids=[2],
        behaviour_logprobs=[-1.0],
        episode_reward=reward,
        success=reward >= 1.0,
        state_key=state,
        turn_reward=turn_reward,
        **extra,
    )


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
        hidden.append(out.hidden_states[-1][0, len(ids) - 1 :])  # after the final norm: what lm_head reads
    hidden = torch.cat(hidden)
    direction = hidden.mean(0) / hidden.mean(0).norm()
    scale = mean_logit / (hidden @ direction).mean()
    model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(EOS_TOKEN)] = scale * direction


def half_successful(episodes: list[Episode]) -> list[Episode]:
    """Half of every group rewarded 1 (success), in place: a random-init model never succeeds,
    and rewards are data to the stages after the rollout."""
    for ep in episodes:
        if ep.rollout_index % 2 == 0:
            ep.reward, ep.success = 1.0, True
            ep.turns[-1].reward = 1.0
    return episodes


def make_half_successful(run) -> None:
    """:func:`half_successful` on a run's stored rollouts."""
    write_rollouts(run, half_successful(read_rollouts(run, need_tokens=False)))


# -- the CLI, run as a user runs it ---------------------------------------------------------
def serl(
    *args: str, env: dict | None = None, input: str | None = None, preexec_fn=None, process: bool = False
) -> subprocess.CompletedProcess:
    """``serl ARGS``: exit code, stdout and stderr, as a user's shell gets them.

    In this process (the real entry point, :func:`serl_in_process`) unless the process itself is
    under test: ``process=True``, standard input, a ``preexec_fn``, or an ``env`` with a setting
    read when a process starts (:data:`READ_AT_CALL` lists the ones serl reads per call). A new
    interpreter costs about 5 s of imports, which ~100 such calls paid in every CI run."""
    if process or input is not None or preexec_fn is not None or not set(env or {}) <= READ_AT_CALL:
        return serl_process(*args, env=env, input=input, preexec_fn=preexec_fn)
    return serl_in_process(*args, env=env)


def serl_process(*args: str, env: dict | None = None, input: str | None = None, preexec_fn=None):
    """``serl ARGS`` in a new interpreter."""
    # as from a user's shell: without the progress-bar switch an in-process CLI test leaves in os.environ
    base = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    full_env = {**base, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "serl_cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        timeout=300,
        preexec_fn=preexec_fn,
    )


# environment settings serl reads when a command runs (not at import), so an in-process call honours them
READ_AT_CALL = {"COLUMNS", "SERL_THREADS"}  # not SERL_DATA_DIR: the catalogs it finds are cached


def serl_in_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``serl ARGS`` through :func:`serl_cli.cli.main` in this process, its output captured and
    what a command changes in the process (environment, torch threads, signal handlers, argv)
    put back. An exception that escapes is exit 1 with its traceback on stderr, as in a process."""
    import contextlib
    import io
    import signal
    import traceback

    from serl_cli.cli import main

    saved_env, saved_argv, threads = dict(os.environ), sys.argv, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    os.environ.update({"COLUMNS": "200", **(env or {})})
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["serl", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # an uncaught error is what the caller checks for
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(["serl", *args], code, out.getvalue(), err.getvalue())


def file_size_limit(limit: int):
    """What makes a process's files unable to grow past ``limit`` bytes, for ``serl(...,
    preexec_fn=...)`` or a forked child (RLIMIT_FSIZE: the write that crosses it fails part-way
    with EFBIG, as on a full disk)."""
    import resource
    import signal

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``serl ablate ARGS`` through :func:`serl` (its cells run in the same process, or as processes of
    their own under ``--parallel``, as from a shell)."""
    return serl("ablate", *args, env={"SERL_THREADS": "1", **(env or {})})


def tiny_grid(
    tmp_path: Path,
    model: Path,
    *,
    algos=("grpo", "serl"),
    seeds=2,
    iterations=1,
    name="grid.yaml",
    tasks=1,
    max_turns=2,
) -> Path:
    grid = {
        "base": {
            "env": {"name": "webshop", "split": "train", "max_turns": max_turns, "settings": {"catalog": "synthetic"}},
            "model": str(model),
            "iterations": iterations,
            "rollout": {
                "tasks": tasks,
                "group_size": 2,
                "threads": 1,
                "sampling": {"temperature": 1.0, "max_new_tokens": 8},
            },
            "train": {"optim": {"lr": 1.0e-3}, "threads": 1},
            "annotate": {"threads": 1},
        },
        "grid": {"algo": list(algos), "sources": ["ref|error"], "seeds": seeds},
        "final_eval": {"episodes": 2, "split": "test"},
        "slurm": {"partition": "gpu", "time": "01:00:00", "cpus_per_task": 2, "gpus": 1, "mem": "8G"},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(grid), encoding="utf-8")
    return path


# -- the benchmark data -------------------------------------------------------------------
def data_dir(name: str, marker: str) -> Path | None:
    """``$SERL_DATA_DIR/name`` where it holds ``marker``, else None."""
    root = os.environ.get("SERL_DATA_DIR")
    folder = Path(root) / name if root else None
    return folder if folder is not None and (folder / marker).exists() else None


def webshop_data_dir() -> Path | None:
    return data_dir("webshop", "documents_1k.jsonl")


def requires_webshop_data() -> Path:
    """Skip (with the reason) where the real 1k catalog is absent; CI sets SERL_DATA_DIR."""
    path = webshop_data_dir()
    if path is None:
        pytest.skip("SERL_DATA_DIR does not point at the WebShop data (webshop/documents_1k.jsonl)")
    return path


# -- ALFWorld's games, where the extra and the data are present ---------------------------------
def alfworld_root() -> Path | None:
    return data_dir("alfworld", "json_2.1.1")


def requires_alfworld() -> Path:
    if importlib.util.find_spec("alfworld") is None or importlib.util.find_spec("textworld") is None:
        pytest.skip("the alfworld extra is not installed (pip install -e '.[alfworld]')")
    root = alfworld_root()
    if root is None:
        pytest.skip("SERL_DATA_DIR does not point at the ALFWorld games (alfworld/json_2.1.1)")
    return root


# -- real model families' chat templates, each with a small BPE trained here -----------------------
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# template file, special tokens (the first is the pad token), bos, eos, whether the template takes a system message
FAMILIES = {
    "qwen2.5": ("qwen2.5-instruct.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", True),
    "qwen3": (
        "qwen3.jinja",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        None,
        "<|im_end|>",
        True,
    ),
    "llama3.1": (
        "llama3.1-instruct.jinja",
        [
            "<|finetune_right_pad_id|>",
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
    ),
    # Gemma 2's template refuses a system message; its end of turn is not its eos token
    "gemma2": (
        "gemma2-it.jinja",
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
        False,
    ),
    # Mistral: the system text goes into the last user turn; no assistant header; no end-of-user token but [/INST]
    "mistral-v0.3": (
        "mistral-7b-instruct-v0.3.jinja",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "<s>",
        "</s>",
        True,
    ),
}


def wrap_family_tokenizer(tok: Tokenizer, family: str) -> PreTrainedTokenizerFast:
    template, specials, bos, eos, _ = FAMILIES[family]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        chat_template=(TEMPLATES / template).read_text(encoding="utf-8"),
        clean_up_tokenization_spaces=False,
    )


@cache
def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen2's pre-tokenizer) trained on WebShop-like text, with the family's specials."""
    tok = _qwen2_pipeline(Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False)))
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=FAMILIES[family][1],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(webshop_like_corpus(), trainer=trainer)
    return wrap_family_tokenizer(tok, family)
