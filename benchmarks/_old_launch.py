"""The previous launch path of the Triton forward, for benchmarks that time it beside the current one:
no launch-plan caches (a fresh plan and launch settings per call), Triton's own launcher for every
kernel (no replay of the compiled kernels) and no per-head-dim launch shapes (`FWD_CONFIGS = {}`,
so 8 warps at D = 128). Patched in from outside: the library has no switch for it."""

from __future__ import annotations

import contextlib


class _NoCache(dict):
    """A dict that never keeps anything (every lookup misses)."""

    def __setitem__(self, key, value):
        pass


def _triton_launch(fn, grid, args, kw, kw_key=None):
    return fn[grid](*args, **kw)


def enable():
    """Switch the process to the previous launch path for good (returns what `restore` needs)."""
    from mhla_convert.kernels import mhla_triton as MT

    saved = {name: getattr(MT, name) for name in ("_PLANS", "_FWD_STATIC", "_launch", "FWD_CONFIGS")}
    MT._PLANS, MT._FWD_STATIC, MT._launch, MT.FWD_CONFIGS = _NoCache(), _NoCache(), _triton_launch, {}
    return saved


def restore(saved):
    from mhla_convert.kernels import mhla_triton as MT

    for name, value in saved.items():
        setattr(MT, name, value)


@contextlib.contextmanager
def old_launch():
    saved = enable()
    try:
        yield
    finally:
        restore(saved)
