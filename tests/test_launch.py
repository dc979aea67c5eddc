"""`kernels.launch.KernelLaunch`: which calls reuse the kept compiled kernel, and with which arguments, against a
stand-in kernel that records what it is called with (the real kernels' relaunches are checked on the GPU in
test_kernels.py)."""

import inspect

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from triton.compiler import CompiledKernel  # noqa: E402

from mhla_convert.kernels import launch as L  # noqa: E402


class _Compiled(CompiledKernel):
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("kept", grid, args))


class _Kernel:
    """Parameters (x, y, n, A: constexpr, B=7, C=3), as a @triton.jit kernel's; `compiles`: whether a launch
    returns a compiled kernel (the interpreter's does not)."""

    def __init__(self, calls, compiles=True):
        def kernel(x, y, n, A, B=7, C=3):
            pass

        self.fn = kernel
        self.arg_names = list(inspect.signature(kernel).parameters)
        self.calls, self.compiles = calls, compiles

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append(("plain", grid, args, meta))
            return _Compiled(self.calls) if self.compiles else None
        return launch


def _tensors(offset=0, dtype=torch.float32):
    x = torch.zeros(40, dtype=dtype)
    return x[offset:offset + 8], torch.zeros(8, dtype=dtype)


@pytest.fixture
def relaunch(monkeypatch):
    monkeypatch.setattr(L, "RELAUNCH", True)


def test_later_calls_run_the_kept_kernel_with_every_parameter_in_order(relaunch):
    calls = []
    kernel, launch = _Kernel(calls), L.KernelLaunch((4, 2), (5,), dict(A=1, C=9, num_warps=4))
    x, y = _tensors()
    launch.run(kernel, (x, y))
    launch.run(kernel, (x, y))
    x2, y2 = _tensors()
    launch.run(kernel, (x2, y2))
    assert calls == [("plain", (4, 2), (x, y, 5), dict(A=1, C=9, num_warps=4)),
                     ("kept", (4, 2, 1), (x, y, 5, 1, 7, 9)), ("kept", (4, 2, 1), (x2, y2, 5, 1, 7, 9))]


@pytest.mark.parametrize("change", ["alignment", "dtype", "kernel"])
def test_a_call_that_specialises_otherwise_launches_the_ordinary_way(change, relaunch):
    """Triton compiles a pointer 16-byte aligned or not, and per dtype: such a call must find its own kernel,
    as must another kernel given the same launch; the kernel it finds is kept in turn."""
    calls = []
    kernel, launch = _Kernel(calls), L.KernelLaunch((3,), (1,), dict(A=2, B=1))
    launch.run(kernel, _tensors())
    other = (_Kernel(calls), _tensors()) if change == "kernel" else (
        kernel, _tensors(offset=1) if change == "alignment" else _tensors(dtype=torch.float16))
    assert other[1][0].data_ptr() % 16 == (4 if change == "alignment" else 0)
    for _ in range(2):
        launch.run(other[0], other[1])
    assert [call[0] for call in calls] == ["plain", "plain", "kept"]


@pytest.mark.parametrize("why", ["untested triton", "interpreter"])
def test_untested_triton_and_the_interpreter_always_launch_the_ordinary_way(why, monkeypatch):
    monkeypatch.setattr(L, "RELAUNCH", why == "interpreter")
    calls = []
    kernel, launch = _Kernel(calls, compiles=why != "interpreter"), L.KernelLaunch((1,), (2,), dict(A=0))
    for _ in range(3):
        launch.run(kernel, _tensors())
    assert [call[0] for call in calls] == ["plain"] * 3


def test_a_changed_launch_keeps_a_kernel_of_its_own(relaunch):
    calls = []
    kernel, base = _Kernel(calls), L.KernelLaunch((2,), (3,), dict(A=0))
    hilo = L.launch_with(base, A=1, B=2)
    assert hilo.meta == dict(A=1, B=2) and base.meta == dict(A=0)
    for launch in (base, hilo, base, hilo):
        launch.run(kernel, _tensors())
    assert [call[0] for call in calls] == ["plain", "plain", "kept", "kept"]
    assert calls[2][2][3:] == (0, 7, 3) and calls[3][2][3:] == (1, 2, 3)


def test_a_traced_launch_gives_every_parameter_by_name(monkeypatch):
    """Inside a triton op, `wrap_triton` launches: inductor takes no defaults, so every parameter after the
    tensors and integers is given, launch options beside them."""
    calls = []
    monkeypatch.setattr(L, "wrap_triton", lambda kernel: kernel)
    x, y = _tensors()
    L.TracedLaunch((2,), (5,), dict(A=1, C=9, num_warps=4)).run(_Kernel(calls), (x, y))
    assert calls == [("plain", (2,), (x, y, 5), dict(A=1, B=7, C=9, num_warps=4))]
