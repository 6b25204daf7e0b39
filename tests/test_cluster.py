"""Cluster hygiene: torch threads from the CPUs a process may use, shared by the node's ranks;
the process group bound to the GPU serl trains on, with ``train.dist_timeout_s``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from serl_cli.errors import SerlError
from serl_cli.training.train_config import TrainConfig, check_train_config

THREADS = """
import json, os, sys, torch
from serl_cli.models.loading import set_torch_threads
out = []
for cpus, explicit, env in json.loads(sys.argv[1]):
    os.sched_setaffinity(0, set(cpus))
    for k in ("SERL_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(env)
    set_torch_threads(explicit)
    out.append(torch.get_num_threads())
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this system")
def test_threads_are_the_cpus_a_process_may_use_shared_by_the_nodes_ranks():
    cpus = sorted(os.sched_getaffinity(0))
    n = str(len(cpus))
    cases = [  # (allowed CPUs, --threads, environment) -> threads
        ((cpus[:1], None, {}), 1),  # a Slurm task or taskset of one CPU, whatever the machine has
        ((cpus, None, {}), len(cpus)),
        ((cpus, None, {"LOCAL_WORLD_SIZE": n}), 1),  # torchrun: the node's ranks share them
        ((cpus, None, {"LOCAL_SIZE": n}), 1),  # the deepspeed launcher's name for it
        ((cpus[:1], None, {"LOCAL_WORLD_SIZE": "8"}), 1),  # never 0
        ((cpus[:1], 3, {}), 3),  # --threads / train.threads wins
        ((cpus, None, {"SERL_THREADS": "1"}), 1),
    ]
    out = subprocess.run(
        [sys.executable, "-c", THREADS, json.dumps([case for case, _ in cases])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [want for _, want in cases]


def test_the_group_is_bound_to_the_gpu_serl_trains_on():
    from serl_cli.training.distributed import process_group_options

    # train.gpus [2, ..., 7]: LOCAL_RANK 1 trains on cuda:3, and NCCL must be bound there, not to cuda:1
    options = process_group_options(torch.device("cuda", 3), world_size=6, timeout_s=5400)
    assert options == {"backend": "nccl", "timeout": timedelta(seconds=5400), "device_id": torch.device("cuda", 3)}
    assert "device_id" not in process_group_options(torch.device("cuda", 0), world_size=1, timeout_s=60)
    assert process_group_options(torch.device("cpu"), world_size=2, timeout_s=60) is None  # DeepSpeed's gloo


def test_the_timeout_is_a_checked_setting():
    assert TrainConfig().dist_timeout_s >= 3600  # generous: NCCL's own 10 minutes is what killed waiting ranks
    with pytest.raises(SerlError, match="dist_timeout_s must be positive"):
        check_train_config(TrainConfig(dist_timeout_s=0))


GROUP = """
import torch, torch.distributed as dist
from serl_cli.training.deepspeed import DeepSpeedBackend
from serl_cli.training.train_config import TrainConfig
DeepSpeedBackend(TrainConfig(backend="deepspeed", device="cpu", dist_timeout_s=1234))
print(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_the_deepspeed_group_waits_train_dist_timeout_s():
    pytest.importorskip("deepspeed")
    out = subprocess.run([sys.executable, "-c", GROUP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 1234.0
