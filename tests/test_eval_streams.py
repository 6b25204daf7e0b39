"""Coupled sampling in an evaluation: every panel room draws from its own stream, keyed by the room."""

from serl_cli.rollout.engines import row_seed
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig, make_policy, run_eval


class RecordingEngine:
    """The model's own engine, with the row seeds of every call written down."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.row_seeds = engine, engine.tokenizer, []

    def generate(self, prompts, sampling, seed, row_seeds=None):
        self.row_seeds.append(row_seeds)
        return self.engine.generate(prompts, sampling, seed, row_seeds=row_seeds)


def _eval(model_dir, out, panel: str):
    env = EnvConfig(name="sokoban", split="test", max_turns=2)
    cfg = EvalConfig(
        env=env,
        model=str(model_dir),
        policy="model",
        episodes=4,
        panel=panel,
        seed=3,
        temperature=1.0,
        coupled=True,
        max_new_tokens=4,
        threads=1,
        out=str(out),
    )
    policy = make_policy(cfg)
    policy.engine = RecordingEngine(policy.engine)
    run_eval(cfg, policy=policy)
    return policy.engine.row_seeds


def test_each_panel_room_draws_from_its_own_stream_keyed_by_the_room(tiny_model_dir, tmp_path):
    first = _eval(tiny_model_dir, tmp_path / "first", "first")[0]
    assert first == [row_seed(3, (room, 0), 0) for room in range(4)]  # four streams, not group 0's four times
    assert len(set(first)) == 4
    spread = _eval(tiny_model_dir, tmp_path / "spread", "spread")[0]
    rooms = [i * 500 // 4 for i in range(4)]
    assert spread[0] == first[0] and spread[1:] == [row_seed(3, (room, 0), 0) for room in rooms[1:]]
