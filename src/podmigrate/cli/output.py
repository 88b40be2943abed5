"""How the command line prints: the two consoles, progress (``status``), errors (``fail``) and
``--json`` or a table (``emit``). Every command module (``lab``, ``workload``, ``migrate``, ``bench``)
prints through these; ``podmigrate.cli`` turns a ``PodmigrateError`` into ``fail``.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console

from podmigrate.errors import PodmigrateError

# Tables stay readable when piped to a file or a CI log (rich assumes 80 columns there).
out = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


@contextmanager
def status(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal, plain lines otherwise; yields a function that reports a step."""
    if err.is_terminal:
        with err.status(title) as st:

            def report(msg: str) -> None:
                err.print(f"  [dim]•[/dim] {msg}")
                st.update(f"{title}: {msg}")

            yield report
    else:
        err.print(title)
        yield lambda msg: err.print(f"  • {msg}")


def fail(e: Exception, verbose: bool) -> None:
    err.print(f"[bold red]ERROR:[/bold red] {e}", highlight=False, markup=True)
    if isinstance(e, PodmigrateError) and e.details:
        for k, v in e.details.items():
            if k in ("traceback", "record") and not verbose:
                continue
            if isinstance(v, list):
                if v:
                    err.print(f"  {k}:")
                    for line in v:
                        err.print(f"    {line}", highlight=False, markup=False)
            elif v not in (None, "", {}):
                err.print(f"  {k}: {v}", highlight=False, markup=False)
    if verbose:
        traceback.print_exception(e)
    sys.exit(1)


def emit(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        render(data)
