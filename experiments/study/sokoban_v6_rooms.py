"""How many Sokoban rooms the test panel and the train split share, by room, with and without
``disjoint_rooms`` (docs/SOKOBAN.md, docs/studies/sokoban_v6.md).

    python experiments/study/sokoban_v6_rooms.py --train 100000 > rooms.json

Counts, for the default 6x6 one-box settings: distinct rooms among the first 200 and all 500 test
rooms; among the first ``--train`` train tasks, how many rooms are panel rooms by default (the tasks
``disjoint_rooms`` redraws), how many are among the first 200 (the panel of studies v4 and v5) and how
many distinct panel rooms they cover; then the same tasks under
``disjoint_rooms``: how many rooms changed, whether any is a panel room, and the distinct rooms of each.
"""

from __future__ import annotations

import argparse
import json
import time

from envs.sokoban.env import SokobanConfig, SokobanWorld
from envs.sokoban.rooms import Room


def train_rooms(world: SokobanWorld, count: int) -> list[Room]:
    """The rooms of train tasks 0..count-1."""
    return [world.room("train", i) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=100_000, help="train tasks to count (the split has 100,000)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    default = SokobanWorld()
    panel = [default.room("test", i) for i in range(default.num_tasks("test"))]
    panel_set = frozenset(panel)
    plain = train_rooms(default, args.train)
    disjoint = train_rooms(SokobanWorld(SokobanConfig(disjoint_rooms=True)), args.train)
    in_panel = [r in panel_set for r in plain]
    first_200 = frozenset(panel[:200])
    out = {
        "test": {
            "rooms": len(panel),
            "distinct_first_200": len(set(panel[:200])),
            "distinct_first_500": len(panel_set),
        },
        "train_tasks": args.train,
        "default": {
            "panel_rooms": sum(in_panel),
            "panel_room_fraction": round(sum(in_panel) / args.train, 4),
            "distinct_rooms": len(set(plain)),
            "distinct_panel_rooms_covered": len(panel_set & set(plain)),
            "first_200_panel_rooms_covered": len(first_200 & set(plain)),
            "first_200_panel_room_tasks": sum(r in first_200 for r in plain),
        },
        "disjoint_rooms": {
            "rooms_changed": sum(a != b for a, b in zip(plain, disjoint, strict=True)),
            "changed_only_where_default_was_a_panel_room": all(
                (a != b) == hit for a, b, hit in zip(plain, disjoint, in_panel, strict=True)
            ),
            "panel_rooms": sum(r in panel_set for r in disjoint),
            "distinct_rooms": len(set(disjoint)),
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
