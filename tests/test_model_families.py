"""The teacher prompt and ``chat_template_kwargs`` under the chat templates of real model families.

The templates are the published ones (tests/fixtures/chat_templates, sources in its README),
each paired with a small byte-level BPE trained here with the family's special tokens. The
teacher prompt must be the stored student prompt with the block spliced in at the end of the
user message -- student = P + tail, teacher = P + X + tail -- and decode to exactly what the
family's template renders for the teacher's conversation; where that check fails, the
documented fallback (``serl_cli/method/teacher.py``) places it.
"""

from __future__ import annotations

import string
from dataclasses import replace
from functools import cache
from types import SimpleNamespace

import pytest
from support import FAMILIES, family_tokenizer, wrap_family_tokenizer
from tokenizers import Tokenizer, decoders, models
from tokenizers import pre_tokenizers as pre
from transformers import PreTrainedTokenizerFast

from envs.base import Feedback, Step
from serl_cli.artifacts.records import Episode, make_episode, make_turn
from serl_cli.config import from_dict
from serl_cli.errors import SerlError
from serl_cli.method import annotation
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.teacher import (
    block_ids,
    chat_tail,
    inserted_ids,
    spliced_part,
    teacher_prompt,
    teacher_prompt_ids,
    teacher_prompts_for,
    teacher_suffix,
)
from serl_cli.rollout.engines import ModelPolicy, SamplingConfig
from serl_cli.rollout.prompts import (
    PromptConfig,
    build_messages,
    end_of_turn_id,
    prompt_file_text,
    render_prompt_ids,
    trained_prompt,
)
from serl_cli.stages.rollout import RolloutConfig, validate

BLOCK = "Immediate feedback from the current step:\nInstruction: [SEP] i need a red mug [SEP] Back to Search"


@cache
def merging_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE with no pre-tokenizer split, whose only merges join a letter with the
    newline after it: the block's first newline merges with the user text's last letter."""
    alphabet = sorted(pre.ByteLevel.alphabet())
    specials = FAMILIES[family][1]
    newline = "\u010a"  # the byte-level symbol of "\n"
    merges = [(c, newline) for c in string.ascii_letters]
    vocab = {t: i for i, t in enumerate(specials + alphabet + [a + b for a, b in merges])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return wrap_family_tokenizer(tok, family)


def _messages(family: str) -> list[dict]:
    cfg = PromptConfig(system=FAMILIES[family][4])
    return build_messages("You shop.", "i need a red mug", [], "WebShop [SEP] Search", ["search[<query>]"], cfg)


def _teacher_messages(messages: list[dict], block: str) -> list[dict]:
    return messages[:-1] + [{"role": "user", "content": messages[-1]["content"] + teacher_suffix(block)}]


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- the templates themselves


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixture_templates_render_serl_prompts(family):
    tok = family_tokenizer(family)
    messages = _messages(family)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert messages[-1]["content"] in text
    assert _text(tok, render_prompt_ids(tok, messages)) == text  # the byte-level BPE decodes back exactly
    if family == "gemma2":
        with pytest.raises(Exception, match="System role not supported"):
            tok.apply_chat_template(build_messages("r", "t", [], "o", [], PromptConfig()), tokenize=False)


# ---------------------------------------------------------------- the splice


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block", [BLOCK, "x", "ends in a newline\n", "Reference:\n[turn 1] click[b0x] ]]"])
def test_teacher_prompt_is_student_prefix_block_suffix(family, block):
    tok = family_tokenizer(family)
    messages = _messages(family)
    student = render_prompt_ids(tok, messages)
    teacher = teacher_prompt(tok, student, block)
    tail = chat_tail(tok)
    assert tail and student[len(student) - len(tail) :] == tail
    inserted = spliced_part(student, teacher, tail)  # student = P + tail, teacher = P + X + tail
    assert inserted and teacher == student[: len(student) - len(tail)] + inserted + tail
    # exactly the family's own rendering of the teacher's conversation: the block at the end of the user message
    rendered = tok.apply_chat_template(_teacher_messages(messages, block), tokenize=False, add_generation_prompt=True)
    assert _text(tok, teacher) == rendered
    assert messages[-1]["content"] + "\n\n" + block.rstrip() in _text(tok, teacher)
    if family in ("qwen2.5", "qwen3"):  # ChatML: serl's original end-of-turn splice, id for id
        assert teacher == teacher_prompt_ids(student, block_ids(tok, block), tok.eos_token_id)


def test_the_block_goes_where_each_family_closes_the_user_message():
    ends = {
        "qwen2.5": "Correctly solve the current task.\n<|im_end|>\n<|im_start|>assistant\n",
        "llama3.1": "Correctly solve the current task.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "gemma2": "Correctly solve the current task.<end_of_turn>\n<start_of_turn>model\n",  # | trim
        "mistral-v0.3": "Correctly solve the current task.\n[/INST]",
    }
    for family, end in ends.items():
        tok = family_tokenizer(family)
        assert _text(tok, teacher_prompt(tok, render_prompt_ids(tok, _messages(family)), BLOCK)).endswith(end), family


def spy_scorer(seen: list):
    def scorer(model, tokenizer, items, temperature, micro_batch_tokens):
        seen.extend(items)
        return [[-1.0] * len(it.action_ids) for it in items]

    return scorer


def _group(tok, prompt_ids: list[int]) -> list[Episode]:
    """Two rollouts of one task, one turn each, the first successful: the turn gets a block (obs)."""
    reply = tok.encode("<action>click[b01]</action>", add_special_tokens=False) + [tok.eos_token_id]
    turn = make_turn(
        observation="WebShop [SEP] Search",
        state_key="s0",
        prompt_ids=prompt_ids,
        action_text="<action>click[b01]</action>",
        action="click[b01]",
        action_ids=reply,
        behaviour_logprobs=[-2.0] * len(reply),
        next_observation="Instruction: [SEP] i need a red mug",
    )
    return [make_episode([replace(turn)], rollout_index=i, success=i == 0, reward=float(i == 0)) for i in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_annotation_builds_each_familys_teacher_prompt(family):
    tok = family_tokenizer(family)
    student = render_prompt_ids(tok, _messages(family))
    seen: list = []
    records, _ = annotate_episodes(
        _group(tok, student), AnnotateConfig(teacher_signal=False), None, tok, env_cfg=None, scorer=spy_scorer(seen)
    )
    assert len(seen) == 2
    assert seen[0].prompt_ids == teacher_prompt(tok, student, records[0].hindsight)
    assert "Immediate feedback from the current step:" in _text(tok, seen[0].prompt_ids)


# ---------------------------------------------------------------- the fallback


@pytest.mark.parametrize("family", ["qwen2.5", "gemma2", "mistral-v0.3"])
def test_a_tokenizer_merging_across_the_boundary_falls_back(family):
    tok = merging_tokenizer(family)
    student = render_prompt_ids(tok, _messages(family))
    tail = chat_tail(tok)
    assert tail and student[len(student) - len(tail) :] == tail
    assert inserted_ids(tok, BLOCK, tail) is None  # the probe's last letter merged with the block's newline
    teacher = teacher_prompt(tok, student, BLOCK)
    end = end_of_turn_id(tok)
    if end in student:  # ChatML <|im_end|>, Gemma <end_of_turn>: before the last one, serl's original layout
        assert family in ("qwen2.5", "gemma2")
        assert teacher == teacher_prompt_ids(student, block_ids(tok, BLOCK), end)
    else:  # Mistral (no end-of-user token): the block's ids before the tail
        assert family == "mistral-v0.3"
        cut = len(student) - len(tail)
        assert teacher == student[:cut] + block_ids(tok, BLOCK) + student[cut:]
    assert BLOCK in _text(tok, teacher)


BLOCKS = [BLOCK, "x", "ends in a newline\n", BLOCK, "Reference:\n[turn 1] click[b0x] ]]"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("merging", [False, True])
def test_teacher_prompts_for_a_batch_equal_one_at_a_time(family, merging):
    """The annotation's batched teacher prompts (one chat-template call for every distinct block) are
    teacher_prompt's ids, turn by turn: on the spliced path, on the fallback (a tokenizer merging across
    the boundary), for a prompt rendered with other kwargs (cut short) and for a repeated block."""
    tok = merging_tokenizer(family) if merging else family_tokenizer(family)
    student = render_prompt_ids(tok, _messages(family))
    # cut short, the prompt does not end with the template's tail: the fallback, where it has an end of turn
    other = student[:-1] if end_of_turn_id(tok) in student[:-1] else student
    prompts = [student, other, student] + [student] * (len(BLOCKS) - 3)
    one_at_a_time = [teacher_prompt(tok, p, b) for p, b in zip(prompts, BLOCKS, strict=True)]
    assert teacher_prompts_for(tok, prompts, BLOCKS) == one_at_a_time
    assert teacher_prompts_for(tok, [], []) == []


def test_the_fallback_closes_the_block_with_the_templates_end_of_turn():
    """A Gemma prompt that does not end as the template ends a user message (cut short here): the
    block goes before its last <end_of_turn>, the token that closes Gemma's messages, not <eos>."""
    tok = family_tokenizer("gemma2")
    student = render_prompt_ids(tok, _messages("gemma2"))[:-1]
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.eos_token_id not in student and end in student
    teacher = teacher_prompt(tok, student, BLOCK)
    cut = len(student) - 1 - student[::-1].index(end)
    assert teacher == student[:cut] + block_ids(tok, BLOCK) + student[cut:]
    assert teacher[cut + len(block_ids(tok, BLOCK))] == end and BLOCK in _text(tok, teacher)


def test_a_prompt_the_template_did_not_end_is_refused():
    tok = family_tokenizer("mistral-v0.3")  # no token closes a Mistral user message
    student = render_prompt_ids(tok, _messages("mistral-v0.3"))
    assert end_of_turn_id(tok) not in student
    with pytest.raises(SerlError, match="cannot place the hindsight block"):
        teacher_prompt(tok, student[:-1], BLOCK)


# ---------------------------------------------------------------- chat_template_kwargs


NO_THINKING = {"enable_thinking": False}


def test_chat_template_kwargs_reach_the_template():
    tok = family_tokenizer("qwen3")
    messages = _messages("qwen3")
    assert _text(tok, render_prompt_ids(tok, messages)).endswith("<|im_start|>assistant\n")
    assert _text(tok, render_prompt_ids(tok, messages, NO_THINKING)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_policy_renders_with_the_prompt_settings_kwargs():
    tok = family_tokenizer("qwen3")
    step = Step(
        observation="WebShop [SEP] Search",
        reward=0.0,
        done=False,
        feedback=Feedback(),
        admissible_actions=["search[<query>]"],
        state_key="s0",
        expert_action=None,
    )
    ctx = {"turns": [], "rules": "You shop.", "instruction": "i need a red mug"}
    engine = SimpleNamespace(tokenizer=tok)  # prompts need the tokenizer only
    policy = ModelPolicy(engine, SamplingConfig(), PromptConfig(chat_template_kwargs=NO_THINKING))
    messages = build_messages(
        "You shop.", "i need a red mug", [], step.observation, step.admissible_actions, PromptConfig()
    )
    assert policy.prompts([step], [ctx]) == [render_prompt_ids(tok, messages, NO_THINKING)]


def test_the_teacher_prompt_renders_with_the_same_kwargs():
    tok = family_tokenizer("qwen3")
    messages = _messages("qwen3")
    student = render_prompt_ids(tok, messages, NO_THINKING)
    tail = chat_tail(tok, NO_THINKING)
    assert _text(tok, tail).endswith("<think>\n\n</think>\n\n")
    teacher = teacher_prompt(tok, student, BLOCK, NO_THINKING)
    assert _text(tok, teacher) == tok.apply_chat_template(
        _teacher_messages(messages, BLOCK), tokenize=False, add_generation_prompt=True, **NO_THINKING
    )
    # without them the stored prompt does not end as the template would: the end-of-turn fallback, same ids here
    assert teacher_prompt(tok, student, BLOCK) == teacher


def test_annotation_passes_the_kwargs_to_the_teacher_prompt(monkeypatch):
    tok = family_tokenizer("qwen3")
    asked = []

    def spy(tokenizer, prompt_ids, blocks, chat_template_kwargs=None):
        asked.append(chat_template_kwargs)
        return teacher_prompts_for(tokenizer, prompt_ids, blocks, chat_template_kwargs)

    monkeypatch.setattr(annotation, "teacher_prompts_for", spy)
    student = render_prompt_ids(tok, _messages("qwen3"), NO_THINKING)
    annotate_episodes(
        _group(tok, student),
        AnnotateConfig(teacher_signal=False),
        None,
        tok,
        env_cfg=None,
        scorer=spy_scorer([]),
        chat_template_kwargs=NO_THINKING,
    )
    assert asked and all(kw == NO_THINKING for kw in asked)


def test_chat_template_kwargs_is_a_prompt_setting(tmp_path):
    cfg = from_dict(RolloutConfig, {"prompt": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert cfg.prompt.chat_template_kwargs == NO_THINKING and PromptConfig().chat_template_kwargs == {}
    validate(cfg)
    with pytest.raises(SerlError, match="must be a dict"):
        from_dict(RolloutConfig, {"prompt": {"chat_template_kwargs": "enable_thinking=false"}})
    with pytest.raises(SerlError, match="set by serl itself"):
        validate(from_dict(RolloutConfig, {"prompt": {"chat_template_kwargs": {"add_generation_prompt": False}}}))
    (tmp_path / "serl_prompt.json").write_text(prompt_file_text(cfg.prompt))  # a checkpoint keeps them
    assert trained_prompt(str(tmp_path)) == cfg.prompt


# ---------------------------------------------------------------- where a reply ends


@pytest.mark.parametrize(
    "family, token",
    [
        ("qwen2.5", "<|im_end|>"),
        ("qwen3", "<|im_end|>"),
        ("llama3.1", "<|eot_id|>"),
        ("gemma2", "<end_of_turn>"),
        ("mistral-v0.3", "</s>"),
    ],
)
def test_a_reply_ends_with_the_templates_end_of_turn(family, token):
    """The token the template writes after an assistant message closes a reply: SFT targets end
    with it and the engines stop at it (Gemma's is not its eos token)."""
    from serl_cli.rollout.prompts import end_of_turn_id, reply_ids, stop_token_ids

    tok = family_tokenizer(family)
    eot = tok.convert_tokens_to_ids(token)
    assert end_of_turn_id(tok) == eot and reply_ids(tok, "click[x]")[-1] == eot
    assert set(stop_token_ids(tok)) >= {eot, tok.eos_token_id}


def test_gemma_generation_stops_at_end_of_turn():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from serl_cli.rollout.engines.hf import HFEngine

    tok = family_tokenizer("gemma2")
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    bias = torch.zeros(len(tok))
    bias[eot] = 100.0  # the model's every next token is <end_of_turn>
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias)
    prompt = render_prompt_ids(tok, _messages("gemma2"))
    gen = HFEngine(model, tok).generate([prompt], SamplingConfig(0.0, 1.0, 8), seed=0)[0]
    assert gen.token_ids == [eot]  # not eight of them: the reply ended at the end of turn
