"""Journals: the finished units of an interrupted stage, which make a killed stage resumable.

A journal is an append-only JSONL file (docs/RELIABILITY.md) whose first line, its header, says
what the work is (config, inputs) and whose every later line is fsynced as the stage finishes
a unit of work (a torn last line is the unit that did not finish). A resume with other settings
than the header's is refused, naming the settings that differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from serl_cli.artifacts.jsonl import bounded_lines, count_jsonl, parse_record
from serl_cli.artifacts.plain_config import differences, differences_text
from serl_cli.artifacts.writes import atomic_write_text, prepare_output, write_failed
from serl_cli.errors import SerlError


def begin_resumable(
    target: Path, journal: Path, *, overwrite: bool, resume: bool, what: str, finished, records_of=None
) -> dict | None:
    """Start a stage that writes ``target`` and journals its units in ``journal``.

    With ``resume``: the finished stage's summary (``finished()``), once ``target`` is checked
    whole (``records_of(summary)``: how many records it must hold), or None to go on from the
    journal. Without: ``target`` must be new unless ``overwrite``, and a journal left by an
    interrupted pass is refused rather than silently thrown away."""
    if resume and not overwrite:
        summary = finished()
        if summary is not None:
            check_finished_output(target, what, records_of(summary) if records_of else None)
            journal.unlink(missing_ok=True)  # left by a kill between marking done and cleaning up
        return summary
    prepare_output(target, overwrite=overwrite, what=what, resumable=True)
    if journal.exists() and not overwrite:
        raise SerlError(
            f"{target.parent} holds an interrupted {what} pass ({journal.name}): pass --resume to "
            f"continue it or --overwrite to start again"
        )
    return None


def check_finished_output(target: Path, what: str, records: int | None = None) -> None:
    """A finished stage's JSONL output is whole before ``--resume`` vouches for it: every line
    a record and, where the stage counted them, as many as it wrote. Its journal is gone, so
    what was cut off cannot be rebuilt: the refusal says how to run the stage again."""
    again = f"pass --overwrite to run the {what} again"
    try:
        found = count_jsonl(target)
    except SerlError as e:
        raise SerlError(f"{e}; the finished {what} there is damaged: {again}") from None
    if records is not None and found != records:
        raise SerlError(
            f"{target} holds {found} records but the finished {what} wrote {records}: "
            f"the file was cut or edited; {again}"
        )


def start_journal(path: str | Path, header: dict) -> None:
    """A new journal holding only its header (what the work is: config, inputs)."""
    atomic_write_text(path, json.dumps({"journal": header}, separators=(",", ":")) + "\n")


def append_journal(path: str | Path, unit: dict) -> None:
    """Append one finished unit and fsync it before the stage moves on: O(1) per unit, and a
    kill mid-write leaves at most a torn last line, which :func:`read_journal` drops."""
    line = (json.dumps(unit, separators=(",", ":")) + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_failed(path, e, "the work journaled before is kept: make room and rerun with --resume") from None


def read_journal(path: str | Path, header: dict) -> list[dict]:
    """The finished units of a journal whose header equals ``header``; a torn last line
    (the unit a kill interrupted) is cut off the file."""
    path = Path(path)
    units, good = [], 0
    with open(path, "rb") as f:
        for lineno, raw in bounded_lines(f, path):
            if not raw.endswith(b"\n"):
                break  # the unit being written when the process died: it did not finish
            record = parse_record(raw, path, lineno)
            if lineno == 1:
                _check_header(path, record.get("journal"), header)
            else:
                units.append(record)
            good += len(raw)
    if good == 0:
        raise SerlError(f"{path} has no header line: delete it or pass --overwrite to start again")
    if good < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return units


def _check_header(path: Path, found, expected: dict) -> None:
    expected = json.loads(json.dumps(expected))  # compare as JSON sees it (tuples are lists)
    if found == expected:
        return
    if not isinstance(found, dict):
        raise SerlError(f"{path} is not a serl journal: delete it or pass --overwrite to start again")
    # the stage's settings first, named as the user sets them (sampling.temperature), then the rest
    every = differences(found.get("config"), expected.get("config"))
    every += differences(_without_config(found), _without_config(expected))
    every = [(key or "config", old, new) for key, old, new in every]  # "": a config that is not a mapping
    every = every or [("config", found.get("config"), expected.get("config"))]
    what = "a different setting" if len(every) == 1 else "different settings"
    raise SerlError(
        f"{path} belongs to an interrupted run with {what} ({differences_text(every)}): "
        f"resume with the same settings, or pass --overwrite to start again"
    )


def _without_config(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "config"}
