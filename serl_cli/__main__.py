"""``python -m serl_cli``: the same CLI, launchable as ``torchrun -m serl_cli train ...`` or
``deepspeed --module serl_cli train ...``."""

import os
import sys


def _take_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher passes ``--local_rank=N`` before the command; it also sets
    LOCAL_RANK, which is what serl reads, so the argument is dropped."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
        else:
            out.append(arg)
    return out


sys.argv[1:] = _take_local_rank(sys.argv[1:])

from serl_cli.cli import main  # noqa: E402

main()
