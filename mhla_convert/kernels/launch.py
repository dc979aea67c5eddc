"""A kernel launch whose grid, integer and meta arguments are fixed, so that its later calls can skip the search for
the compiled kernel that `kernel[grid](*args, **meta)` makes on every call.

Each `kernel[grid](...)` binds and specialises every argument in Python to find its compiled kernel: about 23 µs of an
H100 host's time for the attention's summaries launch (30 arguments), 3 to 9 times per operator call. At small
shapes that host time, not the GPU's, paces an eager call and a compiled model alike (torch.compile calls the operator
as the custom op it is). The launches of one input signature (`mhla_triton._Launches`) fix everything but their
tensors, so a `KernelLaunch` launches the ordinary way once and keeps the `CompiledKernel` Triton returns. A later call
whose tensors specialise as that launch's did (each one's dtype, and whether its address is a multiple of 16 bytes:
what Triton specialises a pointer on) runs that kernel through `CompiledKernel[grid]`, Triton's runner for a compiled
kernel, with every kernel parameter in the kernel's own order, as Triton's launch passes them; it takes half the host
time. Any other call launches the ordinary way and keeps the kernel it finds.

Only the Triton release this was tested with (`TESTED_TRITON`) relaunches so; other releases, and the interpreter,
always launch the ordinary way. A `TracedLaunch` is the launch of a plan that torch.compile traces: through
`torch.library.wrap_triton`, which inductor turns into a launch of its own.
"""

from __future__ import annotations

import inspect
from collections import namedtuple

import triton
from torch.library import wrap_triton
from triton.compiler import CompiledKernel

TESTED_TRITON = (3, 6)
RELAUNCH = tuple(int(part) for part in triton.__version__.split(".")[:2]) == TESTED_TRITON


def specialisation(tensors) -> tuple:
    """What Triton specialises a kernel on, of its tensor arguments: dtype and 16-byte alignment."""
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


class KernelLaunch(namedtuple("KernelLaunch", "grid ints meta")):
    """`kernel[grid](*tensors, *ints, **meta)` for any kernel and tensors (call `run`); the compiled kernel it last
    found is kept (`_kept`), so later calls that specialise alike skip Triton's search for it."""

    _kept = None  # (kernel, specialisation, runner, the parameters after the tensors and ints)

    def run(self, kernel, tensors) -> None:
        kept = self._kept
        if kept is not None and kept[0] is kernel and kept[1] == specialisation(tensors):
            kept[2](*tensors, *self.ints, *kept[3])
            return
        compiled = kernel[self.grid](*tensors, *self.ints, **self.meta)
        if RELAUNCH and isinstance(compiled, CompiledKernel):
            rest = tuple(self._rest(kernel, len(tensors)).values())
            self._kept = (kernel, specialisation(tensors), compiled[self._grid3()], rest)

    def _grid3(self) -> tuple[int, int, int]:
        return (*self.grid, *(1,) * (3 - len(self.grid)))

    def _rest(self, kernel, tensors: int) -> dict:
        """The kernel's parameters after its tensors and integers, in its order, with their values: meta arguments
        (constexprs among them) or the parameters' defaults. Launch options (num_warps, ...) are no parameters."""
        defaults = inspect.signature(kernel.fn).parameters  # (the Python function of a jit or interpreted kernel)
        return {name: self.meta[name] if name in self.meta else defaults[name].default
                for name in kernel.arg_names[tensors + len(self.ints):]}


class TracedLaunch(KernelLaunch):
    """A launch inside a `torch.library.triton_op`, which torch.compile traces: `wrap_triton(kernel)[grid](...)`,
    with every parameter given (inductor takes no defaults). Inductor passes a kernel's warps and stages, and no
    register cap or programmatic dependent launch."""

    def run(self, kernel, tensors) -> None:
        rest = self._rest(kernel, len(tensors))
        options = {name: value for name, value in self.meta.items() if name not in rest}
        wrap_triton(kernel)[self.grid](*tensors, *self.ints, **rest, **options)


def launch_with(launch, **meta) -> KernelLaunch:
    """`launch` with some meta arguments changed: a launch of its own (it compiles a kernel of its own)."""
    grid, ints, kw = launch
    return type(launch)(grid, ints, {**kw, **meta})
