"""``fused_accum.nn.Linear``: a drop-in ``torch.nn.Linear`` whose weight gradient is written
straight into the weight's fp32 accumulator (the fused wgrad of issue 13).

Autograd computes a Linear's weight gradient as a tensor in the compute dtype (bf16 under
autocast), which the optimizer's hook then folds into the fp32 accumulator: the product is
rounded to bf16 every micro-batch, 2 N K bytes are allocated per layer until its bucket is
folded, and the fold moves 2 + 2 + 4 + 4 bytes per weight. This Linear's backward instead asks
the window (:func:`fused_accum.window.wgrad_target`) whether the weight's accumulator slice can
take the gradient now; if so it runs :func:`fused_accum.ops.wgrad_accumulate` (the GEMM adds
``grad_output^T @ input`` into the slice with fp32 accumulation, overwriting on the window's
first gradient), tells the window the slice has arrived (``target.done()``), and returns no
weight gradient. Otherwise -- no ``FusedAccumOptimizer`` trains the weight, or the window says
it cannot take an in-place gradient now -- it returns the ordinary weight gradient, exactly as
``nn.Linear`` would (same dtype, same GEMM), so hooks, ``.grad`` and other optimizers see
nothing different. The input and bias gradients are always the ordinary ones.

Compatibility decisions:

- Parameters, ``state_dict`` keys, ``repr`` and forward are nn.Linear's (it is a subclass, and
  :func:`convert_linears_` swaps ``__class__`` without touching the parameters).
- Autocast: like ``nn.Linear`` (autocast casts F.linear's input, weight and bias to the autocast
  dtype): the forward casts the same three tensors and runs with autocast off; the backward's
  GEMMs run in that dtype and the gradients are returned in the original tensors' dtypes.
- Activation checkpointing (reentrant or not) re-runs the forward; the window is asked in the
  backward that actually produces the gradient.
- Without grad (``torch.no_grad``, eval, or nothing requiring grad), under ``torch.func``
  transforms and under ``torch.jit`` tracing the forward is ``F.linear``. A backward with
  ``create_graph=True`` (gradient penalties) returns the ordinary, differentiable gradient.
- On the fused path no weight gradient tensor exists, so tensor hooks registered on the weight
  (``weight.register_hook``) and other post-accumulate-grad hooks do not see one: the
  ``FusedAccumOptimizer`` that owns the weight is its gradient's only consumer. Under autocast
  the weight is cast per call rather than through autocast's per-region cast cache (the same
  values; a layer called k times in one forward saves k bf16 copies instead of one).
- torch.compile: a compiled region runs ``F.linear`` (ordinary weight gradient, folded by the
  optimizer's hook as for nn.Linear): a compiled backward graph is traced once, while the
  choice between "return a gradient" and "return None" belongs to the window at each backward,
  which a static graph cannot make. So a converted model compiles without graph breaks and
  trains as an unconverted one; the fusion is an eager-mode saving. The op itself
  (``fused_accum::wgrad_accumulate_``) is a custom op with a fake implementation, traceable
  where a caller knows statically that it wants it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops, window

__all__ = ["Linear", "linear", "convert_linears_"]


def _wgrad_target(weight: Tensor):
    """The window's target for ``weight``'s gradient, or None (a seam the tests replace)."""
    return window.wgrad_target(weight)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast(t: Optional[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    # autocast's rule (cached_cast): floating tensors other than fp64 go to the autocast dtype
    if t is None or dtype is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


class _LinearWgradIntoAccumulator(torch.autograd.Function):
    """F.linear whose backward hands the weight gradient to the window when it can take it."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        dtype = _autocast_dtype(input.device.type)
        x, w, b = _cast(input, dtype), _cast(weight, dtype), _cast(bias, dtype)
        with torch.autocast(input.device.type, enabled=False):
            out = F.linear(x, w, b)
        ctx.save_for_backward(x, w)
        ctx.weight = weight  # the parameter (not its autocast copy): the window knows it
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, w = ctx.saved_tensors
        input_dtype, weight_dtype, bias_dtype = ctx.dtypes
        need_input, need_weight, need_bias = ctx.needs_input_grad
        n_out, k_in = w.shape
        grad_input = grad_weight = grad_bias = None
        if need_input:
            grad_input = grad_output.matmul(w).to(input_dtype)
        if need_bias:
            grad_bias = grad_output.reshape(-1, n_out).sum(0).to(bias_dtype)
        if need_weight:
            # create_graph=True (grad mode on in backward) wants a differentiable weight
            # gradient: the in-place GEMM into acc is not one, so return the ordinary gradient.
            target = None if torch.is_grad_enabled() else _wgrad_target(ctx.weight)
            if target is not None:
                ops.wgrad_accumulate(target.acc, grad_output, x, target.overwrite, target.backend)
                target.done()
            else:
                # what F.linear's backward returns: (x^T g)^T, in the compute dtype
                g2, x2 = grad_output.reshape(-1, n_out), x.reshape(-1, k_in)
                grad_weight = x2.t().mm(g2).t().to(weight_dtype)
        return grad_input, grad_weight, grad_bias


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` whose weight gradient goes into the window's fp32 accumulator when it can."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or torch.jit.is_tracing():
        return F.linear(input, weight, bias)
    if torch._C._are_functorch_transforms_active():  # torch.func.grad/vmap: their own autograd
        return F.linear(input, weight, bias)
    if not (input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(input, weight, bias)
    return _LinearWgradIntoAccumulator.apply(input, weight, bias)


class Linear(nn.Linear):
    """``torch.nn.Linear`` whose weight gradient is accumulated in place (see the module doc)."""

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)


@functools.lru_cache(maxsize=None)
def _fused_class(cls: type) -> type:
    """The class a converted ``cls`` instance becomes: Linear, or Linear mixed into a subclass."""
    if cls is nn.Linear:
        return Linear
    return type(f"FusedWgrad{cls.__name__}", (Linear, cls), {"__module__": cls.__module__})


def convert_linears_(model: nn.Module) -> nn.Module:
    """Make every ``nn.Linear`` in ``model`` a :class:`Linear`, in place; return ``model``.

    Only ``__class__`` changes: the parameters, their identity (so an optimizer built before
    or after sees the same tensors), buffers, hooks and state_dict keys stay. Subclasses of
    nn.Linear are converted when they keep nn.Linear's forward (their own class is kept in the
    MRO, e.g. ``NonDynamicallyQuantizableLinear``); a subclass with its own forward (a LoRA or
    quantised layer, whose weight gradient is not ``grad^T @ input``) and lazy modules whose
    parameters do not exist yet are left alone.
    """
    for module in model.modules():
        cls = type(module)
        if not isinstance(module, nn.Linear) or isinstance(module, Linear):
            continue
        if cls.forward is not nn.Linear.forward or isinstance(module, nn.modules.lazy.LazyModuleMixin):
            continue
        module.__class__ = _fused_class(cls)
    return model
