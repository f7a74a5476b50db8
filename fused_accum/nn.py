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
it cannot take an in-place gradient now -- it returns the ordinary weight gradient, bit for bit
``nn.Linear``'s, so hooks, ``.grad`` and other optimizers see nothing different. The input and
bias gradients, and the output, are always the ordinary ones, bit for bit.

"Bit for bit" holds whatever the CPU because the forward and backward run torch's own ops
on the same operands: at::native::linear's addmm or mm on the same [M, K] view (or copy) of the
input, and the derivatives torch's autograd uses for them (``mm_mat1_backward`` and
``mm_mat2_backward``: for a row-major weight, g^T x, not (x^T g)^T, which rounds differently on
some CPUs), summed for the bias where torch's engine sums it. tests/test_nn.py records the GEMMs
and sums of both under a dispatch mode and requires the same calls on operands of the same
shapes, strides and dtypes. A weight that does not require grad goes to ``F.linear`` itself
(there is no weight gradient to fuse), as do calls this restatement does not cover (complex
dtypes, non-strided or mkldnn tensors, a weight that is not a matrix). (On a GPU the same
argument holds, cuBLAS being handed the same calls; not yet checked on one.)

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
  optimizer's hook as for nn.Linear), and so does a backward compiled autograd captures (the
  Function's backward returns the ordinary weight gradient there): a compiled backward graph is
  traced once, while the
  choice between "return a gradient" and "return None" belongs to the window at each backward,
  which a static graph cannot make. So a converted model compiles without graph breaks and
  trains as an unconverted one; the fusion is an eager-mode saving. The op itself
  (``fused_accum::wgrad_accumulate_``) is a custom op with a fake implementation, traceable
  where a caller knows statically that it wants it.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Tuple

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


# --- torch's own op sequence -------------------------------------------------------------------
# "Exactly nn.Linear" means the same aten ops on the same operands (shapes, strides, dtypes), not
# the same mathematics: a GEMM's rounding depends on which operand it is handed transposed, and
# which order rounds differently depends on the CPU (on an AMD Zen 4/5 with AVX-512, (x^T g)^T
# and g^T x differ in ~40% of an fp32 (6, 40) x (10, 40) weight gradient; on others they agree).
# So the helpers below restate at::native::linear (aten/src/ATen/native/Linear.cpp, as torch
# 2.13 has it) and the mm/addmm formulas of tools/autograd/derivatives.yaml (mm_mat1_backward,
# mm_mat2_backward in torch/csrc/autograd/FunctionsManual.cpp), and tests/test_nn.py records the
# ops of both under a dispatch mode and requires them equal, on each torch the suite runs on: a
# torch that changes its own sequence fails a test instead of drifting by an ulp.


@functools.lru_cache(maxsize=None)
def _flatten_forced() -> bool:
    # TORCH_LINEAR_FLATTEN_3D=1: torch flattens a non-contiguous input after .contiguous();
    # read once, as torch's parseLinearFlatten3d does
    return os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"


def _addmm_path(x: Tensor, b: Optional[Tensor]) -> Tuple[bool, bool]:
    """(whether torch's linear runs addmm on the 2-D view of ``x`` with the bias fused in,
    whether it first makes ``x`` contiguous); otherwise it runs matmul, then ``add_(b)``.

    at::native::linear: a 2-D input with a bias is one addmm; an input of any other rank is
    flattened to [M, K] for addmm when the bias is "likely fusable" (1-D after squeeze,
    contiguous) and the input contiguous (or made so under TORCH_LINEAR_FLATTEN_3D=1). Both
    paths multiply the same [M, K] rows; they differ in where the bias gradient is summed from
    (the [M, N] gradient, or the N-D one).
    """
    if b is None:
        return False, False
    if x.dim() == 2:
        return True, False
    if not ((b.dim() == 1 or b.squeeze().dim() == 1) and b.is_contiguous()):
        return False, False
    if x.is_contiguous():
        return True, False
    if _flatten_forced():
        return True, True
    return False, False


def _rows(t: Tensor) -> Tensor:
    """``t`` as the [M, features] matrix torch's linear multiplies: ``reshape`` (a view where
    the strides allow one, else a contiguous copy) with M spelled out (``-1`` is ambiguous when
    a size is 0), as _flatten_nd_linear and matmul's fold do; a 1-D ``t`` becomes [1, features]."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """at::sum_to, which the autograd engine applies to a broadcast bias's gradient."""
    if len(shape) == 0:
        return grad.sum()
    lead = grad.dim() - len(shape)
    dims = list(range(lead)) + [i for i in range(lead, grad.dim()) if shape[i - lead] == 1 and grad.shape[i] != 1]
    if dims:
        grad = grad.sum(dims, keepdim=True)
    return grad.view(shape) if lead > 0 else grad


def _column_major(t: Tensor) -> bool:
    # the test mm_mat1_backward / mm_mat2_backward apply to the matrix whose gradient they return
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


class _LinearWgradIntoAccumulator(torch.autograd.Function):
    """F.linear whose backward hands the weight gradient to the window when it can take it."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        dtype = _autocast_dtype(input.device.type)
        x, w, b = _cast(input, dtype), _cast(weight, dtype), _cast(bias, dtype)
        fused_bias, make_contiguous = _addmm_path(x, b)
        # at::native::linear's GEMM, written out rather than F.linear: matmul folds an N-D input
        # with no [M, K] view into one mm only when the weight requires grad, and the autocast
        # copy made here (grad mode is off in forward) does not, so F.linear would multiply a
        # transposed 3-D input by bmm where torch's autocast Linear runs mm
        with torch.autocast(input.device.type, enabled=False):
            x2 = _rows(x.contiguous() if make_contiguous else x)
            out = torch.addmm(b, x2, w.t()) if fused_bias else x2.mm(w.t())
            if x.dim() != 2:
                out = out.view(*x.shape[:-1], w.shape[0])
            if b is not None and not fused_bias:
                out = out.add_(b) if type(out) is Tensor and type(b) is Tensor else out + b
        ctx.save_for_backward(x, w)
        ctx.weight = weight  # the parameter (not its autocast copy): the window knows it
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.bias_shape = None if b is None else b.shape
        ctx.path = (fused_bias, make_contiguous)
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, w = ctx.saved_tensors
        input_dtype, weight_dtype, bias_dtype = ctx.dtypes
        need_input, need_weight, need_bias = ctx.needs_input_grad
        fused_bias, make_contiguous = ctx.path
        # The operands of torch's mm/addmm: the view's backward reshapes the gradient to
        # [M, N]; mat1 is the [M, K] input (contiguous first under TORCH_LINEAR_FLATTEN_3D)
        # and mat2 = weight.t(). (An input with no [M, K] view is copied again here, where
        # torch saved its forward copy: the same values, and x stays differentiable for
        # create_graph=True.)
        g2 = _rows(grad_output)
        x2 = _rows(x.contiguous() if make_contiguous else x)
        grad_input = grad_weight = grad_bias = None
        if need_input:
            # mm_mat1_backward: grad @ mat2^T, or (mat2 @ grad^T)^T for a column-major mat1;
            # then the reshape's backward restores the input's shape
            gi = w.t().mm(g2.t()).t() if _column_major(x2) else g2.mm(w)
            grad_input = (gi if x.dim() == 2 else gi.reshape(x.shape)).to(input_dtype)
        if need_bias:
            # addmm's self gradient is grad [M, N]; matmul + add_'s is the N-D grad; the engine
            # sums either to the bias's shape
            grad_bias = _sum_to(g2 if fused_bias else grad_output, ctx.bias_shape).to(bias_dtype)
        if need_weight:
            # create_graph=True (grad mode on in backward) wants a differentiable weight
            # gradient: the in-place GEMM into acc is not one, so return the ordinary gradient.
            # So does a backward compiled autograd captures (traced once, replayed each window:
            # the window's choice belongs to each backward): the optimizer's hook folds it.
            eager = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
            target = _wgrad_target(ctx.weight) if eager else None
            if target is not None:
                ops.wgrad_accumulate(target.acc, g2, x2, target.overwrite, target.backend)
                target.done()
            else:
                # mm_mat2_backward for mat2 = weight.t(), then t()'s backward: for a row-major
                # weight (mat2 column-major) (grad^T @ mat1)^T^T = g^T x, else (mat1^T @ grad)^T
                wt = w.t()
                gw = g2.t().mm(x2) if _column_major(wt) else x2.t().mm(g2).t()
                grad_weight = gw.to(weight_dtype)
        return grad_input, grad_weight, grad_bias


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` whose weight gradient goes into the window's fp32 accumulator when it can."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or torch.jit.is_tracing():
        return F.linear(input, weight, bias)
    if torch._C._are_functorch_transforms_active():  # torch.func.grad/vmap: their own autograd
        return F.linear(input, weight, bias)
    # Nothing to fuse without a weight gradient (a frozen weight: torch's own graph, whose
    # matmul may then take its bmm path); and F.linear for what the Function's restatement of
    # torch's ops does not cover: a weight that is not a strided matrix, an input that is not a
    # strided tensor of rank >= 1, complex dtypes (their gradients conjugate).
    if not weight.requires_grad or weight.dim() != 2 or input.dim() == 0:
        return F.linear(input, weight, bias)
    if weight.layout != torch.strided or input.layout != torch.strided or input.is_mkldnn:
        return F.linear(input, weight, bias)
    if weight.is_complex() or input.is_complex():
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
