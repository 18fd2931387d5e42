"""The ``inf2-pipeline`` command: thin Typer commands over library functions.

Each command group lives in its own module and is composed here.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from pipeline import __version__
from pipeline.cli import _common, buckets, config, gqa, model, parity, pull, run, serve
from pipeline.cli import compile as compile_cli
from pipeline.cli import store as store_cli
from pipeline.cli._common import new_app

app = new_app("Ahead-of-time compilation and artifact pipeline for AWS Inferentia2.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Ahead-of-time compilation and artifact pipeline for AWS Inferentia2."""


# --help groups the commands by stage, in the order a release flows through them.
config.register(app, "Plan")
app.add_typer(buckets.app, name="buckets", rich_help_panel="Plan")
app.add_typer(gqa.app, name="gqa", rich_help_panel="Plan")
compile_cli.register(app, "Compile")
store_cli.register(app, "Release and store")
pull.register(app, "Install and serve")
serve.register(app, "Install and serve")
run.register(app, "Check a release")
parity.register(app, "Check a release")
model.register(app, "Demo and test")


def _pull_alone() -> typer.Typer:
    """The root's options and ``pull`` alone: the same command, parsed the same way."""
    alone = new_app(app.info.help)
    alone.callback()(_root)
    pull.register(alone, "Install and serve")
    return alone


def main() -> None:
    _common.OWNS_PROCESS = True  # the process ends with the command (_common.startup_heap)
    # The init container's command builds only its own parser: Typer makes every command's
    # parameters on each run (~20 ms of the pull's start on the 2-core VM for the others').
    # The root's --help and --version (before the command) list or need the whole app.
    command = next((a for a in sys.argv[1:] if a != "--debug"), None)
    (_pull_alone() if command == "pull" else app)()
