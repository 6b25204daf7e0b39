"""`serl show`: a hand-built run directory rendered as text, as JSON, and refused when malformed."""

from __future__ import annotations

import json

from rich.console import Console
from typer.testing import CliRunner

from serl_cli.artifacts import io
from serl_cli.artifacts.records import TURN_KEYS, Manifest
from serl_cli.artifacts.schema import ANNOTATION_KEYS
from serl_cli.cli import show as _show_cmd  # noqa: F401  (registers `show`)
from serl_cli.cli.root import app
from serl_cli.errors import SerlError
from serl_cli.views import show

LONG_TAIL = " lorem" * 100  # pushes an observation past show.OBS_CHARS


def _turn(i, obs, text, action, ids, error=None, diff="", reward=0.0, done=False):
    return {
        "turn": i,
        "observation": obs,
        "state_key": f"s{i}",
        "expert_action": None,
        "prompt_ids": [5, 6, 7],
        "action_ids": ids,
        "action_text": text,
        "action": action,
        "behaviour_logprobs": [-1.0] * len(ids),
        "next_observation": "",
        "next_state_key": "",
        "feedback": {"error": error, "diff": diff},
        "reward": reward,
        "done": done,
        "info": {},
    }


EPISODES = [
    {
        "task_id": 7,
        "group_id": 0,
        "rollout_index": 0,
        "reward": 0.0,
        "success": False,
        "instruction": "i need a red mug",
        "turns": [
            _turn(
                0,
                "WebShop [SEP] Instruction: [SEP] i need a red mug [SEP] Search" + LONG_TAIL,
                "<action>search[red mug]</action>",
                "search[red mug]",
                [10, 11, 12, 13],
                diff="now on the results page [SEP] Page 1",
            ),
            _turn(
                1,
                "Back to Search [SEP] B01 [SEP] Red Mug [SEP] $9.99",
                "<action>click[b0x]</action>",
                "click[b0x]",
                [20, 21, 22],
                error="no button click[b0x] on this page",
                diff="no change",
            ),
            _turn(
                2,
                "Back to Search [SEP] B01",
                "<action>click[b01]</action>",
                "click[b01]",
                [30, 31],
                diff="item page",
                done=True,
            ),
        ],
    },
    {
        "task_id": 7,
        "group_id": 0,
        "rollout_index": 1,
        "reward": 1.0,
        "success": True,
        "instruction": "i need a red mug",
        "turns": [
            _turn(0, "WebShop [SEP] Search", "<action>search[red mug]</action>", "search[red mug]", [10, 11]),
            _turn(
                1,
                "Item [SEP] Buy Now",
                "<action>click[buy now]</action>",
                "click[buy now]",
                [40, 41],
                reward=1.0,
                done=True,
            ),
        ],
    },
]
SELECTED_WEIGHTS = [1.0, 1.15, 0.85]  # episode 0, turn 1


def _annotations(episodes, weights):
    recs = []
    for e, ep in enumerate(episodes):
        for t, turn in enumerate(ep["turns"]):
            sel = (e, t) == (0, 1)
            recs.append(
                {
                    "episode": e,
                    "task_id": ep["task_id"],
                    "group_id": ep["group_id"],
                    "rollout_index": ep["rollout_index"],
                    "turn": t,
                    "selected": sel,
                    "sources": ["error"] if sel else [],
                    "fired": ["error"] if sel else [],
                    "hindsight": "[error] the button click[b0x] does not exist" if sel else None,
                    "action_mask": [1] * len(turn["action_ids"]),
                    "teacher_logprobs": [-0.5] * len(turn["action_ids"]) if sel else None,
                    "weights": weights if sel else None,
                    "advantage": -0.7 if e == 0 else 0.7,
                    "log_ratio_mean": 0.1234 if sel else None,
                    "distill": sel,
                }
            )
    assert all(set(ANNOTATION_KEYS) <= set(r) for r in recs)
    return recs


def make_run(path, *, model=None, annotations=True, episodes=EPISODES, weights=SELECTED_WEIGHTS):
    path.mkdir(parents=True, exist_ok=True)
    assert all(set(TURN_KEYS) <= set(t) for ep in episodes for t in ep["turns"])
    manifest = io.new_manifest("rollout", {"model": model, "policy": "model"}, 0)
    manifest["stages"]["rollout"]["status"] = "done"
    if annotations:
        manifest["stages"]["annotate"] = {"status": "done", "config": {"sources": "error", "weight_clip": 0.2}}
    io.write_json(path / "manifest.json", manifest)
    io.write_jsonl(path / "rollouts.jsonl", episodes)
    if annotations:
        io.write_jsonl(path / "annotations.jsonl", _annotations(episodes, weights))
    return path


def render(obj) -> str:
    con = Console(record=True, width=120)
    con.print(obj)
    return con.export_text()


def flat(text: str) -> str:
    """Rendered text with panel borders and line wrapping undone, for phrases that wrap."""
    return " ".join(line.strip().strip("│").strip() for line in text.splitlines())


def episode_text(run, index, **kw) -> str:
    manifest, episodes, ann = show.load_run(run)
    return render(show.episode_view(manifest, episodes, ann, index, **kw))


def test_run_view_lists_episodes_and_stages(tmp_path):
    run = make_run(tmp_path)
    text = render(show.run_view(run, *show.load_run(run)))
    assert "rollout" in text and "annotate" in text and "done" in text
    assert "selected" in text
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in text.splitlines() if line.startswith("│ ")]
    rows = [r for r in rows if len(r) == 9]
    assert rows == [
        ["0", "7", "0", "0", "0.000", "no", "3", "1", "1"],
        ["1", "7", "0", "1", "1.000", "yes", "2", "0", "0"],
    ], text
    assert "2 episodes, success 0.500, 1 of 5 turns selected" in text


def test_run_view_without_annotations_has_no_selected_column(tmp_path):
    run = make_run(tmp_path, annotations=False)
    assert "selected" not in render(show.run_view(run, *show.load_run(run)))
    text = episode_text(run, 0)
    assert "not annotated" in text and "SELECTED" not in text and "[SEP]" in text


def test_episode_view_shows_turns_feedback_selection_and_weights(tmp_path):
    text = episode_text(make_run(tmp_path), 0)
    assert "WebShop [SEP] Instruction: [SEP] i need a red mug [SEP] Search" in text  # escaped, not eaten as markup
    assert "more characters; --full shows all" in flat(text) and flat(text).count("lorem") < 100
    assert "<action>click[b0x]</action>" in text and "click[b01]" in text
    assert "no button click[b0x] on this page" in text and "now on the results page [SEP] Page 1" in text
    assert text.count("SELECTED") == 1 and "DISTILL" in text
    selected_panel = text[text.index("SELECTED") : text.index("turn 2")]
    assert "[error] the button click[b0x] does not exist" in selected_panel
    assert "+0.1234" in selected_panel
    assert "0:1.000 1:1.150 2:0.850" in selected_panel  # fallback: no tokenizer -> numbers per index
    assert "3 tokens: 1 up (max 1.150), 1 down (min 0.850), 1 at 1" in selected_panel
    assert "the manifest names no rollout model" in text and "green: up-weighted" in text
    assert "(no block)" in text and "all 1" in text
    assert "SELECTED" not in episode_text(tmp_path, 1)


def test_turn_and_full_options(tmp_path):
    run = make_run(tmp_path)
    text = episode_text(run, 0, turn=1)
    assert "turn 1" in text and "turn 0" not in text and "turn 2" not in text
    full = episode_text(run, 0, full=True)
    assert "more characters" not in flat(full) and flat(full).count("lorem") == 100


def test_missing_model_dir_falls_back_to_numbers(tmp_path):
    run = make_run(tmp_path, model=str(tmp_path / "no-such-model"))
    text = episode_text(run, 0)
    assert "not found" in text and "1:1.150" in text


def test_tokenizer_path_decodes_each_token(tmp_path):
    from serl_cli.models.tiny import train_tokenizer

    texts = ["<action>search[red mug]</action>", "<action>click[b0x]</action>", "click[buy now] red mug"] * 20
    tok = train_tokenizer(texts, 300)
    tok.save_pretrained(tmp_path / "model")
    ids = tok.encode("<action>click[b0x]</action>")
    pieces = [tok.decode([i]) for i in ids]
    assert len(pieces) > 1
    episodes = json.loads(json.dumps(EPISODES))
    episodes[0]["turns"][1]["action_ids"] = ids
    weights = [1.0 + 0.1 * (i % 3 - 1) for i in range(len(ids))]
    run = make_run(tmp_path / "run", model=str(tmp_path / "model"), episodes=episodes, weights=weights)
    text = episode_text(run, 0, turn=1)
    assert "".join(pieces) in text  # the tokens, decoded one by one, rebuild the action text
    assert "token-index" not in text and "0:1.000" not in text
    assert f"{len(ids)} tokens:" in text


def test_cli_json_merges_annotations(tmp_path):
    run = make_run(tmp_path)
    result = CliRunner().invoke(app, ["show", str(run), "--episode", "0", "--json"])
    assert result.exit_code == 0, result.output
    ep = json.loads(result.output)
    assert ep["episode"] == 0 and len(ep["turns"]) == 3
    assert [t["annotation"]["selected"] for t in ep["turns"]] == [False, True, False]
    assert ep["turns"][1]["annotation"]["weights"] == SELECTED_WEIGHTS
    assert ep["turns"][0]["observation"].startswith("WebShop [SEP]")
    one = json.loads(CliRunner().invoke(app, ["show", str(run), "--episode", "1", "--turn", "1", "--json"]).output)
    assert len(one["turns"]) == 1 and one["turns"][0]["action"] == "click[buy now]"
    rows = json.loads(CliRunner().invoke(app, ["show", str(run), "--json"]).output)
    assert [r["selected_turns"] for r in rows] == [1, 0]


def test_cli_renders_episode(tmp_path):
    run = make_run(tmp_path)
    result = CliRunner().invoke(app, ["show", str(run), "--episode", "0", "--width", "100"])
    assert result.exit_code == 0, result.output
    assert "[SEP]" in result.output and "SELECTED" in result.output


def _bad(run, args):
    result = CliRunner().invoke(app, ["show", str(run), *args])
    assert isinstance(result.exception, SerlError), result.output
    return str(result.exception)


def test_bad_inputs(tmp_path):
    assert "run directory not found" in _bad(tmp_path / "nope", [])
    assert "not a serl run directory" in _bad(tmp_path, [])
    run = make_run(tmp_path / "r")
    assert _bad(run, ["--episode", "2"]) == "episode 2 out of range: there are 2 (0 to 1)"
    assert _bad(run, ["--episode", "-1"]) == "episode -1 out of range: there are 2 (0 to 1)"
    assert _bad(run, ["--episode", "1", "--turn", "5"]) == "turn 5 out of range: there are 2 (0 to 1)"
    assert _bad(run, ["--turn", "0"]) == "--turn needs --episode"
    ann = run / "annotations.jsonl"
    good = ann.read_text()
    ann.write_text(good + "{not json\n")
    assert _bad(run, []).endswith("annotations.jsonl:6: not a JSON record")
    rec = json.loads(good.splitlines()[0])
    del rec["weights"]
    ann.write_text(json.dumps(rec) + "\n")
    assert _bad(run, []).endswith("annotations.jsonl:1: record lacks weights")
    ann.write_text(json.dumps(dict(rec, weights=None, episode=9)) + "\n")
    assert "episode 9 turn 0 is not a turn of" in _bad(run, [])
    ann.write_text(json.dumps(dict(rec, weights=[1.0])) + "\n")
    assert _bad(run, []).endswith("annotations.jsonl:1: weights and action_mask differ in length")
    ann.write_text(json.dumps(dict(rec, weights=[1.0], action_mask=[1])) + "\n")
    assert "weights must be a list of one number per action token (4)" in _bad(run, [])
    ann.write_text(json.dumps(dict(rec, weights=[1.0, "x", 1.0, 1.0])) + "\n")
    assert 'annotations.jsonl:1: weights must be a list of numbers or null, got [1.0, "x"' in _bad(run, [])
    ann.write_text(good + good.splitlines()[0] + "\n")
    assert "a second record for episode 0 turn 0" in _bad(run, [])
    ann.write_text(good)
    manifest = io.read_json(run / "manifest.json")
    manifest["stages"]["annotate"]["rollouts_sha256"] = "0" * 16
    io.write_json(run / "manifest.json", manifest)
    assert "was made from other rollouts" in _bad(run, [])


def test_cli_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    code = f"import sys; from serl_cli.cli import main; sys.argv = ['serl', 'show', {str(tmp_path / 'nope')!r}]; main()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "run directory not found" in out.stderr


def test_an_ablation_folder_points_to_its_report(tmp_path):
    """`serl show` on `serl ablate`'s output (grid.json and one folder per cell) said "not a serl
    run directory"; it names the command that shows an ablation."""
    (tmp_path / "grid.json").write_text("{}")
    (tmp_path / "grpo_s0").mkdir()
    assert _bad(tmp_path, []) == (
        f"{tmp_path} is an ablation directory (grid.json), not a run: use serl ablate --report {tmp_path}"
    )


def test_an_online_runs_folders_are_never_cut_at_80_columns():
    """The iteration folders' names are what `serl show RUN/iter_XXXX` takes: at 80 columns they
    were cut to iter_00…; the numbers' columns give way instead."""
    from serl_cli.views import show_online

    rows = [
        {"folder": f"iter_{k:04d}", "status": "done", "episodes": 128, "checkpoint": k == 11}
        | {key: 0.123456 for _, key in show_online.ITERATION_COLUMNS}
        for k in range(12)
    ]
    manifest = Manifest.from_dict({"stages": {"online": {"status": "done", "config": {"iterations": 12}}}})
    for width in (80, 60):
        console = Console(width=width, record=True)
        console.print(show_online.online_view("runs/sokoban/serl", manifest, rows))
        text = console.export_text()
        assert all(f"iter_{k:04d}" in text for k in range(12)), text
