"""What the operators' PyTorch custom ops share (`ops.mhla.attention_op`, `ops.recurrent.recurrent_step_op`)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def grads_by_recompute(fn: Callable, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                       needs_grad: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    """The gradients of Σ ⟨grads[i], fn(*inputs)[i]⟩ with respect to `inputs` (fn returns a tuple of tensors):
    fn runs again under `torch.func.vjp`, which differentiates it even inside an op's implementation, where
    the dispatcher has switched autograd off. Inputs whose `needs_grad` is False get zeros (an op returns a
    tensor for each); every gradient is contiguous."""
    wanted = [i for i, need in enumerate(needs_grad) if need]

    def of_wanted(*xs):
        args = list(inputs)
        for i, x in zip(wanted, xs):
            args[i] = x
        return tuple(fn(*args))

    found = {}
    if wanted:
        _, vjp = torch.func.vjp(of_wanted, *[inputs[i] for i in wanted])
        found = dict(zip(wanted, vjp(tuple(grads))))
    # an op's outputs must not alias its inputs (a summary passed through: its gradient is the output's, as is)
    taken = {t.untyped_storage().data_ptr() for t in (*inputs, *grads)}
    return tuple(
        torch.zeros_like(t, memory_format=torch.contiguous_format) if i not in found
        else found[i].clone(memory_format=torch.contiguous_format) if found[i].untyped_storage().data_ptr() in taken
        else found[i].contiguous()
        for i, t in enumerate(inputs)
    )
