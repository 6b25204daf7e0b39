"""``prompt.instruction``: a line at the end of the user message, what a small chat model reads last
(SmolLM2 answers a bare move when it names the four words: docs/MODELS.md); and the teacher gate's
per-source blocks for a model with no reading SFT."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from serl_cli import api
from serl_cli.errors import SerlError
from serl_cli.method.diagnostics import teacher_gate as gate
from serl_cli.rollout.prompts import PromptConfig, build_messages, prompt_file_text, trained_prompt

SMOLLM2 = Path(__file__).resolve().parent.parent / "experiments" / "smollm2" / "sokoban.yaml"
LINE = "Answer with one word: up, down, left or right."


def messages(cfg: PromptConfig) -> list[dict]:
    return build_messages("RULES", "Push every box onto a goal.", [], "# P B G #", ["up", "down"], cfg)


def test_the_instruction_is_the_last_line_of_the_user_message():
    plain = messages(PromptConfig())
    told = messages(PromptConfig(instruction=LINE))
    assert told[0] == plain[0]  # the system message is the environment's, unchanged
    assert told[1]["content"] == plain[1]["content"] + "\n" + LINE
    assert told[1]["content"].splitlines()[-2].startswith("Admissible actions: ")
    alone = messages(PromptConfig(instruction=LINE, system=False, max_admissible=0))
    assert len(alone) == 1 and alone[0]["content"].endswith("Current observation: # P B G #\n" + LINE)


def test_no_instruction_leaves_the_prompt_as_it_was():
    assert "\n\n" not in messages(PromptConfig())[1]["content"]
    assert messages(PromptConfig(instruction=""))[1]["content"].endswith("Admissible actions: up, down")


def test_a_checkpoint_keeps_its_instruction_for_eval(tmp_path):
    (tmp_path / "serl_prompt.json").write_text(prompt_file_text(PromptConfig(instruction=LINE)))
    assert trained_prompt(str(tmp_path)) == PromptConfig(instruction=LINE)


def test_the_smollm2_config_sets_it_and_a_yaml_colon_needs_quotes():
    cfg = api.load_config("train", [str(SMOLLM2)])
    assert cfg.rollout.prompt.instruction == LINE and cfg.rollout.prompt.max_admissible == 0
    assert cfg.rollout.sampling.max_new_tokens == 3 and cfg.train.optim.micro_batch_tokens == 2048
    quoted = api.load_config("rollout", None, [f'prompt.instruction="{LINE}"'])
    assert quoted.prompt.instruction == LINE
    with pytest.raises(SerlError, match="prompt.instruction must be a string"):
        api.load_config("rollout", None, [f"prompt.instruction={LINE}"])  # YAML reads "a: b" as a mapping


def test_the_gates_source_blocks_are_annotation_settings():
    names = {"error", "diff", "obs", "ref (aligned)", "expert (aligned)", "shuffled (aligned)"}
    assert set(gate.SOURCE_BLOCKS) == names
    for settings in gate.SOURCE_BLOCKS.values():
        cfg = gate.block_config(settings)
        assert not cfg.skip_zero_advantage and cfg.sources == settings["sources"]


def test_the_log_change_survives_an_underflowed_probability():
    assert gate.log_change(0.5, 0.25) == pytest.approx(math.log(2))
    assert math.isfinite(gate.log_change(0.0, 0.5)) and gate.log_change(0.0, 0.5) < -700
