"""The `mhla-convert` command line (typer)."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Convert attention to Multi-Head Linear Attention (MHLA).")


@app.callback()
def _root() -> None:
    """Convert pretrained attention to MHLA, fine-tune, save and push."""


@app.command()
def demo() -> None:
    """Run the built-in demonstration on tiny random models (no downloads)."""
    from .demo import run_demo

    run_demo()


def main() -> None:
    app()
