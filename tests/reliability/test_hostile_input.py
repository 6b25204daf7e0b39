"""Hostile input: every malformed input gives one clear line on stderr, exit code 2, and
leaves the disk as it was (the whole test folder hashed before and after).

Each case builds its bad input in a fresh folder, then runs the real ``serl`` entry point
in-process. Cases already covered elsewhere (tests/test_pipeline_bad_input.py,
tests/test_cli_env.py, tests/test_ablate.py: a missing model directory, a truncated
rollouts file, an unknown schema version, unknown algorithms, ...) are not repeated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faults import cli, one_line_error, tree_hash
from support import rollout_config, synthetic_env

from serl_cli.stages.rollout import run_rollout

SYNTH = ["--set", "env.settings.catalog=synthetic"]


@pytest.fixture(scope="module")
def expert_run(tiny_model_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "expert"
    run_rollout(
        rollout_config(tiny_model_dir, run, policy="expert", tasks=2, group_size=1, env=synthetic_env(max_turns=3))
    )
    return run


def _rewrite_rollouts(run: Path, edit) -> None:
    lines = (run / "rollouts.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    edit(record)
    (run / "rollouts.jsonl").write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")


def _set_manifest(run: Path, text: str) -> None:
    (run / "manifest.json").write_text(text)


def _webshop_data(d: Path, documents: bytes, instructions: bytes = b"{}") -> Path:
    d.mkdir()
    (d / "documents_1k.jsonl").write_bytes(documents)
    (d / "items_ins_v2_1000.json").write_bytes(instructions)
    return d


def _doc_lines(n: int = 3) -> bytes:
    """Records shaped like the catalog's (``product``, ``contents``)."""
    return b"".join(
        json.dumps({"product": {"asin": f"B00{i}", "name": f"item {i}"}, "contents": f"item {i}"}).encode() + b"\n"
        for i in range(n)
    )


def _annotations_of_wrong_schema(run: Path) -> None:
    from serl_cli.artifacts.schema import rollouts_fingerprint

    (run / "annotations.jsonl").write_text(json.dumps({"episode": 0, "turn": 0}) + "\n")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["annotate"] = {"status": "done", "rollouts_sha256": rollouts_fingerprint(run)}
    _set_manifest(run, json.dumps(manifest))


def _journal(run: Path, header_text: str) -> None:
    (run / "rollouts.jsonl").unlink()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["rollout"]["status"] = "running"
    _set_manifest(run, json.dumps(manifest))
    (run / "rollouts.journal.jsonl").write_text(header_text + "\n")


def _other_settings_journal(run: Path) -> None:
    from serl_cli.stages.rollout import RolloutConfig, journal_header

    _journal(run, json.dumps({"journal": journal_header(RolloutConfig(seed=99), 1)}))


# Settings of the online loop set to a value that means nothing (a sweep over the config
# dataclasses' numbers): each is refused in one line by the check next to its config, before
# the model loads. (setting=value, words the line must hold)
NONSENSE = [
    ("train.optim.lr=.nan", "train.optim.lr must be a positive number"),
    ("train.optim.betas=[0.9, 1.2]", "train.optim.betas must be two numbers in [0, 1)"),
    ("train.optim.weight_decay=-0.01", "train.optim.weight_decay must be 0 or positive"),
    ("train.optim.micro_batch_tokens=0", "train.optim.micro_batch_tokens must be at least 1"),
    ("train.adv_eps=0", "train.adv_eps must be a positive number"),
    ("train.kl_coef=-0.1", "train.kl_coef must be 0 or positive"),
    ("train.gamma=1.5", "train.gamma must be a discount in [0, 1]"),
    ("train.epochs=0", "train.epochs must be at least 1"),
    ("train.threads=0", "train.threads must be at least 1"),
    ("rollout.tasks=0", "tasks must be at least 1"),
    ("rollout.prompt.history_turns=-2", "prompt.history_turns must be -1 (all), 0 or more"),
    ("rollout.sampling.temperature=.inf", "rollout.sampling.temperature must be 0 (greedy) or positive, got inf"),
    ("annotate.weight_clip=1.5", "weight_clip must be in [0, 1]"),
    ("annotate.mixing_lambda=-0.5", "mixing_lambda must be in [0, 1]"),
    ("annotate.teacher_sync_interval=0", "teacher_sync_interval must be at least 1"),
    ("eval.episodes=-1", "eval.episodes must be 0 (none) or more"),
]

# (name, setup(tmp, run, model) -> serl arguments, words the one line must hold)
CASES = [
    # --- YAML config files -------------------------------------------------------------------
    ("yaml-unclosed-bracket", lambda t, r, m: _cfg(t, b"tasks: [1, 2\n"), ["malformed YAML", "line 2"]),
    ("yaml-top-level-list", lambda t, r, m: _cfg(t, b"- tasks: 2\n"), ["must hold a mapping of settings"]),
    ("yaml-not-utf8", lambda t, r, m: _cfg(t, b"tasks: \xff\xfe\n"), ["is not UTF-8 text"]),
    ("yaml-wrong-type", lambda t, r, m: _cfg(t, b"tasks: many\n"), ["setting tasks must be an integer"]),
    (
        "yaml-unknown-nested-key",
        lambda t, r, m: _cfg(t, b"sampling: {temprature: 0.5}\n"),
        ["unknown setting sampling.temprature"],
    ),
    ("yaml-section-as-scalar", lambda t, r, m: _cfg(t, b"sampling: hot\n"), ["setting sampling must be a mapping"]),
    # --- --set overrides ------------------------------------------------------------------------
    ("set-into-a-value", lambda t, r, m: _ro(t, m, "--set", "tasks.count=3"), ["is a value, not a section"]),
    (
        "set-control-characters",
        lambda t, r, m: _ro(t, m, "--set", "policy=\x07\x1b[31m"),
        ["malformed --set", "not valid YAML"],
    ),
    (
        "set-negative-temperature",
        lambda t, r, m: _ro(t, m, "--set", "sampling.temperature=-1"),
        ["sampling.temperature must be 0 (greedy) or positive"],
    ),
    ("set-top-p-zero", lambda t, r, m: _ro(t, m, "--set", "sampling.top_p=0"), ["sampling.top_p must be in (0, 1]"]),
    (
        "set-no-new-tokens",
        lambda t, r, m: _ro(t, m, "--set", "sampling.max_new_tokens=0"),
        ["sampling.max_new_tokens must be at least 1"],
    ),
    ("set-batch-size-zero", lambda t, r, m: _ro(t, m, "--set", "batch_size=0"), ["batch_size must be at least 1"]),
    ("negative-max-turns", lambda t, r, m: _ro(t, m, "--max-turns", "-3"), ["--max-turns must be at least 1"]),
    (
        "step-timeout-zero",
        lambda t, r, m: _ro(t, m, "--set", "env.step_timeout_s=0"),
        ["env.step_timeout_s must be a positive"],
    ),
    (
        "set-seed-as-list",
        lambda t, r, m: _ro(t, m, "--seed", "1", "--set", "seed=[1, 2]"),
        ["setting seed must be an integer"],
    ),
    # --- numbers a setting cannot take: one line before anything loads (README: input checks) --------
    ("lr-negative", lambda t, r, m: [*_train(r), "--set", "train.optim.lr=-1"], ["train.optim.lr must be a positive"]),
    (
        "clip-eps-negative",
        lambda t, r, m: [*_train(r), "--set", "train.clip_eps=-0.2"],
        ["train.clip_eps must be a positive number"],
    ),
    *[(f"online-{kv}", lambda t, r, m, kv=kv: _online(t, m, "--set", kv), [needle]) for kv, needle in NONSENSE],
    (
        "eval-no-new-tokens",
        lambda t, r, m: ["eval", "--policy", "expert", "--out", str(t / "out"), *SYNTH, "--set", "max_new_tokens=0"],
        ["max_new_tokens must be at least 1"],
    ),
    (
        "eval-negative-temperature",
        lambda t, r, m: ["eval", "--policy", "expert", "--out", str(t / "out"), *SYNTH, "--set", "temperature=-1"],
        ["temperature must be 0 (greedy) or positive"],
    ),
    # --- --resume of something that is not there, or not whole -----------------------------------
    ("resume-misspelt-online-out", lambda t, r, m: [*_online(t, m), "--resume"], ["--resume:", "does not exist"]),
    (
        "resume-misspelt-rollout-out",
        lambda t, r, m: [*_ro(t, m), "--resume"],
        ["--resume:", "does not exist", "no rollout to continue"],
    ),
    (
        "resume-finished-rollout-cut-mid-line",
        lambda t, r, m: (_cut_rollouts(r, keep_bytes=-30), _resume(r, m))[1],
        ["truncated last line", "damaged", "--overwrite"],
    ),
    (
        "resume-finished-rollout-a-line-short",
        lambda t, r, m: (_cut_rollouts(r, keep_lines=1), _resume(r, m))[1],
        ["holds 1 records but the finished rollout wrote 2", "--overwrite"],
    ),
    (
        "resume-finished-rollout-edited",
        lambda t, r, m: (
            _rewrite_rollouts(r, lambda e: e.update(reward=0.5)),
            [*_resume(r, m), "--set", "sampling.max_new_tokens=16"],
        )[1],
        ["rollouts.jsonl has changed since the rollout wrote it", "--overwrite"],
    ),
    # --- JSONL artifacts ------------------------------------------------------------------------
    (
        "rollouts-line-is-an-array",
        lambda t, r, m: _train(r, lines=["[1, 2, 3]"]),
        ["rollouts.jsonl:1: expected a JSON object, got list"],
    ),
    (
        "rollouts-token-ids-as-text",
        lambda t, r, m: _train(r, edit=lambda e: e["turns"][0].update(action_ids="12 13")),
        ["rollouts.jsonl:1: a turn's action_ids must be a list of token ids"],
    ),
    (
        "rollouts-reward-as-text",
        lambda t, r, m: _train(r, edit=lambda e: e.update(reward="high")),
        ["rollouts.jsonl:1: reward must be a finite number"],
    ),
    (
        "rollouts-turn-not-an-object",
        lambda t, r, m: _train(r, edit=lambda e: e.update(turns=[5])),
        ["a turn must be a JSON object, got int"],
    ),
    (
        "rollouts-huge-line",
        lambda t, r, m: _train(r, raw=b'{"task_id": "' + b"9" * (64 * 2**20) + b'"}\n'),
        ["rollouts.jsonl:1: line longer than 64 MiB"],
    ),
    (
        "rollouts-binary-garbage",
        lambda t, r, m: _train(r, raw=b"\x00\xff\xfe\x9c garbage\n"),
        ["rollouts.jsonl:1: not a JSON record"],
    ),
    (
        "rollouts-deeply-nested",
        lambda t, r, m: _train(r, raw=b"[" * 200_000 + b"]" * 200_000 + b"\n"),
        ["rollouts.jsonl:1: not a JSON record"],
    ),
    ("rollouts-empty-file", lambda t, r, m: _train(r, raw=b""), ["holds no episodes"]),
    (
        "manifest-is-a-list",
        lambda t, r, m: (_set_manifest(r, "[]"), ["train", str(r), "--algo", "sft"])[1],
        ["manifest.json is not a serl manifest"],
    ),
    (
        "manifest-stages-not-a-mapping",
        lambda t, r, m: (_set_manifest(r, '{"schema_version": 1, "stages": [1]}'), ["train", str(r), "--algo", "sft"])[
            1
        ],
        ["is not a serl manifest"],
    ),
    (
        "manifest-cut-short",
        lambda t, r, m: (_set_manifest(r, (r / "manifest.json").read_text()[:50]), ["train", str(r), "--algo", "sft"])[
            1
        ],
        ["manifest.json: malformed JSON"],
    ),
    (
        "annotations-wrong-schema",
        lambda t, r, m: (_annotations_of_wrong_schema(r), ["train", str(r), "--algo", "serl"])[1],
        ["annotations.jsonl:1: record lacks"],
    ),
    ("journal-not-serl", lambda t, r, m: (_journal(r, '{"hello": 1}'), _resume(r, m))[1], ["is not a serl journal"]),
    (
        "journal-of-other-settings",
        lambda t, r, m: (_other_settings_journal(r), _resume(r, m))[1],
        ["belongs to an interrupted run with different settings (", "seed: stored 99, now 0", "--overwrite"],
    ),
    # --- model directories ------------------------------------------------------------------------
    (
        "model-config-malformed",
        lambda t, r, m: _ro(t, _model(t, m, "config.json", b'{"model_type": "qwen2",')),
        ["cannot load model directory"],
    ),
    (
        "model-weights-truncated",
        lambda t, r, m: _ro(t, _model(t, m, "model.safetensors", None)),
        ["cannot load model directory", "deserializing header"],
    ),
    ("model-path-is-a-file", lambda t, r, m: _ro(t, _file(t / "weights.bin")), ["is a file, not a model directory"]),
    (
        "model-without-tokenizer",
        lambda t, r, m: _ro(t, _model_without(t, m, "tokenizer.json")),
        ["has no usable tokenizer", "tokenizer.json"],
    ),
    # --- rollouts a training must not take -------------------------------------------------------
    (
        "rollouts-negative-token-id",
        lambda t, r, m: _train(r, edit=lambda e: e["turns"][0].update(action_ids=[5, -1])),
        ["action_ids must be a list of token ids (integers from 0)"],
    ),
    (
        "rollouts-token-id-outside-the-vocabulary",
        lambda t, r, m: _train(r, edit=lambda e: e["turns"][0].update(prompt_ids=[5, 10**9])),
        ["token id 1000000000 is outside the model's vocabulary", "another tokenizer"],
    ),
    ("rollouts-nan-reward", lambda t, r, m: _train(r, edit=lambda e: e.update(reward=float("nan"))), ["finite"]),
    (
        "rollouts-infinite-turn-reward",
        lambda t, r, m: _train(r, edit=lambda e: e["turns"][0].update(reward=float("inf"))),
        ["reward must be a finite number, got Infinity"],
    ),
    # --- sizes the environment cannot hold: refused before the run directory exists ----------------
    ("online-tasks-beyond-the-split", lambda t, r, m: _online(t, m, "--tasks", "10000000000000"), ["out of range"]),
    ("online-lr-zero", lambda t, r, m: _online(t, m, "--set", "train.optim.lr=0"), ["train.optim.lr is 0"]),
    ("train-lr-zero", lambda t, r, m: [*_train(r), "--set", "train.optim.lr=0"], ["train.optim.lr is 0"]),
    ("resume-and-overwrite", lambda t, r, m: [*_online(t, m), "--resume", "--overwrite"], ["pass one of them"]),
    ("online-grpo-groups-of-one", lambda t, r, m: _online(t, m, "--group-size", "1"), ["every advantage 0"]),
    (
        "online-staleness-past-the-run",
        lambda t, r, m: _online(t, m, "--set", "max_staleness=1"),
        ["max_staleness 1 must be less than the run's 1 iteration"],
    ),
    # --- environment data files -------------------------------------------------------------------
    (
        "webshop-documents-cut",
        lambda t, r, m: _ro(t, m, *_data(t, _doc_lines()[:-20])),
        ["documents_1k.jsonl:3: not a WebShop document"],
    ),
    (
        "webshop-documents-not-utf8",
        lambda t, r, m: _ro(t, m, *_data(t, _doc_lines() + b"\xff\xfe\n")),
        ["cannot load the webshop environment's data", "UnicodeDecodeError"],
    ),
    (
        "webshop-instructions-not-a-mapping",
        lambda t, r, m: _ro(t, m, *_data(t, _doc_lines(), b"[1, 2]")),
        ["items_ins_v2_1000.json: expected a JSON object keyed by ASIN"],
    ),
    # --- grid files -------------------------------------------------------------------------------
    ("grid-top-level-list", lambda t, r, m: _grid(t, b"- grid\n"), ["must hold a mapping"]),
    ("grid-sft-online", lambda t, r, m: _grid(t, b"grid: {algo: [sft]}\n"), ["not an online algorithm"]),
    ("grid-seed-twice", lambda t, r, m: _grid(t, b"grid: {algo: [grpo], seeds: [1, 1]}\n"), ["names a seed twice"]),
    (
        "grid-negative-episodes",
        lambda t, r, m: _grid(t, b"grid: {algo: [grpo]}\nfinal_eval: {episodes: -1}\n"),
        ["final_eval.episodes must be a positive integer"],
    ),
    (
        "grid-unknown-slurm-key",
        lambda t, r, m: _grid(t, b"grid: {algo: [grpo]}\nslurm: {partitionn: gpu}\n"),
        ["unknown key slurm.partitionn"],
    ),
    ("grid-unknown-placement", lambda t, r, m: _grid(t, b"grid: {algo: [serl], placement: [nowhere]}\n"), ["nowhere"]),
]


def _cfg(t: Path, text: bytes) -> list[str]:
    (t / "cfg.yaml").write_bytes(text)
    return ["rollout", "--config", str(t / "cfg.yaml"), "--out", str(t / "out"), *SYNTH]


def _one_episode(t: Path, model, *extra: str) -> list[str]:
    """The options of a run of one task, one episode, into ``t/out``."""
    return ["--model", str(model), "--tasks", "1", "--group-size", "1", "--out", str(t / "out"), *SYNTH, *extra]


def _ro(t: Path, model, *extra: str) -> list[str]:
    return ["rollout", *_one_episode(t, model, *extra)]


def _online(t: Path, model, *extra: str) -> list[str]:
    return ["train", "--iterations", "1", *_one_episode(t, model, "--group-size", "2", *extra)]


def _cut_rollouts(run: Path, *, keep_bytes: int | None = None, keep_lines: int | None = None) -> None:
    """A finished rollout's file cut short after the fact (a copy interrupted, a full disk elsewhere)."""
    data = (run / "rollouts.jsonl").read_bytes()
    if keep_lines is not None:
        data = b"".join(data.splitlines(keepends=True)[:keep_lines])
    (run / "rollouts.jsonl").write_bytes(data[:keep_bytes] if keep_bytes is not None else data)


def _train(run: Path, *, lines=None, edit=None, raw=None) -> list[str]:
    if lines is not None:
        rest = (run / "rollouts.jsonl").read_text().splitlines()[1:]
        (run / "rollouts.jsonl").write_text("\n".join(lines + rest) + "\n")
    if edit is not None:
        _rewrite_rollouts(run, edit)
    if raw is not None:
        (run / "rollouts.jsonl").write_bytes(raw)
    return ["train", str(run), "--algo", "sft"]


def _resume(run: Path, model) -> list[str]:
    return [
        "rollout",
        "--policy",
        "expert",
        "--model",
        str(model),
        "--tasks",
        "2",
        "--group-size",
        "1",
        "--max-turns",
        "3",
        "--out",
        str(run),
        "--resume",
        *SYNTH,
    ]


def _model(t: Path, model, name: str, content: bytes | None) -> Path:
    d = t / "model"
    shutil.copytree(model, d)
    data = content if content is not None else (d / name).read_bytes()[:1000]
    (d / name).write_bytes(data)
    return d


def _model_without(t: Path, model, name: str) -> Path:
    d = t / "model"
    shutil.copytree(model, d)
    (d / name).unlink()
    return d


def _file(path: Path) -> Path:
    path.write_bytes(b"\x00" * 64)
    return path


def _data(t: Path, documents: bytes, instructions: bytes = b"{}") -> list[str]:
    d = _webshop_data(t / "data", documents, instructions)
    return ["--set", "env.settings.catalog=real", "--set", f"env.settings.data_dir={d}"]


def _grid(t: Path, text: bytes) -> list[str]:
    (t / "grid.yaml").write_bytes(text)
    return ["ablate", str(t / "grid.yaml"), "--out", str(t / "abl")]


@pytest.mark.parametrize("name,setup,needles", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_one_line_exit_2_and_nothing_changes(
    name, setup, needles, expert_run, tiny_model_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(expert_run, run)
    args = setup(tmp_path, run, tiny_model_dir)
    before = tree_hash(tmp_path)
    one_line_error(cli(capsys, *args), *needles)
    assert tree_hash(tmp_path) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "abl").exists()


def test_enough_cases():
    assert len(CASES) >= 20


def test_hostile_action_strings_are_environment_feedback_not_crashes(capsys):
    """A policy's action is not the user's input: however long or strange, the environment
    answers with error feedback and the episode goes on (exit 0)."""
    actions = [
        "search[" + "x" * 100_000 + "]",
        "click[\x07\x1b[31mred\x1b[0m\x00]",
        "click[日本語 🚀 ñ]",
        "search[\u202eevil\u202c]",
        "]]][[[",
        "",
    ]
    code, out, err = cli(
        capsys,
        "env",
        "play",
        "--split",
        "train",
        "--task",
        "0",
        "--json",
        "--set",
        "settings.catalog=synthetic",
        "--actions",
        ";".join(actions[1:]),
    )
    assert code == 0, err
    assert "Traceback" not in err
    from serl_cli.rollout.worlds import EnvConfig, build_world

    world = build_world(EnvConfig(split="train", settings={"catalog": "synthetic"}))
    for action in actions:
        ep = world.new_episode("train", 10)
        ep.reset(0)
        step = ep.step(action)
        assert isinstance(step.observation, str) and not step.done
        if action.startswith("search["):  # a query of any text is a query (it may find nothing)
            assert step.feedback.error is None and "search" in step.feedback.diff
        else:  # anything else here is refused, with the reason
            assert step.feedback.error, action[:40]
