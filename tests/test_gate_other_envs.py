"""The teacher gate beyond Sokoban: the blind-copy check's wrong move where no move deadlocks."""

from serl_cli.method.diagnostics import teacher_gate as gate
from serl_cli.method.sft.reading import episode_at
from serl_cli.rollout.policies import RandomPolicy
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import build_world
from tests.support import synthetic_env


def test_where_no_move_deadlocks_the_wrong_move_is_an_admissible_one_other_than_the_experts():
    env = synthetic_env(max_turns=3)
    world = build_world(env)
    episodes = run_episodes(world, "train", [EpisodeSpec(task_id=t) for t in range(4)], RandomPolicy(0), max_turns=3)
    kind, found = gate.wrong_move_turns(episodes, world, "train", seen=set())
    assert kind == "admissible, not the expert's" and found
    for e, t, move in found:
        turn = episodes[e].turns[t]
        state = episode_at(world, "train", episodes[e].task_id, [x.action for x in episodes[e].turns[:t]])
        assert move != turn.expert_action and move in state.admissible_actions()
    assert gate.wrong_move_turns(episodes, world, "train", seen=set()) == (kind, found)  # seeded
    seen = {episodes[e].turns[t].state_key for e, t, _ in found[:2]}
    _, held = gate.wrong_move_turns(episodes, world, "train", seen=seen)
    assert all(episodes[e].turns[t].state_key not in seen for e, t, _ in held) and len(held) < len(found)


def gate_script():
    """experiments/sokoban/teacher_gate.py, imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "sokoban" / "teacher_gate.py"
    spec = importlib.util.spec_from_file_location("teacher_gate_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gate_script_measures_sokoban_unless_its_config_names_another_environment(tmp_path):
    """Without --config the panel is Sokoban's (the studies' gate), not the rollout settings' default
    environment; a run file's environment is used as it is."""
    from pathlib import Path

    script = gate_script()
    experiments = Path(__file__).resolve().parents[1] / "experiments"
    assert script.prompting(str(tmp_path), None).env.name == "sokoban"
    assert script.prompting(str(tmp_path), None).sampling.max_new_tokens == 3
    assert script.prompting(str(tmp_path), str(experiments / "smollm2" / "webshop.yaml")).env.name == "webshop"
    assert script.prompting(str(tmp_path), str(experiments / "smollm2" / "sokoban.yaml")).env.name == "sokoban"
