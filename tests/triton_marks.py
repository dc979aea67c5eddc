"""Where this test process runs the Triton kernels, and the marks that skip by it (for the kernel test files).

Import it before anything else imports Triton: without CUDA it turns on Triton's interpreter first, so the kernels
run on the CPU (small shapes). The interpreter is on only when this process set TRITON_INTERPRET before Triton
loaded; otherwise those cases are skipped (test_kernels.py reruns its own in a subprocess).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from mhla_convert.kernels import mhla_kernels  # noqa: E402

INTERPRETED = type(mhla_kernels._readout_kernel).__name__ == "InterpretedFunction"
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if CUDA else "cpu"
run = pytest.mark.skipif(not (INTERPRETED or CUDA), reason="needs CUDA, or TRITON_INTERPRET=1 before Triton loads")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (and no TRITON_INTERPRET)")
