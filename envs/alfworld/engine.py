"""The real ALFWorld engine: TextWorld's PDDL environment with alfworld's wrappers.

Imported only when an ALFWorld episode is built, so the core runs without the extra.
We build the TextWorld environment ourselves (``textworld.start`` with ``AlfredDemangler``
and ``AlfredInfos``) rather than through ``AlfredTWEnv``, which ignores its expert setting
and shares one wrapper instance across batched slots.

Reset cost. A TextWorld PDDL state is built by fast-downward's Python translator
(``fast_downward.pddl2sas``), twice per state (a plain and an optimized encoding), and a
load builds one state and a reset another: that translator is nearly all of the 1-2 s a
game costs to start. Its output depends only on the domain and problem text, so it is
memoized here (:func:`install_translation_cache`): a game's later loads and resets reuse
it and cost only fast-downward's own ``load_sas``; TextWorld's grammar parses are
memoized the same way (:func:`install_parse_cache`). Each environment keeps its own copy
of the fast-downward library (``fast_downward.load_lib`` copies the ``.so``), so episodes
of one game never share a search state. Those copies are never unloaded: unloading one
(``fast_downward.close_lib``) crashes the process at exit, so the world reuses engines
instead of making new ones (``AlfWorldWorld.acquire``).
"""

from __future__ import annotations

import copy
import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TRANSLATIONS: OrderedDict = OrderedDict()  # (sha1 of domain+problem, optimize) -> (task, sas)
_MAX_TRANSLATIONS = 256  # about 2 x 128 games; a translation is ~1-2 MB of Python objects
_LOCK = threading.Lock()
_MEMOIZERS: set[Callable[..., Any]] = set()  # the wrappers installed here: installing twice wraps once


def install_translation_cache() -> None:
    """Memoize fast-downward's PDDL -> SAS translation for this process (idempotent).

    The translator's result is only read afterwards (its actions, types, objects and
    initial atoms), never changed, so episodes may share it. The translator also rewrites
    ``sys.argv`` as a side effect; the wrapper restores it.
    """
    import fast_downward

    original = fast_downward.pddl2sas
    if original in _MEMOIZERS:
        return

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        key = (hashlib.sha1((domain + "\0" + problem).encode("utf-8")).hexdigest(), bool(optimize))
        with _LOCK:
            hit = _TRANSLATIONS.get(key)
            if hit is not None:
                _TRANSLATIONS.move_to_end(key)
                return hit
        argv = list(sys.argv)
        try:
            result = original(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv[:] = argv
        with _LOCK:
            _TRANSLATIONS[key] = result
            while len(_TRANSLATIONS) > _MAX_TRANSLATIONS:
                _TRANSLATIONS.popitem(last=False)
        return result

    _MEMOIZERS.add(pddl2sas)
    fast_downward.pddl2sas = pddl2sas


def install_parse_cache() -> None:
    """Memoize TextWorld's grammar parser (idempotent).

    TextWorld parses text with tatsu when it loads a game (the game's logic and grammar)
    and again on every step (each admissible command's template is parsed before it is
    filled in): most of a step's time and of a new engine's. A parse depends only on its
    text; callers change what they get (they attach a context to each symbol), so each
    call gets its own deep copy of the cached result.
    """
    from textworld.envs.pddl import logic, textgen

    for module in (logic, textgen):
        original = module._parse_and_convert
        if original in _MEMOIZERS:
            continue
        module._parse_and_convert = _memoized_parse(original)


def _memoized_parse(parse: Callable[..., Any]) -> Callable[..., Any]:
    cache: dict = {}

    def cached(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        with _LOCK:
            hit = cache.get(key)
        if hit is None:
            hit = parse(*args, **kwargs)
            with _LOCK:
                if len(cache) > 20_000:
                    cache.clear()
                cache[key] = hit
        return copy.deepcopy(hit)

    _MEMOIZERS.add(cached)
    return cached


def start(game_file: str | Path, *, facts: bool = False, plan: bool = False):
    """A TextWorld environment on one game (loaded, not reset).

    ``facts``: the state's facts in readable names (the diff feedback and the hand-coded
    expert read them). ``plan``: the planner's plan from every state (``policy_commands``),
    seconds to minutes per state -- only ``serl data prepare`` asks for it.
    """
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    install_translation_cache()
    install_parse_cache()
    infos = textworld.EnvInfos(
        won=True, admissible_commands=True, facts=facts, policy_commands=plan, extras=["gamefile"]
    )
    # fresh wrapper instances per environment: a shared instance would share one game
    return textworld.start(str(game_file), request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])


def replay(game_file: str | Path, plan: list[str]) -> bool:
    """Whether ``plan`` wins the game when played from its start in a plain environment."""
    env = start(game_file)
    try:
        state = env.reset()
        for command in plan:
            if state["won"]:
                break
            state, _, _ = env.step(command)
        return bool(state["won"])
    finally:
        del env
