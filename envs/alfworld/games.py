"""Where ALFWorld's game files live and which games make up a split.

Pure file-system code: nothing here imports ``alfworld`` or ``textworld``, so the missing
data or the missing extra can be reported in one line before anything heavy loads.

A game is a folder ``json_2.1.1/<split>/<task>-<obj>-<mrecep>-<recep>-<scene>/<trial>/``
holding ``game.tw-pddl`` (the PDDL domain, grammar and problem) and ``traj_data.json``
(the task type and parameters). The split's panel is the sorted list of its playable game
files, so task ids mean the same games on every machine and worker count.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from envs.base import EnvError

SPLITS = ("train", "valid_seen", "valid_unseen")
GAME_FILE = "game.tw-pddl"
GAMES_DIR = "json_2.1.1"
TASK_TYPES = {  # ALFWorld's six task types and the short names eval tables use
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick two",
}
DOWNLOAD_HINT = (
    "upstream's `alfworld-download` fetches it (pip install 'serl[alfworld]'; ALFWORLD_DATA=DIR alfworld-download)"
)


@dataclass(frozen=True)
class Game:
    path: Path  # the game.tw-pddl file
    rel: str  # its path under the data root: the key plans are stored under
    split: str
    task_type: str  # one of TASK_TYPES

    @property
    def folder(self) -> Path:
        return self.path.parent


def data_root(data_dir: str | None = None) -> Path:
    """The folder holding ``json_2.1.1/``: the given one, else the first of
    ``$SERL_DATA_DIR/alfworld`` and ``$ALFWORLD_DATA`` that holds the games (importing
    alfworld sets ``ALFWORLD_DATA`` to its own cache folder, so it comes second)."""
    if data_dir:
        return Path(data_dir)
    candidates = [
        Path(os.environ[v]) / sub
        for v, sub in (("SERL_DATA_DIR", "alfworld"), ("ALFWORLD_DATA", ""))
        if os.environ.get(v)
    ]
    for path in candidates:
        if (path / GAMES_DIR).is_dir():
            return path
    if candidates:
        return candidates[0]
    raise EnvError(
        f"no ALFWorld data: set SERL_DATA_DIR (games in $SERL_DATA_DIR/alfworld/{GAMES_DIR}/) "
        f"or ALFWORLD_DATA; {DOWNLOAD_HINT}"
    )


def require_engine() -> None:
    """One line naming the extra when the engine is not installed."""
    missing = [m for m in ("alfworld", "textworld", "fast_downward") if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvError(
            f"the ALFWorld environment needs the {', '.join(missing)} package(s): pip install 'serl[alfworld]'"
        )


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise EnvError(f"unknown alfworld split {split!r}: choose one of {', '.join(SPLITS)}")
    return split


def is_playable(folder: Path) -> bool:
    """alfworld's own filter (``AlfredTWEnv.collect_game_files``): no movable or sliced
    variants, a game file present and marked solvable."""
    if "movable" in str(folder) or "Sliced" in str(folder):
        return False
    game = folder / GAME_FILE
    if not game.is_file() or not (folder / "traj_data.json").is_file():
        return False
    with open(game, encoding="utf-8") as f:
        return bool(json.load(f).get("solvable", False))


@cache
def _scan(root: str, split: str) -> tuple[Game, ...]:
    base = Path(root) / GAMES_DIR / split
    if not base.is_dir():
        raise EnvError(
            f"no ALFWorld games for split {split!r}: {base} does not exist; the data must be at "
            f"{Path(root)}/{GAMES_DIR}/<split>/; {DOWNLOAD_HINT}"
        )
    games = []
    for game_file in sorted(base.glob(f"*/*/{GAME_FILE}"), key=lambda p: p.as_posix()):  # by string, as games.tsv
        if not is_playable(game_file.parent):
            continue
        task_type = game_file.parent.parent.name.split("-")[0]
        if task_type in TASK_TYPES:
            games.append(Game(game_file, game_file.relative_to(root).as_posix(), split, task_type))
    if not games:
        raise EnvError(f"no playable ALFWorld games under {base}; {DOWNLOAD_HINT}")
    return tuple(games)


def list_games(root: Path, split: str) -> list[Game]:
    """The split's panel: its playable games, sorted by path."""
    return list(_scan(str(root), check_split(split)))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
