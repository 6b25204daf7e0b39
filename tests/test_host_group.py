"""serl's waits and object gathers go over a gloo group on the host, whatever the world group's backend."""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from serl_cli.training.distributed import host_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        on_gloo = host_group(60)  # a gloo world: its own group serves
        real = dist.get_backend
        # the world group as NCCL reports it on a GPU node (CPU-only here: the backend's name is what differs)
        dist.get_backend = lambda group=None: "nccl" if group is None else real(group)
        try:
            host = host_group(60)
        finally:
            dist.get_backend = real
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank}, group=host)
        dist.barrier(group=host)
        results.put((rank, on_gloo is None, host is not None and host != dist.group.WORLD, real(host), gathered))
    finally:
        dist.destroy_process_group()


def test_waits_go_over_a_gloo_group_of_their_own_where_the_world_is_nccl():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, world_group_used, own_group, backend, gathered in out:
        assert world_group_used, "on a gloo world the world group itself is the host group"
        assert own_group and backend == "gloo", (rank, backend)
        assert gathered == [{"rank": 0}, {"rank": 1}]


class RecordingDist:
    """torch.distributed's two calls the backend makes between steps, recording the group each went over."""

    def __init__(self):
        self.groups = []

    def all_gather_object(self, out, obj, group=None):
        self.groups.append(("all_gather_object", group))
        out[:] = [obj] * len(out)

    def barrier(self, group=None):
        self.groups.append(("barrier", group))


def test_the_deepspeed_backend_gathers_and_waits_on_its_host_group():
    from serl_cli.training.deepspeed import DeepSpeedBackend

    backend = object.__new__(DeepSpeedBackend)  # its two collectives alone: no engine, no process group
    backend._dist, backend._host, backend.world = RecordingDist(), "the host group", 2
    assert backend.all_gather({"a": 1}) == [{"a": 1}, {"a": 1}]
    backend.barrier()
    assert backend._dist.groups == [("all_gather_object", "the host group"), ("barrier", "the host group")]
