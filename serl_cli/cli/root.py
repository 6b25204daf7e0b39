"""The root of the ``serl`` command line: the typer app, its shared options, and error handling.

Every command takes ``--config FILE.yaml``, repeated ``--set key.path=value``, ``--seed``,
``--out`` and ``-q/-v``; the resolved configuration is written next to its artifacts. Bad
input raises :class:`SerlError`, printed here as one line with exit code 2.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from envs.base import EnvError
from serl_cli import __version__
from serl_cli.errors import SerlError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="serl: selective environment-reweighted learning for multi-turn LLM agents.",
)
env_app = typer.Typer(no_args_is_help=True, help="Environments: play a task by hand or by script.")
app.add_typer(env_app, name="env")

console = Console()
err_console = Console(stderr=True)


_PATCHES: set = set()  # the functions patched into typer here: patching twice wraps typer's own once


def _switches_show_no_type() -> None:
    """``--help`` lists a switch (``--overwrite``, ``--quick``, ``--help``) without a value type:
    typer's rich help shows ``--overwrite <bool>``, which reads as if it took a value, while
    ``--overwrite true`` is refused. Options that take a value keep theirs."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if option is None or shown is None or shown in _PATCHES:
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag or self.count else shown(self, ctx)

    _PATCHES.add(display_type_rich)
    option.display_type_rich = display_type_rich


_switches_show_no_type()


def _one_line_usage_error(drawn):
    """typer's ``rich_format_error`` (``drawn``) made to print a usage error (a word not among a
    flag's choices, a count that is not a number, a misspelt flag) as one line, as serl prints every
    other error, where typer draws the usage, a hint and a boxed message; exit code 2 as before. A
    command run with no arguments still shows its help."""
    if drawn in _PATCHES:
        return drawn

    def one_line(e) -> None:
        if type(e).__name__ == "NoArgsIsHelpError":
            return drawn(e)
        ctx = getattr(e, "ctx", None)
        words: list[str] = []
        while ctx is not None and ctx.parent is not None:  # the command's words, whatever ran serl
            words, ctx = [ctx.info_name, *words], ctx.parent
        see = f" (see {' '.join(['serl', *words, '--help'])})" if ctx is not None else ""
        err_console.print(f"[bold red]error:[/] {escape(e.format_message())}{see}", highlight=False, soft_wrap=True)

    _PATCHES.add(one_line)
    return one_line


def _usage_errors_in_one_line() -> None:
    """Install :func:`_one_line_usage_error` where typer looks for ``rich_format_error``. typer
    imports ``typer.rich_utils`` only to draw help or an error (``from . import rich_utils``, at
    that moment); importing it for every command would cost ~50 ms of start-up, so until then
    ``typer.rich_utils`` is a stand-in that imports it, and mends it, at first use."""
    import importlib
    import types

    def mended(module):
        if hasattr(module, "rich_format_error"):
            module.rich_format_error = _one_line_usage_error(module.rich_format_error)
        return module

    if "typer.rich_utils" in sys.modules:
        mended(sys.modules["typer.rich_utils"])
        return

    class FirstUse(types.ModuleType):
        def __getattr__(self, name):
            return getattr(mended(importlib.import_module("typer.rich_utils")), name)  # replaces the stand-in

    # typer's package does not import the submodule, so its annotations declare no such attribute
    typer.rich_utils = FirstUse("typer.rich_utils")  # type: ignore[attr-defined]


_usage_errors_in_one_line()

# Options every command shares (README.md, "The pipeline").
ConfigOpt = typer.Option(
    None,
    "--config",
    help="A YAML config file (from experiments/ or your own); repeat it to compose files, left to right.",
)
SetOpt = typer.Option(None, "--set", help="Override a setting: key.path=value (repeatable; value parsed as YAML).")
SeedOpt = typer.Option(None, "--seed", help="Seed for task order, sampling and initialization.")
QuietOpt = typer.Option(False, "-q", "--quiet", help="Print only the final table.")
VerboseOpt = typer.Option(False, "-v", "--verbose", help="Print more detail.")


def overwrite_option(what: str):
    """``--overwrite``: replace ``what`` (``existing rollouts in --out``) where the command writes."""
    return typer.Option(False, "--overwrite", help=f"Replace {what}.")


def refuse_resume_with_overwrite(resume: bool, overwrite: bool) -> None:
    """``--resume`` keeps what a run did and ``--overwrite`` throws it away: together they ask for both."""
    if resume and overwrite:
        raise SerlError("--resume continues a run and --overwrite replaces it: pass one of them")


def journal_resume_option(what: str):
    """``--resume`` of a command that keeps a journal of ``what`` it has done (``rollout in --out``)."""
    return typer.Option(
        False,
        "--resume",
        help=f"Continue an interrupted {what} from its journal (same settings); a finished one is left as it is.",
    )


def _version(value: bool):
    if value:
        console.print(f"serl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version.")):
    pass


def quiet_libraries() -> None:
    """Library progress bars and warnings would bury serl's own output. Set before the libraries are
    imported: huggingface_hub reads HF_HUB_DISABLE_PROGRESS_BARS once, at import."""
    if not sys.stderr.isatty():  # on a terminal a real download shows its progress; in logs it would be noise
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # --engine vllm: its start-up log runs to ~100 lines


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# How to go on after Ctrl-C, by command: the commands that resume by rerunning (their
# --resume flag, or a rerun that skips what is done). `train` and `rollout` say it only once
# their run directory holds something to resume (:func:`resumable_at`).
RERUN_RESUMES = {"annotate": "--resume", "ablate": "rerun", "data": "rerun"}
_resume_check: dict = {}


def resumable_at(out: str, flag: str = "--resume") -> None:
    """Tell the Ctrl-C handler that this command resumes with ``flag`` once ``out`` holds a
    run (its manifest.json); before that, a plain rerun starts it."""
    _resume_check.update(out=out, flag=flag)


def command_to_resume(argv: list[str], flag: str) -> str:
    """The command line that continues ``argv`` (the arguments after ``serl``): the same
    arguments with ``--resume`` (never ``--overwrite``, which would start again)."""
    import shlex

    args = [a for a in argv if a != "--overwrite"]
    if flag == "--resume" and "--resume" not in args:
        args.append("--resume")
    return "serl " + shlex.join(args)


def interrupted_line(argv: list[str]) -> str:
    """What Ctrl-C prints: that the command stopped and, where it can resume, the exact command."""
    command = argv[0] if argv else ""
    flag = RERUN_RESUMES.get(command)
    if _resume_check:
        from pathlib import Path

        if not (Path(_resume_check["out"]) / "manifest.json").is_file():
            return "interrupted (Ctrl-C) before the run wrote anything: the same command starts it again"
        flag = _resume_check["flag"]
    if flag is None:
        return "interrupted (Ctrl-C)"
    how = "rerun it" if flag == "rerun" else "continue with"
    return f"interrupted (Ctrl-C): what finished is kept; {how}: {command_to_resume(argv, flag)}"


def run() -> None:
    """Run the app; a :class:`SerlError` or :class:`EnvError` becomes one line and exit code 2,
    Ctrl-C one line that says how to resume, and exit code 130."""
    _resume_check.clear()  # set again by the command that runs (in-process callers run several)
    try:
        app()
    except (SerlError, EnvError) as e:
        # escaped: messages quote actions like click[buy now] and extras like serl[vllm]
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        _say_interrupted()
    except RuntimeError as e:
        lost = peer_lost(e)
        if lost is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(lost)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except SystemExit as e:  # typer turns Ctrl-C into a silent exit 130
        if e.code == INTERRUPTED_EXIT and _caused_by_ctrl_c(e):
            _say_interrupted()
        raise


# what gloo says when the process at the other end of a collective has gone (its own error is its own)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(e: BaseException) -> str | None:
    """One line for a collective that failed because another process of the run ended (gloo's
    closed connection, torch's DistNetworkError), instead of a traceback of the wait; None for any
    other error. The process that failed says why in its own line."""
    dist = sys.modules.get("torch.distributed")
    network_error = getattr(dist, "DistNetworkError", None) if dist is not None else None
    text = str(e)
    if not (any(p in text for p in PEER_GONE) or (network_error is not None and isinstance(e, network_error))):
        return None
    said = next((p for p in PEER_GONE if p in text), None)
    first = said or next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    return f"another process of this run ended while this one waited for it ({first}): its own error says why"


def _caused_by_ctrl_c(e: BaseException) -> bool:
    seen: set[int] = set()
    link: BaseException | None = e  # down the chain of causes, to its end (or a loop)
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def _say_interrupted() -> None:
    err_console.print(f"[yellow]{escape(interrupted_line(sys.argv[1:]))}[/]", highlight=False, soft_wrap=True)
    sys.exit(INTERRUPTED_EXIT)
