"""The rollout producer of ``max_staleness > 0`` and its trainer watch each other: a producer that dies
is noticed within seconds and ends the run in one line; a write to a dead one is that same error, never
a silent exit; a stop request (the job's SIGTERM, which reaches both) explains a death, so the loop
stops as at k = 0; the producer never outlives its trainer, even while it is still starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serl_cli.errors import SerlError
from serl_cli.online.producer import BackgroundProducer, ProducerSetup, ended
from serl_cli.rollout.worlds import EnvConfig


class Stop:
    requested = False


def producer(model: str = "/nonexistent/model", stop=None) -> BackgroundProducer:
    setup = ProducerSetup(run="/nonexistent/run", model=model, dtype=None, device="cpu", env=EnvConfig(name="sokoban"))
    return BackgroundProducer(setup, stop or Stop())


def test_how_a_process_ended_in_words():
    assert ended(0) == "exited with code 0"
    assert ended(3) == "exited with code 3"
    assert ended(-9) == "was killed by SIGKILL"
    assert ended(-15) == "was killed by SIGTERM"


def test_a_killed_producer_ends_take_within_seconds_in_one_line():
    p = producer()
    try:
        os.kill(p.process.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(SerlError, match=r"rollout producer \(pid \d+\) was killed by SIGKILL") as e:
            p.take(0)
        assert time.perf_counter() - t0 < 5
        assert "\n" not in str(e.value) and "--resume" in str(e.value)
    finally:
        p.close()


def test_a_write_to_a_dead_producer_is_the_same_error_not_a_broken_pipe():
    p = producer()
    try:
        os.kill(p.process.pid, signal.SIGKILL)
        p.process.wait(5)
        with pytest.raises(SerlError, match="was killed by SIGKILL"):
            for j in range(64):  # the first write may still fit the socket's buffer; the next ones cannot
                p.submit(j, 0, None)
                time.sleep(0.01)
    finally:
        p.close()


def test_a_producer_that_fails_says_why_even_when_the_trainer_writes_first():
    """It fails at start (no such model), sends its error and exits; the trainer's next write
    finds it gone and reads what it said, instead of a silent exit 1 on the broken pipe."""
    p = producer()
    try:
        p.process.wait(120)
        with pytest.raises(SerlError, match="the rollout producer failed: .*nonexistent"):
            for j in range(64):
                p.submit(j, 0, None)
                time.sleep(0.01)
    finally:
        p.close()


def test_a_stop_request_explains_a_death():
    """The job's SIGTERM reaches the producer too: its death is then no error, and the iteration it
    owed is abandoned (None), as at k = 0."""
    stop = Stop()
    p = producer(stop=stop)
    try:
        os.kill(p.process.pid, signal.SIGTERM)
        p.process.wait(5)
        stop.requested = True
        p.submit(1, 0, None)  # nothing raised
        made, waited = p.take(1)
        assert made is None and waited < 5
    finally:
        p.close()


STARTING_TRAINER = """
import sys, time
from serl_cli.online.producer import BackgroundProducer, ProducerSetup, ended
from serl_cli.rollout.worlds import EnvConfig

class Stop:
    requested = False

setup = ProducerSetup(run="/nonexistent", model="/nonexistent", dtype=None, device="cpu", env=EnvConfig(name="sokoban"))
p = BackgroundProducer(setup, Stop())
print(p.process.pid, flush=True)
time.sleep(600)
"""


def test_the_producer_dies_with_its_trainer_while_it_is_still_starting():
    """kill -9 of the trainer right after it started the producer, while the producer still imports
    torch (seconds): the kernel ends the producer with it; nothing is left after 2 s."""
    trainer = subprocess.Popen([sys.executable, "-c", STARTING_TRAINER], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    child = int(trainer.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    trainer.kill()
    trainer.wait(10)
    time.sleep(2)
    assert not alive(child), f"the producer {child} outlived its killed trainer"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state.lower()
