"""What each required field of a run record must be: a wrong type is refused on reading, not found
mid-update. ``EPISODE_TYPES``, ``TURN_TYPES`` and ``ANNOTATION_TYPES`` map a field to its check and
the words of the refusal; :func:`check_types` applies one of them to a record as read
(``serl_cli.artifacts.records``: ``from_dict``).
"""

from __future__ import annotations

import json
import math

from serl_cli.errors import SerlError


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _token_ids(v) -> bool:  # the model's vocabulary bounds them above, where it is known (Learner.update)
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _finite(v) -> bool:  # JSON's NaN and Infinity parse as floats: a reward that is one poisons every advantage
    return type(v) in (int, float) and math.isfinite(v)


def _numbers(v) -> bool:
    return isinstance(v, list) and all(type(x) in (int, float) for x in v)


def _number(v) -> bool:
    return type(v) in (int, float)


EPISODE_TYPES = {
    "task_id": (lambda v: type(v) is int, "an integer"),
    "group_id": (lambda v: type(v) is int, "an integer"),
    "rollout_index": (lambda v: type(v) is int, "an integer"),
    "reward": (_finite, "a finite number"),
    "success": (lambda v: type(v) is bool, "true or false"),
}
TURN_TYPES = {
    "prompt_ids": (_token_ids, "a list of token ids (integers from 0)"),
    "action_ids": (_token_ids, "a list of token ids (integers from 0)"),
    "behaviour_logprobs": (_numbers, "a list of numbers"),
    "action_text": (lambda v: isinstance(v, str), "a string"),
    "reward": (_finite, "a finite number"),
    "done": (lambda v: type(v) is bool, "true or false"),
    "state_key": (lambda v: isinstance(v, str), "a string"),
}


def _optional(check):
    return lambda v: v is None or check(v)


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _int(v) -> bool:
    return type(v) is int


def _bool(v) -> bool:
    return type(v) is bool


ANNOTATION_TYPES = {
    "episode": (_int, "an integer"),
    "task_id": (_int, "an integer"),
    "group_id": (_int, "an integer"),
    "rollout_index": (_int, "an integer"),
    "turn": (_int, "an integer"),
    "selected": (_bool, "true or false"),
    "sources": (_strings, "a list of source names"),
    "fired": (_strings, "a list of source names"),
    "hindsight": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "action_mask": (_ints, "a list of 0s and 1s"),
    "teacher_logprobs": (_optional(_numbers), "a list of numbers or null"),
    "weights": (_optional(_numbers), "a list of numbers or null"),
    "advantage": (_number, "a number"),
    "log_ratio_mean": (_optional(_number), "a number or null"),
    "distill": (_bool, "true or false"),
}


def check_types(record: dict, types: dict, where: str) -> None:
    """Refuse, in one line after ``where``, the first field of ``record`` whose value fails its check in ``types``."""
    for key, (ok, what) in types.items():
        if not ok(record[key]):
            raise SerlError(f"{where} {key} must be {what}, got {json.dumps(record[key])[:60]}")
