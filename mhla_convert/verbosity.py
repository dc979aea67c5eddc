"""How much `mhla-convert` says: `-q` results and errors only, `-v` also the libraries' info logs and progress bars.

The app's options set the level for the command that follows (`use`); outside the command line it is NORMAL.
By default the libraries' progress bars are off, as they would break the command's own step lines; their logging
keeps its level. This module imports no library at import time: `--help` stays fast.
"""

from __future__ import annotations

from typing import Callable

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL
_undo: list[Callable[[], None]] = []


def use(ctx, level: int) -> None:
    """`level` for the command `ctx` (the app's typer context) runs; back to NORMAL, and the libraries back as
    they were, when it ends."""
    global _level
    _level = level
    ctx.call_on_close(_reset)


def _reset() -> None:
    global _level
    _level = NORMAL
    while _undo:
        _undo.pop()()


def level() -> int:
    """The running command's verbosity."""
    return _level


def configure_libraries() -> None:
    """Set transformers', diffusers' and huggingface_hub's logging and progress bars for the running command's
    verbosity: -v info logs (progress bars as the libraries have them), by default no progress bars, -q errors
    only and no progress bars."""
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub
    import transformers.utils.logging as transformers_logging

    libraries = (transformers_logging, diffusers_logging)
    before = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libraries]
    hub_bars = not hub.are_progress_bars_disabled()

    def restore() -> None:
        for lib, verbosity, bars in before:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()
            else:
                lib.disable_progress_bar()
        if hub_bars:  # last: transformers' switch sets the hub's too
            hub.enable_progress_bars()
        else:
            hub.disable_progress_bars()

    _undo.append(restore)
    for lib in libraries:
        if _level == VERBOSE:
            lib.set_verbosity_info()
            continue
        lib.disable_progress_bar()
        if _level == QUIET:
            lib.set_verbosity_error()
    if _level != VERBOSE:
        hub.disable_progress_bars()
