"""What every command shares: option aliases, output helpers, and the error-to-one-line rule."""

from __future__ import annotations

import gc
import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

try:  # Typer ≥ 0.20 vendors click; its exceptions live here, not in `click`.
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older Typer uses click itself
    from click import exceptions as cx  # type: ignore[no-redef]

from pipeline._files import path_error
from pipeline.errors import PipelineError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="Artifact store: a path, file://PATH or s3://BUCKET/PREFIX."),
]

TrustOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--trust",
        help="A public key (PEM) the release must be signed by, or a folder of them; "
        "repeatable. Unsigned or otherwise signed releases are refused.",
        show_default=False,
    ),
]
SignOpt = Annotated[
    str | None,
    typer.Option(
        "--sign",
        help="Sign the release: kms://alias/NAME, a KMS key ARN, or a PEM private key file.",
        show_default=False,
    ),
]


class _UntypedFlags:
    """Help without the ``<bool>`` Typer 0.29 prints beside every flag, as if it took a
    value: a flag's names (``--x``, or ``--x/--no-x``) already say how it is used."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        for param in self.get_params(ctx):
            if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""  # rich help prints a set metavar instead of the type
        super().format_help(ctx, formatter)  # type: ignore[misc]


class Command(_UntypedFlags, TyperCommand):
    """Every command's class (``new_app``'s default)."""


class OneLineErrors(_UntypedFlags, TyperGroup):
    """Turns PipelineError and usage errors into ``error: <what>: <why> (<hint>)``.

    Exit codes: 2 bad input, 1 outside-world failure, 130 interrupted (SIGINT), 143
    terminated (SIGTERM, in commands that run ``sigterm_unwinds``). ``--debug`` keeps the
    traceback.
    """

    def main(self, args=None, prog_name=None, standalone_mode=True, **extra):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv
        try:
            rv = super().main(args=argv, prog_name=prog_name, standalone_mode=False, **extra)
            if rv == 130:  # Typer turns Ctrl-C into Exit(130) before we see KeyboardInterrupt
                _fail("interrupted", 130)
            if isinstance(rv, int) and rv:  # non-standalone click returns typer.Exit's code
                sys.exit(rv)
            return rv
        except PipelineError as e:
            if debug:
                raise
            _fail(e.one_line(), e.exit_code)
        except cx.NoArgsIsHelpError:
            sys.exit(2)  # help was already printed
        except cx.UsageError as e:
            cmd = e.ctx.command_path if e.ctx else "inf2-pipeline"
            _fail(f"{cmd}: {e.format_message()} (see '{cmd} --help')", 2)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            _fail("interrupted", 130)
        except Terminated:
            _fail("terminated", 143)
        except cx.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except MemoryError:
            if debug:
                raise
            _fail("out of memory", 1)
        except OSError as e:
            if debug:
                raise
            # A path the user can fix (permissions, a file in the way) is bad input, exit 2;
            # a full disk or an I/O error is exit 1. Never a temporary file's name.
            err = path_error(e)
            _fail(err.one_line(), err.exit_code)
        return None


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that ``finally`` and
    cleanup handlers run (the compile runner stops its workers) and nothing swallows it."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextmanager
def sigterm_unwinds():
    """Inside, SIGTERM raises Terminated instead of ending the process on the spot, so a
    command that owns child processes (compile) stops them as on Ctrl-C. Only where that is
    needed: elsewhere dying at once is the better answer to SIGTERM. Left alone where
    SIGTERM is not at its default (ignored on purpose, or an embedding program's handler)
    or off the main thread (where handlers cannot be set)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Set by ``pipeline.cli.main``: this process runs one command and ends with it (not a test's
# CliRunner, nor a program that calls the commands itself).
OWNS_PROCESS = False


@contextmanager
def startup_heap() -> Iterator[None]:
    """Around a command's start (its imports, its clients), where ``main`` runs it: what is
    made there lives until the process ends (~1e5 objects: botocore's service models,
    pydantic's schemas). The collector is paused while they are made (it ran ~160 times
    over them, ~50 ms of a pull's start on the 2-core VM) and they are frozen after
    (``gc.freeze``): later collections, the interpreter's exit's included (~100 ms more),
    leave them out. Elsewhere nothing changes: a freeze would keep that process's garbage of
    the moment for good (here a few MB, with the process)."""
    if not OWNS_PROCESS or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _fail(message: str, code: int) -> None:
    # One line, always: a newline from a file's contents (a key, a path) is shown escaped.
    message = message.strip().replace("\r", "\\r").replace("\n", "\\n")
    typer.echo(f"error: {message}", err=True)
    sys.exit(code)


class _App(typer.Typer):
    """A Typer whose commands are ``Command`` unless told otherwise."""

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kw: Any
    ) -> Any:
        return super().command(name, cls=cls or Command, **kw)


def new_app(help: str) -> typer.Typer:
    return _App(
        help=help,
        cls=OneLineErrors,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
