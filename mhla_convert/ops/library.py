"""What the operators' PyTorch custom ops share (`ops.mhla.attention_op`, `ops.exact_op.exact_attention_op`,
`ops.joint.joint_attention_op`): gradients by recomputation, fake implementations and the autograd wiring to a
backward op."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .dispatch import backward_of


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


def backend_grads(impl: Callable, grad: torch.Tensor, inputs: Sequence[torch.Tensor], layout, options: dict,
                  needs_grad: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dmixing) of `impl(q, k, v, mixing, layout, **options)` from its inputs alone: the backend's
    registered backward (which runs its forward again), else its forward again under `torch.func.vjp`. Where
    `needs_grad` is False the gradient is zeros or the true one, whichever is cheaper for the backend."""
    backward = backward_of(impl)
    if backward is not None:
        return tuple(g.contiguous() for g in backward(grad, *inputs, layout, **options, needs_grad=needs_grad))
    return grads_by_recompute(lambda *xs: (impl(*xs, layout, **options),), inputs, (grad,), needs_grad)


def register_attention_op(op, backward_op, *, saved: int, differentiable: int) -> None:
    """The fake implementations of an attention op (an output (B, N, H, D_v) like q) and of its backward op (a
    contiguous gradient like each of q, k, v and the mixing), and `op`'s autograd through `backward_op`, which
    recomputes from the inputs alone: it takes the output gradients, `op`'s first `saved` tensor arguments, which
    of the first `differentiable` of them need a gradient, and `op`'s remaining arguments, and returns one gradient
    for each of those `differentiable`."""
    op.register_fake(lambda q, k, v, mixing, *rest: q.new_empty(*q.shape[:3], v.shape[-1]))
    backward_op.register_fake(lambda grad, q, k, v, mixing, *rest: tuple(
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, mixing)))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:saved])
        ctx.options = inputs[saved:]

    def backward(ctx, *grads):
        found = backward_op(*grads, *ctx.saved_tensors, list(ctx.needs_input_grad[:differentiable]), *ctx.options)
        return (*found, *[None] * (saved - differentiable + len(ctx.options)))

    op.register_autograd(backward, setup_context=setup_context)
