"""Command-line flags generated from the settings: each flag declared once, in :data:`FLAGS`.

A declaration names the flag, the commands that show it and the setting (a key path of the
command's settings dataclass) it sets in each, and, where the setting's own doc does not say what
the flag means in a command, its help. The rest is read from the settings dataclass: the type (a
``Literal`` becomes a choice: ``--device <auto|cpu|cuda>``, a bad word is click's usage error,
exit 2), the default ``--help`` shows (the flags themselves default to None, so that a config file
can set them) and the help. :func:`settings_command` makes a command's typer options from them,
adds the options every command shares (``--config``, ``--set``, ``--seed``, ``-q``, ``-v``) and
hands the command body one :class:`Given`, so that a body is its logic alone.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import types
import typing
from typing import Any

import typer

from serl_cli import config as cfgmod
from serl_cli.cli.common import resolve
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: ``name`` (``--group-size``); ``sets``: the command -> the key path of the setting
    it sets there (the commands not named do not show it); ``help``: its help where the setting's
    doc does not say it, for every command (a string) or by command (a mapping); ``show_default``:
    False where the settings' default is not the command's (a run file decides it)."""

    name: str
    sets: dict[str, str]
    help: str | dict[str, str] | None = None
    show_default: bool = True

    @property
    def param(self) -> str:
        """The command function's parameter for this flag (``--group-size`` -> ``group_size``)."""
        return self.name.removeprefix("--").replace("-", "_")

    def help_in(self, command: str) -> str | None:
        return self.help.get(command) if isinstance(self.help, dict) else self.help


def flag(name: str, *, help: str | dict[str, str] | None = None, show_default: bool = True, **sets: str) -> Flag:
    """``flag("--device", rollout="device", train="train.device")``: a :class:`Flag`, its commands
    as keywords."""
    return Flag(name, sets, help, show_default)


ONLINE = "Online loop: "  # the train command's flags that only its online loop reads

# Every flag that sets a setting; each command lists its own in this order.
FLAGS: tuple[Flag, ...] = (
    flag("--algo", train="train.algo"),
    flag(
        "--algo",
        annotate="train.algo",
        show_default=False,
        help="The algorithm the annotations feed (default serl; else the run config's train.algo): its needs "
        "are applied (rlsd: placement all, tokens reply; distillation: skip_zero_advantage false), and the "
        "train settings (--config RUN_FILE, --set train.KEY=VALUE) sign the weights, as in the online loop.",
    ),
    flag(
        "--env",
        train="env.name",
        rollout="env.name",
        eval="env.name",
        help={"train": "Environment for the online loop."},
    ),
    flag("--split", rollout="env.split", eval="env.split"),
    flag("--model", train="model", rollout="model", eval="model"),
    flag("--policy", rollout="policy", eval="policy"),
    flag("--sources", annotate="sources"),
    flag("--granularity", annotate="granularity"),
    flag("--placement", annotate="placement"),
    flag("--teacher", annotate="teacher"),
    flag("--backend", train="train.backend"),
    flag("--deepspeed-config", train="train.deepspeed.config"),
    flag("--zero-stage", train="train.deepspeed.zero_stage"),
    flag("--offload", train="train.deepspeed.offload"),
    flag("--lora-rank", train="train.lora.rank"),
    flag("--lora-alpha", train="train.lora.alpha"),
    flag("--lora-targets", train="train.lora.targets"),
    flag("--lora-save", train="train.lora.save"),
    flag("--gradient-checkpointing", train="train.gradient_checkpointing"),
    flag("--iterations", train="iterations", help=f"{ONLINE}K x (rollout -> update)."),
    flag("--episodes", eval="episodes"),
    flag("--panel", eval="panel"),
    flag(
        "--engine",
        train="rollout.engine",
        rollout="engine",
        eval="engine",
        help={"train": f"{ONLINE}generation engine, hf | vllm."},
    ),
    flag("--tasks", train="rollout.tasks", rollout="tasks", help={"train": f"{ONLINE}tasks per iteration."}),
    flag(
        "--group-size",
        train="rollout.group_size",
        rollout="group_size",
        help={"train": f"{ONLINE}rollouts per task."},
    ),
    flag(
        "--max-turns",
        train="env.max_turns",
        rollout="env.max_turns",
        eval="env.max_turns",
        help={"train": f"{ONLINE}turn limit."},
    ),
    flag("--temperature", rollout="sampling.temperature"),
    flag("--top-p", rollout="sampling.top_p"),
    flag("--device", train="train.device", rollout="device", eval="device", annotate="device"),
    flag("--dtype", train="train.dtype", rollout="dtype", eval="dtype", annotate="dtype"),
    flag(
        "--threads",
        train="train.threads",
        rollout="threads",
        eval="threads",
        annotate="threads",
        help={"train": "Torch threads (default: the CPUs this process may use / ranks on the node)."},
    ),
    flag(
        "--out",
        train="out",
        rollout="out",
        eval="out",
        help={
            "train": f"{ONLINE}the run directory. One update: where its checkpoint goes (default RUN/checkpoint; "
            "elsewhere, RUN is only read)."
        },
    ),
)


def flags_of(command: str, flags: tuple[Flag, ...] = FLAGS) -> tuple[Flag, ...]:
    """The flags ``serl COMMAND`` shows, in order."""
    return tuple(f for f in flags if command in f.sets)


@dataclasses.dataclass
class Given:
    """What the command line gave a command beyond its own options: ``flags``, the settings its
    flags set by key path (None: not given; ``seed`` among them), the ``--config`` files, the
    ``--set`` overrides, ``-q`` and ``-v``."""

    settings: type
    flags: dict[str, Any]
    config: list[str] | None
    overrides: list[str] | None
    quiet: bool
    verbose: bool = False

    def resolve(self, **how):
        """The command's settings: defaults < ``--config`` files < flags < ``--set``
        (:func:`serl_cli.cli.common.resolve`, with ``how`` its other arguments)."""
        return resolve(
            self.settings,
            config_file=self.config,
            overrides=self.overrides,
            flags=self.flags,
            quiet=self.quiet,
            **how,
        )


# The default of a command body's ``given`` where a parameter before it has one (an optional RUN
# argument): never passed, since settings_command replaces ``given`` by the flags and calls the body
# with a Given. Any, so that the body's ``given: Given`` stays its real type.
GIVEN_BY_FLAGS: Any = None


# -- the settings at a key path -------------------------------------------------------------------


def owner_of(path: str, settings: tuple[type, ...]) -> type:
    """The first of ``settings`` that has a setting at ``path``; a flag naming none is a bug."""
    for cls in settings:
        if setting_type(cls, path) is not None:
            return cls
    raise LookupError(f"no setting {path} in {', '.join(c.__name__ for c in settings)}")


def setting_type(cls, path: str):
    """The type of the setting at ``path`` (``train.lora.rank``) of dataclass ``cls``; None if none."""
    tp: Any = cls
    for part in path.split("."):
        if not dataclasses.is_dataclass(tp) or part not in {f.name for f in dataclasses.fields(tp)}:
            return None
        tp = typing.get_type_hints(tp)[part]
    return tp


def default_at(cls, path: str):
    node = cls()
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _without_none(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


@functools.cache
def choice_type(words: tuple) -> type[enum.Enum]:
    """A ``Literal``'s words as the Enum typer shows as choices (every typer version has Enum;
    the command body gets the word itself back, :func:`_plain`)."""
    if not all(isinstance(w, str) for w in words):
        raise TypeError(f"a flag's choices must be words, got {words!r}")
    # mypy takes the functional API with computed members for an Enum instance: it makes a class
    return typing.cast(type[enum.Enum], enum.Enum("Choice", {w: w for w in words}))


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def option(flag: Flag, command: str, settings: tuple[type, ...]) -> inspect.Parameter:
    """``flag`` as a parameter of ``serl COMMAND``'s typer function: its type, help and shown default
    from the setting it sets."""
    path = flag.sets[command]
    cls = owner_of(path, settings)
    tp = setting_type(cls, path)
    words, plain = cfgmod.choices(tp), _without_none(tp)
    names = [flag.name]
    if words is not None:
        annotation: Any = choice_type(words) | None
    elif plain is bool:  # a switch both ways: --offload / --no-offload (None: the config decides)
        annotation, names = bool | None, [f"{flag.name}/--no-{flag.name.removeprefix('--')}"]
    elif plain in (int, float, str):
        annotation = plain | None
    else:
        raise TypeError(f"{flag.name}: no flag type for setting {path} ({tp})")
    default = default_at(cls, path)
    doc = cfgmod.doc_of(cls, path)
    info = typer.Option(
        None,
        *names,
        help=flag.help_in(command) or (f"{doc}." if doc else None),
        show_default=False if default is None or not flag.show_default else str(default),  # null: the doc says
        rich_help_panel=panel_of(path, switch=plain is bool),
    )
    return inspect.Parameter(flag.param, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=annotation)


# --help lists a command's flags in panels by the section of the settings they set: a panel's columns
# are as wide as its own flags need, so a long switch (--gradient-checkpointing/--no-...) narrows the
# descriptions of its own panel only, and a reader finds the rollout's flags together
PANELS = {
    "rollout": "Rollout",
    "sampling": "Rollout",
    "prompt": "Rollout",
    "vllm": "Rollout",
    "train": "Training",
    "optim": "Training",
    "lora": "Training",
    "annotate": "SERL annotation",
    "eval": "Evaluation",
}


def panel_of(path: str, *, switch: bool) -> str:
    """The --help panel of the flag that sets ``path``: its section's, or ``Switches`` for a flag both
    ways (``--offload/--no-offload``), or ``Run`` for a setting of the run itself."""
    if switch:
        return "Switches"
    return PANELS.get(path.split(".")[0], "Run") if "." in path else "Run"


def _shared(verbose: bool) -> list[inspect.Parameter]:
    shared: list[tuple[str, Any, Any]] = [("config", list[str] | None, ConfigOpt), ("set_", list[str] | None, SetOpt)]
    shared += [("seed", int | None, SeedOpt), ("quiet", bool, QuietOpt)]
    shared += [("verbose", bool, VerboseOpt)] if verbose else []
    return [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=t) for n, t, d in shared
    ]


# every command made by settings_command: name -> (its settings classes, its flags); tests read it
DECLARED: dict[str, tuple[tuple[type, ...], tuple[Flag, ...]]] = {}


def settings_command(command: str, settings: type, *, run_file: type | None = None, verbose: bool = True, flags=FLAGS):
    """Decorate the body of ``serl COMMAND`` (under ``@app.command``): its parameter ``given``
    becomes the command's flags from ``flags`` (in their order, where ``given`` stands), and
    ``--config``, ``--set``, ``--seed``, ``-q`` (and ``-v`` where ``verbose``) follow its own
    options; the body is called with ``given``, a :class:`Given` of ``settings``. ``run_file``:
    the settings a run file given to the command holds (a flag may set one of those)."""
    declared = flags_of(command, flags)
    classes = (settings,) if run_file is None else (settings, run_file)

    def wrap(body):
        hints = typing.get_type_hints(body)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(body).parameters.values()
        ]
        at = [p.name for p in own].index("given")
        made = [option(f, command, classes) for f in declared]
        params = [*own[:at], *made, *own[at + 1 :], *_shared(verbose)]
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise TypeError(f"serl {command}: a flag's parameter has the name of another: {names}")

        @functools.wraps(body)
        def command_function(**kwargs):
            given = Given(
                settings,
                {f.sets[command]: _plain(kwargs.pop(f.param)) for f in declared} | {"seed": kwargs.pop("seed")},
                config=kwargs.pop("config"),
                overrides=kwargs.pop("set_"),
                quiet=kwargs.pop("quiet"),
                verbose=kwargs.pop("verbose", False),
            )
            return body(given=given, **kwargs)

        # typer reads the signature (and the annotations) made here, not the body's
        # (inspect honours __signature__, which typeshed's function types do not declare)
        command_function.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command_function.__annotations__ = {p.name: p.annotation for p in params}
        DECLARED[command] = (classes, declared)
        return command_function

    return wrap
