"""Whether a model's outputs are finite: a diverged model (weights blown up by too high a learning
rate) gives inf/NaN outputs, which a sampling pipeline quietly turns into a black image. `watch_outputs`
records, while it is open, whether any forward of the model returned a non-finite main output (the
tensor, `.sample`, `.logits`, or the first element of a tuple), without a sync per call."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def main_output(output) -> torch.Tensor | None:
    """The tensor a call is judged by, or None where there is none: the tensor itself, a diffusion transformer's
    `.sample`, an LM's `.logits`, or the first element of a tuple (an attention layer's output)."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("sample", "logits"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class OutputWatch:
    """What `watch_outputs` yields: `finite` after the watched calls."""

    def __init__(self):
        self.calls, self._bad = 0, None

    def offer(self, output) -> None:
        tensor = main_output(output)
        if tensor is None or not tensor.is_floating_point():
            return
        self.calls += 1
        bad = ~torch.isfinite(tensor.detach()).all()
        self._bad = bad if self._bad is None else self._bad | bad

    @property
    def finite(self) -> bool:
        return self._bad is None or not bool(self._bad)


@contextmanager
def watch_outputs(model: nn.Module):
    """Yield an `OutputWatch` that sees every forward of `model` until the block ends."""
    watch = OutputWatch()
    handle = model.register_forward_hook(lambda module, args, output: watch.offer(output))
    try:
        yield watch
    finally:
        handle.remove()
