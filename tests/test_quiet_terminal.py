"""On a terminal, serl shows its own lines and progress only: no library progress bars.

Logs redirected to a file were always clean (serl turns library bars off when stderr is not a
terminal), so only a real terminal shows what a user sees: here a pseudo-terminal (``pty``) with
a window size, which tqdm needs to draw a bar at all (at width 0 it draws empty lines)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from envs.sokoban.env import SokobanWorld
from serl_cli.models.tiny import init_model
from serl_cli.rollout.default_model import tokenizer_corpus

# what the libraries' bars and notices print: transformers' model loading and saving, tqdm's
# rate and bar, DeepSpeed's accelerator notice
LIBRARY_TEXT = ("Loading weights", "Writing model shards", "it/s]", "s/it]", "%|", "[WARNING]")


def run_on_terminal(args: list[str], env: dict, timeout: float = 600) -> tuple[int, str]:
    """Run ``args`` with stdin, stdout and stderr on a 120 x 40 pseudo-terminal; (exit code, all it printed)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed: every process writing to it has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.slow
def test_the_quick_demo_on_a_terminal_shows_no_library_progress_bars(tmp_path):
    """``serl demo --quick`` loads and saves models in this process and in the two it spawns
    for the arms: every one of them must keep the libraries quiet."""
    micro = init_model("micro", tmp_path / "micro", tokenizer_corpus(SokobanWorld(), episodes=50))
    # as from a user's shell: none of the switches the test session sets for itself
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}
    env["TERM"] = "xterm"
    demo = ["demo", "--quick", "--set", f"model={micro}", "--out", str(tmp_path / "demo")]
    code, text = run_on_terminal([sys.executable, "-m", "serl_cli", *demo], env)
    assert code == 0, text
    assert "[1/5] model" in text and "[5/5] eval warm start" in text and "What happened" in text  # serl's own
    shown = [needle for needle in LIBRARY_TEXT if needle in text]
    assert not shown, f"library output on the terminal ({shown}):\n{text}"
