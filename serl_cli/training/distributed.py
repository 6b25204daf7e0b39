"""The process group DeepSpeed runs in, and the op it loads on a CPU: joining a launcher's group (torchrun,
the deepspeed launcher) or making a group of one for plain ``serl train``, bound on CUDA to the GPU this
process trains on, with ``train.dist_timeout_s`` for every group; and DeepSpeed's shared-memory op built
or loaded under a lock that dies with its holder. The engine itself is :mod:`serl_cli.training.deepspeed`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from serl_cli.errors import SerlError
from serl_cli.training.deepspeed_config import MISSING


def import_deepspeed() -> ModuleType:
    if importlib.util.find_spec("deepspeed") is None:
        raise SerlError(MISSING)
    import deepspeed

    return deepspeed


SOLO_MARK = "SERL_SOLO_GROUP"  # "pid:port" of the process that made its own group of one


def _inherited_solo_group() -> bool:
    """True where the rank variables are exactly those another serl process set for its own group
    of one (its pid and port in ``SOLO_MARK``), not a launcher's: torchrun sets its own port and
    ``TORCHELASTIC_RUN_ID``, and the parent's port stays taken by the parent's store."""
    pid, _, port = os.environ.get(SOLO_MARK, "").partition(":")
    return (
        bool(pid)
        and pid != str(os.getpid())
        and port == os.environ.get("MASTER_PORT")
        and "TORCHELASTIC_RUN_ID" not in os.environ
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_options(device: torch.device, world_size: int, timeout_s: float) -> dict | None:
    """``torch.distributed.init_process_group``'s arguments where serl starts the group itself:
    on CUDA, NCCL bound to ``device``, the GPU this process trains on (``train.gpus[LOCAL_RANK]``;
    DeepSpeed would bind it to ``cuda:LOCAL_RANK``, comm/torch.py:280-281), with ``timeout_s``.
    None elsewhere: DeepSpeed starts its own (gloo or oneCCL on a CPU), given the timeout too.
    A group of one is not bound (DeepSpeed's reason, comm/torch.py:273-275: nothing to reach)."""
    if device.type != "cuda":
        return None
    options = {"backend": "nccl", "timeout": timedelta(seconds=timeout_s)}
    if world_size > 1:
        options["device_id"] = device
    return options


def every_group_times_out_after(timeout_s: float) -> None:
    """Make ``timeout_s`` torch's default for every process group made without a timeout of its own:
    DeepSpeed makes its groups with ``dist.new_group(ranks)`` (comm/torch.py ``new_group``,
    utils/groups.py), which takes torch's default, not the world group's -- 10 minutes under NCCL,
    30 under gloo -- so a rank left waiting on one whose peer had died waited that long whatever
    ``train.dist_timeout_s`` said."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)


def host_group(timeout_s: float) -> Any:
    """The group serl's own waits and object gathers go over: gloo, on the host. Under NCCL a rank
    that waits while another generates (rank 0's vLLM engine serves every group; an evaluation's
    share ends early) sat in an NCCL kernel on its GPU for the whole rollout, a GPU a vLLM
    tensor-parallel worker shares from another process; and ``all_gather_object`` staged every
    pickled object through GPU memory. A gloo group waits on a CPU thread and moves the bytes on
    the host. Where the world group is gloo already (a CPU), it is that group (None). Every process
    calls this once, in the same order (``new_group`` is a collective)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def extensions_dir() -> Path:
    """Where torch's JIT keeps DeepSpeed's compiled ops: ``$TORCH_EXTENSIONS_DIR``, else a folder of
    serl's cache for this Python environment. An op's compile commands name the environment's torch
    headers and libraries, so a second environment on the same folder recompiled it (about 80 s),
    and two environments used in turn -- CI's main and vLLM ones -- recompiled it again and again."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import hashlib

    from serl_cli.rollout.default_model import cache_root

    environment = hashlib.sha256(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
    return cache_root() / "torch_extensions" / environment


def load_shm_op() -> None:
    """Build or load DeepSpeed's shared-memory op (CPU accelerator) before DeepSpeed asks for it, with
    a lock that dies with its process. The first initialize on a CPU compiles it (about a minute),
    cached in :func:`extensions_dir`; ``.ci/run`` builds it
    before the tests, so that no test's time limit includes the compile.

    ``deepspeed.init_distributed`` loads the op through torch's JIT (comm/torch.py ``build_shm_op``),
    and every process -- even with the op built -- runs ninja holding torch's ``FileBaton``: a file
    ``lock`` in the build folder whose holder deletes it when done. A process killed in that window
    (Ctrl-C, a scheduler's kill, a test's SIGKILL) leaves the file, and every later process on that
    cache waits for it forever (``FileBaton.wait`` has no timeout). Here serl processes take an
    ``flock`` first, which the kernel releases when its holder dies: whoever holds it knows a
    ``lock`` file it finds is stale and removes it. The loaded op is kept by DeepSpeed
    (``OpBuilder._loaded_ops``), so its own call later takes no baton."""
    import fcntl

    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    extensions = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)  # torch's JIT, and the ranks launched after, read it
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # DeepSpeed would not load it either (comm/torch.py build_shm_op)
    extensions.mkdir(parents=True, exist_ok=True)
    with open(extensions / f".{builder.name}.serl-lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (extensions / builder.name / "lock").unlink(missing_ok=True)
        builder.load()


def init_distributed(deepspeed: ModuleType, device: torch.device | None = None, timeout_s: float = 7200) -> None:
    """Join the launcher's process group, or make a one-process group for plain ``serl train``;
    on CUDA bound to ``device``. ``timeout_s``: how long a collective waits for the other
    processes before the group gives up (``train.dist_timeout_s``; NCCL's default is 10 minutes)."""
    import torch.distributed as dist

    every_group_times_out_after(timeout_s)  # before DeepSpeed makes its groups
    if dist.is_available() and dist.is_initialized():
        return
    # Not started by torchrun / the deepspeed launcher: a group of one. Variables a parent serl process set
    # for its own group of one (marked with its pid and port) are inherited, not a launcher's: the child is alone too,
    # and must not reuse the parent's port, which the parent's store still holds.
    inherited = _inherited_solo_group()
    alone = "RANK" not in os.environ or inherited
    if alone:
        port = None if inherited else os.environ.get("MASTER_PORT")
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port or str(_free_port())
        )
        os.environ[SOLO_MARK] = f"{os.getpid()}:{os.environ['MASTER_PORT']}"
    load_shm_op()
    options = process_group_options(device or torch.device("cpu"), int(os.environ["WORLD_SIZE"]), timeout_s)
    for attempt in range(3):
        try:
            if options is not None:  # DeepSpeed adopts a group that is already up (comm/comm.py:878-881)
                dist.init_process_group(**options)
            deepspeed.init_distributed(verbose=False, timeout=timedelta(seconds=timeout_s))
            atexit.register(leave_group)
            return
        except RuntimeError as e:  # DistNetworkError: a free port picked, then taken by another process
            if not alone or "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            os.environ["MASTER_PORT"] = str(_free_port())
            os.environ[SOLO_MARK] = f"{os.getpid()}:{os.environ['MASTER_PORT']}"


def leave_group() -> None:
    """At exit, the process group taken down while the interpreter still runs: left to static destruction,
    a gloo group's worker threads were destroyed still joinable now and then, and the process aborted
    (``terminate called without an active exception``, SIGABRT) after its work was done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def choose_accelerator(device: torch.device) -> None:
    """DeepSpeed picks its accelerator when first imported: CUDA wherever torch sees a GPU.
    ``--device cpu`` on a GPU machine asks for its CPU accelerator instead."""
    if device.type == "cpu" and torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
