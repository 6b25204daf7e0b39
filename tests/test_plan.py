"""``serl plan`` and the checks ``serl train`` makes before it loads anything: model sizes from a
config.json, the per-rank memory by hand and against DeepSpeed's estimators, the paper layouts,
the launch and ``--parallel`` guards, and one measured CPU peak against the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support import assert_one_line_error, serl, serl_in_process

from serl_cli import config as cfgmod
from serl_cli.errors import SerlError
from serl_cli.models.shapes import KNOWN_SHAPES, ModelShape, model_shape
from serl_cli.online.config import OnlineConfig
from serl_cli.online.plan import ENV_MAX_TURNS, Machine, compare_layouts, layout_of, plan_run, uses_cuda
from serl_cli.training.launch import check_launch
from serl_cli.training.memory import GiB, Layout, activation_bytes, layer_activation_bytes, model_states
from serl_cli.training.plan import HEADROOM, VLLM_CONTEXT, VLLM_KEPT_ASLEEP, vllm_gpu

ROOT = Path(__file__).resolve().parents[1]
PAPER = sorted((ROOT / "experiments").glob("*/paper/*.yaml"))
Q7B = KNOWN_SHAPES["Qwen/Qwen2.5-7B"]


# the split layout of a paper config: 6 trainer GPUs, vLLM on GPUs 6-7 of its own
SPLIT_FLAGS = ["--set", "train.gpus=[0,1,2,3,4,5]", "--set", "rollout.gpus=[6,7]", "--set", "rollout.vllm.sleep=false"]
SPLIT_FLAGS += ["--set", "rollout.vllm.data_parallel=false"]


def paper(path: Path, **overrides) -> OnlineConfig:
    cfg = cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(path), path.stem)
    for key, value in overrides.items():
        *path, name = key.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return cfg


# -- model sizes ----------------------------------------------------------------------------------
def test_sizes_from_config_json_equal_the_models_own_count(tiny_model_dir):
    from serl_cli.models.loading import load_model

    model, _ = load_model(str(tiny_model_dir))
    assert model_shape(str(tiny_model_dir)).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, total, non_embedding",  # the Qwen2.5 model cards' figures, in billions
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", 0.49, 0.36),
        ("Qwen/Qwen2.5-1.5B-Instruct", 1.54, 1.31),
        ("Qwen/Qwen2.5-7B", 7.61, 6.53),
    ],
)
def test_known_hub_sizes_are_the_published_ones(name, total, non_embedding):
    shape = model_shape(name)  # not cached here (HF_HUB_OFFLINE): the known table
    embeddings = shape.embedding_params * (1 if shape.tied else 2)
    assert abs(shape.params / 1e9 - total) < 0.01 and abs((shape.params - embeddings) / 1e9 - non_embedding) < 0.01


def test_an_adapter_checkpoint_is_sized_by_its_base(tmp_path, tiny_model_dir):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    assert model_shape(str(tmp_path)) == model_shape(str(tiny_model_dir))
    with pytest.raises(SerlError, match="cannot size model 'org/unknown'"):
        model_shape("org/unknown")


# -- the estimate by hand -------------------------------------------------------------------------
def test_model_states_are_deepspeeds_per_parameter_counts():
    """ZeRO-2: 2 bytes of 16-bit weights per parameter + 18 over N (stage_1_and_2.py:4029-4031);
    ZeRO-3: 18 over N (stage3.py:4046) but for the tensors it keeps whole; torch: 16 + autocast's 2."""
    p, n = Q7B.params, 8

    def states(**kw):
        return {i.name: i.bytes for i in model_states(Q7B, Layout(half=True, ranks=n, **kw))}

    zero2 = states(backend="deepspeed", zero_stage=2)
    assert zero2["weights"] + zero2["gradients"] + zero2["optimizer"] == pytest.approx(2 * p + 18 * p / n)
    assert zero2["gradient bucket"] == 2 * 500_000_000  # reduce_bucket_size in bf16, reserved on a GPU
    zero3 = states(backend="deepspeed", zero_stage=3)
    assert zero3["weights"] + zero3["gradients"] + zero3["optimizer"] == pytest.approx(18 * p / n, rel=2e-3)
    torch_states = {i.name: i.bytes for i in model_states(Q7B, Layout(half=True))}
    assert torch_states["weights"] + torch_states["gradients"] + torch_states["optimizer"] == 16 * p
    offload = states(backend="deepspeed", zero_stage=3, offload=True)
    assert offload["weights"] == offload["optimizer"] == offload["gradients"] == 0  # all in CPU memory


def test_activations_by_hand():
    # h 8, q 8 (2 heads x 4), kv 4, i 16, 2 layers; fp32: norms 2 x (4 + 4) x 8 = 128,
    # attention 4 x (7 x 8 + 2 x 4) = 256, MLP 4 x 4 x 16 = 256 -> 640 bytes per token per layer
    shape = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10)
    lay = Layout(half=False, device="cpu", micro_batch_tokens=100)
    assert layer_activation_bytes(shape, lay) == 640
    assert activation_bytes(shape, lay, checkpointing=False) == 2 * 640 * 100
    # checkpointed: each layer's fp32 input (8 x 4 bytes) + one layer recomputed
    assert activation_bytes(shape, lay, checkpointing=True) == 2 * 32 * 100 + 640 * 100


# -- the paper layouts on one node of 8 x 80 GiB --------------------------------------------------
@pytest.mark.parametrize("path", PAPER, ids=lambda p: f"{p.parent.parent.name}-{p.stem}")
def test_the_paper_layouts_fit_one_node_with_headroom(path):
    """The paper configs run colocated: all 8 GPUs train, 4 engines of TP 2 generate on them, asleep
    during the update; and that is what serl plan's comparison picks over the split layout, which fits too."""
    machine = Machine(gpus=8, gpu_memory_gb=80)
    plan = plan_run(paper(path), machine)
    lay = plan.layout
    assert (lay.ranks, lay.zero_stage, lay.vllm_tp) == (8, 3, 2) and lay.colocated and lay.vllm_data_parallel
    assert lay.vllm_sleep and not plan.problems and plan.headroom >= HEADROOM, (plan.peak.name, plan.peak.bytes / GiB)
    kv = next(i for i in vllm_gpu(plan.shape, lay) if i.name == "KV cache")
    assert kv.bytes > 10 * GiB  # each engine's GPUs hold the weights' half and a large KV cache
    disk = sum(i.bytes for i in plan.disk) / GiB
    assert 95 < disk < 120  # 16-bit model, fp32 master + Adam, (serl) the teacher: ~16 bytes per parameter
    options, chosen, why = compare_layouts(paper(path), machine)
    shapes = {o.name: (o.generating, o.training, not o.plan.problems) for o in options}
    assert shapes == {"split": (2, 6, True), "colocated": (8, 8, True)}
    assert chosen.name == "colocated" and "(g + u)/8 against the split's g/2 + u/6" in why
    assert chosen.cfg.rollout.vllm.gpu_memory_utilization == paper(path).rollout.vllm.gpu_memory_utilization


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_a_problem_before_vllm_starts():
    """Qwen2.5-7B has 28 attention heads: TP 8 (one engine per node) is what vLLM refuses once it starts."""
    machine = Machine(gpus=8, gpu_memory_gb=80)
    cfg = paper(PAPER[0])
    cfg.rollout.vllm.tensor_parallel_size = 8
    plan = plan_run(cfg, machine)
    assert plan.shape.heads == 28
    assert (
        "vLLM splits the 28 attention heads over rollout.vllm.tensor_parallel_size, which 8 does not divide: "
        "choose one of 1, 2, 4" in plan.problems
    )
    cfg.rollout.vllm.tensor_parallel_size = 4
    assert not [p for p in plan_run(cfg, machine).problems if "attention heads" in p]


def test_a_colocated_7b_layout_fits_or_is_refused_with_its_reason():
    """At the authors' 0.75 vLLM share, WebShop's colocated layout leaves under 10 % free; the plan names the
    largest share that fits, the comparison takes it (the paper config's 0.60), and with no share that fits
    the comparison picks the split layout and says why."""
    machine = Machine(gpus=8, gpu_memory_gb=80)
    authors = {"rollout.vllm.gpu_memory_utilization": 0.75}
    webshop = plan_run(paper(ROOT / "experiments/webshop/paper/serl.yaml", **authors), machine)
    (reason,) = webshop.problems
    assert "generate phase" in reason and "gpu_memory_utilization at most 0.60" in reason
    options, chosen, _ = compare_layouts(paper(ROOT / "experiments/webshop/paper/serl.yaml", **authors), machine)
    assert chosen.name == "colocated" and chosen.cfg.rollout.vllm.gpu_memory_utilization == 0.60
    assert "--set rollout.vllm.gpu_memory_utilization=0.6 " in chosen.note and not chosen.plan.problems
    # 40 GiB GPUs, engines of TP 1: beside the trainer, no share holds the whole 7B model and a KV cache
    small, tp1 = Machine(gpus=8, gpu_memory_gb=40), {"rollout.vllm.tensor_parallel_size": 1}
    options, chosen, why = compare_layouts(paper(ROOT / "experiments/alfworld/paper/serl.yaml", **tp1), small)
    assert chosen.name == "split" and why.startswith("the colocated layout does not fit: vLLM's share (0.31 x 40 GiB)")
    assert [(o.name, o.generating, o.training) for o in options] == [("split", 1, 7), ("colocated", 8, 8)]


def test_the_torch_backend_refuses_a_7b_model():
    cfg = paper(ROOT / "experiments/webshop/paper/grpo.yaml", **{"train.backend": "torch"})
    plan = plan_run(cfg, Machine(gpus=8, gpu_memory_gb=80))
    assert plan.layout.ranks == 1 and "--backend deepspeed --zero-stage 3" in plan.problems[0]
    small = plan_run(cfg, Machine(gpus=8, gpu_memory_gb=80), model="Qwen/Qwen2.5-0.5B-Instruct")
    assert not small.problems  # 0.5B: 8 GiB of model states


def test_layout_reads_the_run_settings():
    cfg = paper(ROOT / "experiments/webshop/paper/serl.yaml")
    lay = layout_of(cfg, Machine(gpus=8, gpu_memory_gb=80, nodes=2))
    assert (lay.ranks, lay.ranks_per_node, lay.half, lay.teacher, lay.engine) == (16, 8, True, True, "vllm")
    assert lay.rollout_rows == 8  # 16 groups over 16 ranks: 1 group of 8 on a rank
    assert layout_of(cfg, Machine(), online=False).engine == "none"


# -- the command ----------------------------------------------------------------------------------
def test_serl_plan_prints_the_items_and_exits_1_when_it_does_not_fit():
    path = str(ROOT / "experiments/alfworld/paper/serl.yaml")
    ok = serl("plan", path)
    assert ok.returncode == 0, ok.stderr
    needles = ("optimizer", "activations", "logits", "teacher", "fits, with", "disk per checkpoint", "vLLM (colocated)")
    needles += ("save", "peak: the generate phase", "gathered for the save", "disk for the run", "rollouts")
    needles += ("vLLM layouts on this node", "serl would pick: colocated")
    for needle in needles:
        assert needle in ok.stdout, needle
    # the split layout, run with the flags the comparison prints for it
    (line,) = [x for x in ok.stdout.splitlines() if x.startswith("split: ")]
    flags = line.removeprefix("split: ").split(" (torchrun")[0].split()
    split = serl("plan", path, *flags)
    assert split.returncode == 0, split.stderr
    for needle in ("one vLLM GPU", "peak: the save phase", "on 6 trainer GPU(s); vLLM on 2 GPU(s) of its own"):
        assert needle in split.stdout, needle
    bad = serl("plan", path, "--set", "train.backend=torch", "--gpu-memory", "40")
    assert bad.returncode == 1 and "torch backend" in bad.stderr
    assert_one_line_error(serl("plan", path, "--gpus", "0"), "--gpus and --nodes must be at least 1")


def test_serl_plan_json_has_every_phase_per_rank_and_the_runs_disk():
    """The paper's ALFWorld SERL recipe in the split layout (6 ranks ZeRO-3, bf16): DeepSpeed moves the
    whole 16-bit model onto each GPU at start (serl does not load under zero.Init), and the checkpoint
    save gathers it whole on every rank, so the save is the peak; the run's disk counts the checkpoints
    kept, the final policy and every iteration's rollouts and annotations. Both layouts are in the JSON."""
    path = str(ROOT / "experiments/alfworld/paper/serl.yaml")
    out = serl_in_process("plan", path, "--json", *SPLIT_FLAGS)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)  # stdout is the one JSON object and nothing else
    phases = {p["name"]: p for p in plan["phases"]}
    assert list(phases) == ["start", "generate", "score", "update", "save"]
    for phase in phases.values():
        assert phase["bytes"] == pytest.approx(sum(i["bytes"] for i in phase["items"]), abs=len(phase["items"]))
    model16 = 2 * Q7B.params / GiB  # the whole model in bf16: 14.2 GiB
    start = {i["name"]: i["gib"] for i in phases["start"]["items"]}
    assert start["model load"] == pytest.approx(model16, abs=0.01) and 15 < phases["start"]["gib"] < 16
    save = {i["name"]: i["gib"] for i in phases["save"]["items"]}
    assert save["gathered for the save"] == pytest.approx(model16, rel=0.01)
    update = {i["name"]: i["bytes"] for i in phases["update"]["items"]}
    transient = update["activations"] + update["logits"]  # the update's own, gone by the save
    gathered = save["gathered for the save"] * GiB
    assert phases["save"]["bytes"] == pytest.approx(phases["update"]["bytes"] - transient + gathered, rel=1e-4)
    assert phases["save"]["bytes"] > phases["update"]["bytes"] > phases["score"]["bytes"]
    # ~41 GiB, plus the fp32 gradient bucket's other half (+0.93 GiB) and DeepSpeed's default live-parameter
    # limit of 1e9 gathered (+0.75 GiB over the largest tensor and the prefetch bucket)
    assert plan["peak"]["phase"] == "save" and 42.7 < plan["peak"]["gib"] < 42.9
    assert plan["verdict"] == "fits" and plan["fits"] and plan["problems"] == []
    assert plan["ranks"] == 6 and plan["headroom"] == pytest.approx(
        1 - plan["peak"]["bytes"] / plan["gpu_bytes"], abs=1e-4
    )

    run = plan["disk"]["run"]
    items = {i["name"]: i["bytes"] for i in run["items"]}
    assert set(items) == {"checkpoints", "final policy", "rollouts", "annotations"}
    assert run["bytes"] == pytest.approx(sum(items.values()), abs=4)
    assert items["checkpoints"] == pytest.approx(3 * plan["disk"]["checkpoint"]["bytes"], abs=2)  # keep_last 2 + 1
    # 2400 iterations x 16 tasks x 8 episodes x 50 turns (ALFWorld's limit) of 2048 + 512 tokens
    per_turn = items["rollouts"] / (2400 * 128 * 50)
    assert 2560 * 7 < per_turn < 2560 * 7 + 512 * 27 + 2048 + 1  # ids of up to 6 digits, log-probs, text
    assert items["rollouts"] > items["checkpoints"]  # never pruned: the largest thing a run leaves

    layouts = plan["layouts"]
    assert [(o["name"], o["generate_gpus"], o["train_gpus"], o["fits"]) for o in layouts["options"]] == [
        ("split", 2, 6, True),
        ("colocated", 8, 8, True),
    ]
    assert layouts["pick"] == "colocated" and "g/2 + u/6" in layouts["why"]
    colocated = json.loads(serl_in_process("plan", path, "--json").stdout)  # the config as it is
    start = {i["name"]: i["gib"] for i in colocated["phases"][0]["items"]}
    assert start["vLLM (colocated, awake)"] == pytest.approx(0.6 * 80, abs=0.01)  # it sleeps once the loop runs
    assert colocated["ranks"] == 8 and colocated["peak"]["phase"] == "generate" and colocated["fits"]

    typical = json.loads(serl_in_process("plan", path, "--json", "--turns", "25").stdout)
    rollouts = {i["name"]: i["bytes"] for i in typical["disk"]["run"]["items"]}["rollouts"]
    assert rollouts == pytest.approx(items["rollouts"] / 2, abs=2)
    assert_one_line_error(serl_in_process("plan", path, "--turns", "0"), "--turns must be at least 1")


def test_the_run_disk_of_an_algorithm_without_annotations_and_keep_last_0():
    cfg = paper(ROOT / "experiments/webshop/paper/grpo.yaml", keep_last=0, iterations=12, save_every=5)
    plan = plan_run(cfg, Machine(gpus=8, gpu_memory_gb=80))
    items = {i.name: i.bytes for i in plan.run_disk}
    assert "annotations" not in items  # grpo writes none
    assert items["checkpoints"] == pytest.approx(3 * sum(i.bytes for i in plan.disk))  # iterations 4, 9 and the last
    assert ENV_MAX_TURNS["webshop"] == 15 and str(15) in next(i.note for i in plan.run_disk if i.name == "rollouts")


def test_env_turn_limits_are_the_environments_own():
    from envs.alfworld.env import DEFAULT_MAX_TURNS as alfworld
    from envs.sokoban.env import SokobanConfig
    from envs.webshop.env import DEFAULT_MAX_TURNS as webshop

    assert ENV_MAX_TURNS == {"alfworld": alfworld, "webshop": webshop, "sokoban": SokobanConfig().max_turns}


def test_a_colocated_vllm_is_awake_while_the_trainer_starts():
    cfg = paper(ROOT / "experiments/alfworld/paper/serl.yaml")  # colocated, asleep during updates
    plan = plan_run(cfg, Machine(gpus=8, gpu_memory_gb=80))
    start = {i.name: i.bytes for i in plan.phases[0].items}
    save = {i.name: i.bytes for i in next(p for p in plan.phases if p.name == "save").items}
    assert start["vLLM (colocated, awake)"] == 0.6 * 80 * GiB  # asleep only once the loop runs
    assert start["vLLM's CUDA context"] == VLLM_CONTEXT  # outside the share
    assert {n: b for n, b in save.items() if n.startswith("vLLM")} == {
        "vLLM (colocated, asleep)": VLLM_CONTEXT + VLLM_KEPT_ASLEEP  # what sleep mode keeps
    }


def test_what_deepspeed_and_a_sleeping_vllm_hold_besides_the_states_by_formula():
    """Terms read off DeepSpeed 0.19.8 and vLLM 0.32: ZeRO-3's gradient bucket in the communication dtype (fp32 in
    serl's zero3.json), up to stage3_max_live_parameters (1e9 by default) gathered at once, the policy's shard set
    aside while the teacher scores under ZeRO-3, and a colocated engine's context and what it keeps asleep."""
    from serl_cli.training.memory import persistent_params

    cfg = paper(ROOT / "experiments/webshop/paper/serl.yaml")
    lay = layout_of(cfg, Machine(gpus=8, gpu_memory_gb=80))
    assert (lay.comm_bytes, lay.max_live_params, lay.reduce_bucket) == (4, 1_000_000_000, 500_000_000)
    states = {i.name: i.bytes for i in model_states(Q7B, lay)}
    assert states["gradient bucket"] == 500_000_000 * 4
    assert states["gathered layers"] == 2 * 1_000_000_000
    assert {i.name: i.bytes for i in model_states(Q7B, replace(lay, comm_bytes=2))}["gradient bucket"] == 1e9
    capped = replace(lay, max_live_params=10**6)  # never under the largest tensor and the prefetch bucket
    assert {i.name: i.bytes for i in model_states(Q7B, capped)}["gathered layers"] == 2 * (Q7B.largest_tensor + 5e7)
    plan = plan_run(cfg, Machine(gpus=8, gpu_memory_gb=80))
    phase = {p.name: {i.name: i.bytes for i in p.items} for p in plan.phases}
    persistent = persistent_params(plan.shape)
    shard = 2 * ((plan.shape.params - persistent) / 8 + persistent)
    assert phase["score"]["policy set aside"] == pytest.approx(shard)
    assert phase["generate"]["vLLM's CUDA context"] == VLLM_CONTEXT == 0.75 * GiB
    for name in ("score", "update", "save"):
        assert phase[name]["vLLM (colocated, asleep)"] == 1.5 * GiB


# -- serl train's guards --------------------------------------------------------------------------
def test_a_multi_gpu_config_started_as_one_process_gets_the_torchrun_line():
    argv = ["/venv/bin/serl", "train", "--config", "experiments/webshop/paper/serl.yaml"]
    with pytest.raises(SerlError) as e:
        check_launch([0, 1, 2, 3, 4, 5], {}, argv)
    assert (
        "torchrun --standalone --nproc_per_node 6 -m serl_cli train --config experiments/webshop/paper/serl.yaml"
        in str(e.value)
    )
    with pytest.raises(SerlError, match="8 processes were started on this node: start them with --nproc_per_node 6"):
        check_launch([0, 1, 2, 3, 4, 5], {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, argv)
    check_launch([2, 3, 4, 5, 6, 7], {"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "6"}, argv)  # 2 nodes x 6: right
    check_launch([0, 1], {"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, argv)  # the deepspeed launcher's variable
    check_launch([3], {}, argv)  # one GPU, one process
    with pytest.raises(SerlError, match="the torch backend trains on one"):
        check_launch([0, 1], {}, argv, backend="torch")


def test_which_runs_use_cuda():
    cfg = OnlineConfig()
    assert not uses_cuda(cfg, cuda_available=False) and uses_cuda(cfg, cuda_available=True)
    cfg.train.device = "cpu"
    assert not uses_cuda(cfg, cuda_available=True)
    cfg.rollout.engine = "vllm"
    assert uses_cuda(cfg, cuda_available=False)


@pytest.mark.slow
def test_serl_train_refuses_an_impossible_layout_before_loading(tmp_path):
    """A 70B-sized model on the torch backend, on this CPU: refused in one line from its
    config.json alone; --no-plan-check goes on to load it (and fails there: it has no weights)."""
    model = tmp_path / "big"
    model.mkdir()
    big = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    big |= dict(intermediate_size=28672, vocab_size=128256, model_type="llama")
    (model / "config.json").write_text(json.dumps(big))
    args = ["train", "--model", str(model), "--iterations", "1", "--out", str(tmp_path / "run"), "--device", "cpu"]
    assert_one_line_error(serl(*args), "weights, gradients and AdamW state", "--no-plan-check skips this")
    assert not (tmp_path / "run").exists()
    forced = serl(*args, "--no-plan-check")
    assert forced.returncode != 0 and "AdamW state" not in forced.stderr


def test_ablate_parallel_refuses_cells_on_gpus(tmp_path):
    from serl_cli.ablate.runners import check_parallel

    record = {"base": {"rollout": {"engine": "vllm"}}, "cells": [{"name": "a", "overrides": {}}]}
    record["cells"].append({"name": "b", "overrides": {}})
    with pytest.raises(SerlError, match="--parallel 2 would start 2 cells at once on the same GPUs"):
        check_parallel(record, tmp_path, 2, cuda_available=False)
    record["base"] = {"train": {"device": "cpu"}}
    check_parallel(record, tmp_path, 2, cuda_available=True)  # CPU cells may share the machine


# -- the plan against a measured CPU peak ---------------------------------------------------------
@pytest.mark.slow
def test_the_plan_is_within_25_percent_of_a_measured_peak(tiny_model_dir, tmp_path):
    """The tiny preset, torch backend, one GRPO update of 4096-token micro-batches in a fresh
    process, then a checkpoint save (benchmarks.plan_check's measurement, as docs/SCALING.md's
    table has it)."""
    model = repr(str(tiny_model_dir))
    code = (
        "import json, sys; from benchmarks.plan_check import Check, one, planned; c = Check('t', 'tiny');"
        f"m, p = one(c, {model}), planned(c, {model});"
        "print(json.dumps([m['peak_mb'], p['plan_mb'], m['save_mb'], p['plan_save_mb']]))"
    )
    from benchmarks.peak import MALLOC_ENV

    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    measured, planned, measured_save, planned_save = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.75 <= measured / planned <= 1.25, (measured, planned)
    assert 0.75 <= measured_save / planned_save <= 1.25, (measured_save, planned_save)  # the checkpoint save


def test_an_asynchronous_run_plans_its_producer_beside_every_phase():
    """max_staleness > 0: the producer's copy of the policy and its generation memory sit on the
    device through the trainer's phases (no generate phase of the trainer's own), and the run's
    disk counts the policy versions a resume needs."""
    cfg = OnlineConfig(model="Qwen/Qwen2.5-0.5B-Instruct", iterations=12, max_staleness=1)
    sync = plan_run(OnlineConfig(model=cfg.model, iterations=12), Machine(gpus=1, gpu_memory_gb=80))
    stale = plan_run(cfg, Machine(gpus=1, gpu_memory_gb=80))
    assert [p.name for p in sync.phases] == ["start", "generate", "score", "update", "save"]
    assert [p.name for p in stale.phases] == ["start", "score", "update", "save"]
    update = {i.name: i.bytes for i in next(p for p in stale.phases if p.name == "update").items}
    shape = model_shape(cfg.model)
    # the trainer's module precision: fp32 weights under the torch backend's bf16 autocast
    assert update["producer's policy"] == pytest.approx(4 * shape.params)
    assert "producer's KV cache" in update
    grown = (
        next(p for p in stale.phases if p.name == "update").bytes
        - next(p for p in sync.phases if p.name == "update").bytes
    )
    assert grown == pytest.approx(sum(v for k, v in update.items() if k.startswith("producer's")))
    versions = next(i for i in stale.run_disk if i.name == "policy versions")
    assert versions.bytes == pytest.approx((2 + 1 + 1) * 4 * shape.params) and versions.note == "4 at most"
    assert "policy versions" not in {i.name for i in sync.run_disk}


def test_the_vllm_producer_on_the_trainers_gpu_is_awake_through_every_phase():
    """max_staleness > 0 with --engine vllm on the trainer's GPU: the producer's engine generates beside the
    trainer's phases and never sleeps, so its whole share and its context sit in every phase; the hf
    producer's own copy of the policy is not counted (vLLM loads its own, inside that share)."""
    cfg = OnlineConfig(model="Qwen/Qwen2.5-0.5B-Instruct", iterations=12, max_staleness=1)
    cfg.rollout.engine = "vllm"
    cfg.rollout.vllm.sleep = True
    plan = plan_run(cfg, Machine(gpus=1, gpu_memory_gb=80))
    assert [p.name for p in plan.phases] == ["start", "score", "update", "save"]
    for phase in plan.phases[1:]:
        items = {i.name: i.bytes for i in phase.items}
        assert items["vLLM (producer, awake)"] == cfg.rollout.vllm.gpu_memory_utilization * 80 * GiB, phase.name
        assert items["vLLM's CUDA context"] == VLLM_CONTEXT and "vLLM (colocated, asleep)" not in items
        assert not any(name.startswith("producer's") for name in items)


def test_old_rollouts_gzip_or_delete_shrink_the_planned_records():
    base = ROOT / "experiments/alfworld/paper/serl.yaml"
    disk = {}
    for mode in ("keep", "gzip", "delete"):
        plan = plan_run(paper(base, iterations=100, old_rollouts=mode), Machine(gpus=8, gpu_memory_gb=80))
        disk[mode] = {i.name: i.bytes for i in plan.run_disk}
    one = disk["delete"]["rollouts"]  # the newest iteration's alone
    assert disk["keep"]["rollouts"] == pytest.approx(100 * one)
    assert disk["gzip"]["rollouts"] == pytest.approx((1 + 99 * 0.15) * one)
    assert disk["keep"]["annotations"] == pytest.approx(100 * disk["delete"]["annotations"])


SMOLLM2_CONFIG = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
SMOLLM2_CONFIG |= dict(intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, model_type="llama")


@pytest.mark.parametrize(("host_gib", "tokens"), [(64, 16384), (24, 8192), (12, 4096)])
def test_on_a_cpu_the_update_runs_in_the_largest_micro_batch_that_fits(tmp_path, monkeypatch, capsys, host_gib, tokens):
    """SmolLM2-135M's shape at the default 16,384-token micro-batch needs about 26 GiB on a CPU (fp32
    activations of 30 layers): on a smaller host the micro-batch halves until the update fits, said once."""
    from serl_cli.online import plan as online_plan

    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    monkeypatch.setattr(online_plan, "host_memory_bytes", lambda: host_gib * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = OnlineConfig(model=str(model))
    cfg.train.device = "cpu"
    plan = online_plan.preflight(cfg, online=True, model=str(model))
    assert plan is not None and not plan.problems and plan.layout.micro_batch_tokens == tokens
    assert cfg.train.optim.micro_batch_tokens == tokens
    said = capsys.readouterr().err.strip().splitlines()
    if tokens == 16384:
        assert said == []
    else:
        assert len(said) == 1 and f"micro-batches of {tokens} tokens" in said[0] and "was 16384" in said[0]


def test_on_a_cpu_too_small_for_any_micro_batch_the_update_is_refused(tmp_path, monkeypatch):
    from serl_cli.online import plan as online_plan

    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    monkeypatch.setattr(online_plan, "host_memory_bytes", lambda: 2.2 * GiB)
    cfg = OnlineConfig(model=str(model))
    cfg.train.device = "cpu"
    with pytest.raises(SerlError, match="GiB per GPU of 2 GiB"):
        online_plan.preflight(cfg, online=True, model=str(model))
    assert cfg.train.optim.micro_batch_tokens == 16384
