"""The fused weight-gradient GEMM (``ops.wgrad_accumulate``) and ``fused_accum.nn.Linear``.

Three layers of tests:
- the op, every backend against the fp64 product of the same inputs (accumulators poisoned
  with NaN where they must not be read), awkward shapes (1, primes, empty batches, 3-D,
  non-contiguous and offset views), its argument checks, opcheck and torch.compile;
- ``nn.Linear`` with no optimizer (bit-identical to ``torch.nn.Linear`` on inputs where the two
  GEMM orders round apart on this CPU, every rank, layout and dtype, also under autocast; and
  the same GEMMs and sums on the same operand layouts, which holds on any CPU) and with a
  stand-in window target (what the backward writes, when it calls ``done``);
- end to end with ``FusedAccumOptimizer``'s window: training equal to an unconverted model,
  bf16 precision against an fp64 oracle, peak memory, checkpointing (a weight shared between a
  reentrant checkpoint and a plain matmul), tied and frozen weights, torch.compile.

Backends: ``reference`` and ``cpu`` here; ``triton`` in a ``TRITON_INTERPRET=1`` process
(``-k triton``); ``cuda`` (and triton on CUDA) with ``-m gpu`` on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from typing import List, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fused_accum.nn as fnn
from fused_accum import backends, ops
from fused_accum.backends import wgrad
from fused_accum.optimizer import FusedAccumOptimizer

from benchmarks.wgrad import cpu_peak_bytes as _peak_bytes  # the benchmark's measure: one method for both
from dispatch_record import RecordOps  # tests/dispatch_record.py
from helpers import CPU_BACKENDS, GPU_BACKENDS, GPU_KERNEL_BACKENDS, device_cases, norm_rel_err  # tests/helpers.py

CASES = device_cases(CPU_BACKENDS, GPU_BACKENDS)  # the reference too: the op is checked against fp64
# Optimizer backends for the end-to-end tests on CPU tensors (what the window resolves).
E2E_BACKENDS = CPU_BACKENDS

# (leading shape, N_out, K_in): 1s, primes, an empty batch, 3-D, sizes past 16-wide tiles.
SHAPES = [
    ((1,), 1, 1),
    ((7,), 13, 5),
    ((2, 3), 17, 31),
    ((37,), 40, 19),
    ((0,), 5, 3),
    ((2, 0), 3, 2),
    ((3, 11), 1, 33),
    ((1, 5), 33, 1),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _check_close(acc, base, overwrite, g, x):
    """acc against the fp64 product, to fp32 accumulation error: each entry is a sum of M
    products, each exact in fp32 for bf16/fp16 operands, so the error is bounded by
    ~M ulps of the sum of |terms| (2^-24 each); 64x that bound for TF32-free fp32 BLAS orders."""
    g64 = g.reshape(-1, g.shape[-1]).double().cpu()
    x64 = x.reshape(-1, x.shape[-1]).double().cpu()
    exact = g64.t() @ x64 + (0 if overwrite else base.double().cpu())
    scale = g64.abs().t() @ x64.abs() + (0 if overwrite else base.double().abs().cpu())
    m = max(g64.shape[0], 1)
    bound = 64 * m * 2.0**-24 * scale + 1e-30
    err = (acc.double().cpu() - exact).abs()
    assert torch.isfinite(acc).all(), "acc has non-finite entries (an element was skipped or junk was read)"
    assert (err <= bound).all(), (
        f"max error {err.max().item():.3g}, bound there {bound.flatten()[err.argmax()].item():.3g}"
    )


# --- the op --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,n_out,k_in", SHAPES)
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_wgrad_accumulate_matches_fp64(backend, device, dtype, lead, n_out, k_in, overwrite):
    g = _rand(*lead, n_out, dtype=dtype, device=device, seed=1)
    x = _rand(*lead, k_in, dtype=dtype, device=device, seed=2)
    base = _rand(n_out, k_in, device=device, seed=3)
    acc = torch.full_like(base, float("nan")) if overwrite else base.clone()  # overwrite must not read acc
    ops.wgrad_accumulate(acc, g, x, overwrite, backend)
    _check_close(acc, base, overwrite, g, x)


def _strided_views(device, dtype):
    """(name, grad_output, input) pairs whose grad_output (and sometimes input) are views."""
    g_t = _rand(23, 7, dtype=dtype, device=device, seed=4).t()  # [7, 23], column-major
    x = _rand(7, 9, dtype=dtype, device=device, seed=5)
    g_big = _rand(4, 6, 40, dtype=dtype, device=device, seed=6)
    x_big = _rand(4, 6, 50, dtype=dtype, device=device, seed=7)
    g_perm = _rand(6, 4, 23, dtype=dtype, device=device, seed=8).permute(1, 0, 2)  # no 2-D view
    x_perm = _rand(4, 6, 9, dtype=dtype, device=device, seed=9)
    return [
        ("transposed", g_t, x),
        ("sliced-3d", g_big[:, 1:, 3:26], x_big[:, 1:, 5:14]),  # offset views, row stride > N
        ("permuted-3d", g_perm, x_perm),
        ("every-other-row", _rand(14, 23, dtype=dtype, device=device, seed=10)[::2], x),
    ]


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(4), ids=["transposed", "sliced-3d", "permuted-3d", "every-other-row"])
def test_wgrad_accumulate_non_contiguous(backend, device, dtype, case):
    _, g, x = _strided_views(device, dtype)[case]
    assert not g.is_contiguous()
    base = _rand(g.shape[-1], x.shape[-1], device=device, seed=11)
    for overwrite in (False, True):
        acc = torch.full_like(base, float("nan")) if overwrite else base.clone()
        ops.wgrad_accumulate(acc, g, x, overwrite, backend)
        _check_close(acc, base, overwrite, g, x)


def test_wgrad_accumulate_into_a_slice_of_the_flat_buffer_leaves_the_rest():
    flat = torch.full((3 + 5 * 7 + 4,), -7.0)
    acc = flat[3 : 3 + 35].view(5, 7)  # contiguous, at an offset
    g, x = _rand(11, 5, seed=12), _rand(11, 7, seed=13)
    for backend in CPU_BACKENDS:
        flat.fill_(-7.0)
        ops.wgrad_accumulate(acc, g, x, True, backend)
        assert (flat[:3] == -7).all() and (flat[38:] == -7).all(), backend
        _check_close(acc, None, True, g, x)


def test_cpu_backend_bounds_its_upcast_copies():
    """bf16 rows are upcast in blocks: the two fp32 copies take at most N K bytes (half the bf16
    weight gradient the fused path avoids) once more than CPU_MIN_BLOCK_ROWS rows fit."""
    assert wgrad.cpu_block_rows(100_000, 2048, 2048) == 256
    assert 4 * wgrad.cpu_block_rows(100_000, 8192, 2048) * (8192 + 2048) <= 8192 * 2048
    assert wgrad.cpu_block_rows(10, 2048, 2048) == 10
    # many blocks give the same result as one (the block loop adds every row exactly once)
    g, x = _rand(600, 3, dtype=torch.bfloat16, seed=14), _rand(600, 2, dtype=torch.bfloat16, seed=15)
    assert wgrad.cpu_block_rows(600, 3, 2) == 256  # 3 blocks: 256 + 256 + 88
    acc = torch.full((3, 2), float("nan"))
    wgrad.cpu(acc, g, x, True)
    _check_close(acc, None, True, g, x)
    # what it allocates: one block's two fp32 copies at a time, nothing else
    g, x = _rand(2048, 96, dtype=torch.bfloat16, seed=16), _rand(2048, 40, dtype=torch.bfloat16, seed=17)
    acc = _rand(96, 40, seed=18)
    assert _peak_bytes(lambda: wgrad.cpu(acc, g, x, False)) == wgrad.cpu_temp_bytes(2048, 96, 40) == 4 * 256 * 136
    g32, x32 = g.float(), x.float()
    assert _peak_bytes(lambda: wgrad.cpu(acc, g32, x32, False)) == 0  # fp32: sgemm straight into acc


@pytest.mark.parametrize(
    "acc,g,x,match",
    [
        (torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(2, 4), torch.zeros(2, 3), "float32"),
        (torch.zeros(3, 4).t(), torch.zeros(2, 4), torch.zeros(2, 3), "contiguous"),
        (torch.zeros(12), torch.zeros(2, 4), torch.zeros(2, 3), "2-D"),
        (torch.zeros(4, 3), torch.zeros(2, 5), torch.zeros(2, 3), r"grad_output must be \[\.\.\., 4\]"),
        (torch.zeros(4, 3), torch.zeros(2, 4), torch.zeros(2, 2), r"input must be \[\.\.\., 3\]"),
        (torch.zeros(4, 3), torch.zeros(2, 4), torch.zeros(3, 3), "leading"),
        (torch.zeros(4, 3), torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 3), "same dtype"),
        (
            torch.zeros(4, 3),
            torch.zeros(2, 4, dtype=torch.float64),
            torch.zeros(2, 3, dtype=torch.float64),
            "bf16, fp16 or fp32",
        ),
    ],
    ids=["acc-dtype", "acc-strides", "acc-1d", "g-width", "x-width", "leading", "mixed-dtype", "fp64"],
)
def test_wgrad_accumulate_rejects_bad_arguments(acc, g, x, match):
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match=match):
            ops.wgrad_accumulate(acc, g, x, False, backend)


def test_wgrad_backend_selection_goes_through_backends_resolve():
    assert wgrad.get("auto", "cpu") is wgrad.IMPLEMENTATIONS[backends.resolve("auto", "cpu")]
    with pytest.raises(ValueError, match="backend must be one of"):
        wgrad.get("nope")
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        wgrad.cuda(torch.zeros(2, 2), torch.zeros(1, 2), torch.zeros(1, 2), False)


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "triton"])
def test_opcheck(backend):
    for dtype in (torch.float32, torch.bfloat16):
        for overwrite in (False, True):
            args = (
                _rand(5, 3),
                _rand(2, 4, 5, dtype=dtype, seed=1),
                _rand(2, 4, 3, dtype=dtype, seed=2),
                overwrite,
                backend,
            )
            torch.library.opcheck(ops.wgrad_accumulate_, args)


def test_op_traces_under_torch_compile_without_graph_break():
    def step(acc, g, x):
        ops.wgrad_accumulate(acc, g.sin(), x, False, "reference")
        return acc.sum()

    acc, g, x = _rand(6, 4), _rand(3, 6, seed=1), _rand(3, 4, seed=2)
    expected_acc = acc.clone()
    wgrad.reference(expected_acc, g.sin(), x, False)
    explanation = torch._dynamo.explain(step)(acc.clone(), g, x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    traced_ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert "fused_accum.wgrad_accumulate_.default" in traced_ops, traced_ops
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(acc, g, x)
    torch.testing.assert_close(acc, expected_acc)
    torch.testing.assert_close(out, expected_acc.sum())


def test_eager_wgrad_calls_skip_the_custom_op_wrapper():
    acc, g, x = torch.zeros(3, 2), torch.ones(4, 3), torch.ones(4, 2)
    with RecordOps() as eager:
        ops.wgrad_accumulate(acc, g, x, True, "reference")
    with RecordOps() as wrapped:
        ops.wgrad_accumulate_(acc, g, x, False, "reference")
    assert not any(op.startswith("fused_accum.") for op in eager.ops), eager.ops
    assert "fused_accum.wgrad_accumulate_.default" in wrapped.ops
    assert torch.equal(acc, torch.full((3, 2), 8.0))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter process only")
def test_triton_is_tested_in_the_interpreter_process():
    assert "triton" in CPU_BACKENDS, backends.availability("triton", "cpu")


# --- nn.Linear without an optimizer: exactly torch.nn.Linear -------------------------------------


def _pair(n_in=7, n_out=11, bias=True, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=bias)
    return ref, fnn.convert_linears_(copy.deepcopy(ref))


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 3, 7)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_linear_without_optimizer_is_bitwise_nn_linear(shape, bias, autocast):
    ref, conv = _pair(bias=bias)
    assert type(conv) is fnn.Linear and isinstance(conv, nn.Linear)
    x = _rand(*shape, seed=1).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, y2 = ref(x), conv(x2)
    assert y.dtype == y2.dtype and torch.equal(y, y2)
    g = _rand(*y.shape, seed=2).to(y.dtype)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad) and x.grad.dtype == x2.grad.dtype
    assert torch.equal(ref.weight.grad, conv.weight.grad) and conv.weight.grad.dtype == torch.float32
    if bias:
        assert torch.equal(ref.bias.grad, conv.bias.grad)


def test_double_backward_and_torch_func_like_nn_linear(fake_window):
    """create_graph=True (a gradient penalty) and torch.func.grad: the ordinary, differentiable
    path even when the window offers a target."""
    ref, conv = _pair(5, 4)
    window = fake_window(conv.weight)
    x = _rand(3, 5, seed=4)
    for m in (ref, conv):
        (gw,) = torch.autograd.grad(m(x).square().sum(), m.weight, create_graph=True)
        assert window.asked == 0 and gw.requires_grad
        gw.square().sum().backward()
    # the second backward reaches the weight only through the Linear's output (gw = x^T 2y):
    # an ordinary backward, which the window may take in place
    assert window.asked == window.done_calls == 1 and conv.weight.grad is None
    torch.testing.assert_close(window.acc, ref.weight.grad, rtol=1e-6, atol=1e-6)
    params = {k: v.detach() for k, v in ref.named_parameters()}
    loss = lambda m: lambda p: torch.func.functional_call(m, p, (x,)).square().sum()  # noqa: E731
    grads_ref, grads_conv = torch.func.grad(loss(ref))(params), torch.func.grad(loss(conv))(params)
    for k in params:
        torch.testing.assert_close(grads_conv[k], grads_ref[k], rtol=0, atol=0)


def test_linear_bf16_params_and_frozen_parts_without_optimizer():
    ref, conv = _pair(9, 4, bias=True)
    ref.to(torch.bfloat16), conv.to(torch.bfloat16)
    for m in (ref, conv):
        m.weight.requires_grad_(False)
    x = _rand(3, 9, dtype=torch.bfloat16, seed=3).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref(x).float().square().sum().backward()
    conv(x2).float().square().sum().backward()
    assert conv.weight.grad is None
    assert torch.equal(ref.bias.grad, conv.bias.grad) and torch.equal(x.grad, x2.grad)


# --- bit for bit: torch's own op sequence ---------------------------------------------------------
# A GEMM's rounding depends on which operand it is handed transposed: for mat2 = weight.t(),
# torch's mm_mat2_backward computes g^T x, and (x^T g)^T (what this Linear computed before issue
# 26) rounds differently wherever the CPU's GEMM sums the two layouts in different orders. On
# this project's AMD EPYC (Zen 4, AVX-512; Zen 5 in issue 26), ~40% of the elements of an fp32
# (6, 40) x (10, 40) weight gradient differ; on other CPUs (the Intel one of issue 26) they may
# agree, and no input can then tell the orders apart. So two checks: the values, on inputs
# whose GEMM orders differ here (asserted below where this CPU distinguishes them), and the op
# sequence itself, which holds on every CPU: the GEMMs and sums of nn.Linear's forward and
# backward and of ours, recorded under a dispatch mode, must be the same calls on operands of
# the same shapes, strides and dtypes.

# name -> (input builder (of a seed), out_features); the first five multiply one (6, 40) x (10, 40)
# GEMM, on row-major or column-major [6, 40] operands
_EXACT_INPUTS = {
    "2d": (lambda seed: _rand(6, 40, seed=seed), 10),
    "3d": (lambda seed: _rand(2, 3, 40, seed=seed), 10),
    "3d-permuted": (lambda seed: _rand(40, 2, 3, seed=seed).permute(1, 2, 0), 10),  # a column-major [6, 40] view
    "3d-transposed": (lambda seed: _rand(2, 40, 3, seed=seed).transpose(1, 2), 10),  # no [6, 40] view: copied
    "2d-column-major": (lambda seed: _rand(40, 6, seed=seed).t(), 10),
    "odd": (lambda seed: _rand(7, 5, seed=seed), 13),
    "4d-odd": (lambda seed: _rand(2, 3, 1, 24, seed=seed), 5),
    "1d": (lambda seed: _rand(40, seed=seed), 10),  # M = 1: one product per element, the orders agree
    "empty": (lambda seed: _rand(0, 3, 40, seed=seed), 10),
}
# ("1d" and "empty": M <= 1, one product per element, the orders agree on every CPU)
# (parameter dtype, autocast to bf16)
_EXACT_MODES = {
    "fp32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "autocast-bf16": (torch.float32, True),
}
# what reduces, and so rounds by its operands' layout (elementwise ops and copies do not)
_ROUNDING_OPS = (
    "aten.mm.",
    "aten.addmm.",
    "aten.bmm.",
    "aten.baddbmm.",
    "aten.mv.",
    "aten.addmv.",
    "aten.dot.",
    "aten.sum.",
)


class _RecordRounding(RecordOps):
    """The ops that reduce, each with its operands' shape, strides and dtype, in call order."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(_ROUNDING_OPS):

            def meta(a):
                if isinstance(a, torch.Tensor):
                    return (tuple(a.shape), a.stride(), a.dtype)
                return tuple(meta(b) for b in a) if isinstance(a, (list, tuple)) else a

            self.ops.append((name, meta(args), meta(tuple(sorted((kwargs or {}).items())))))
        return func(*args, **(kwargs or {}))


def _old_order_differs(x, g, n_out):
    """Whether (x^T g)^T, the order this Linear used before issue 26, rounds apart from
    torch's g^T x on these operands (as the GEMM sees them: [M, K] and [M, N])."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, n_out)
    return not torch.equal((x2.t() @ g2).t(), g2.t() @ x2)


@functools.lru_cache(maxsize=None)
def _cpu_tells_orders_apart(case: str) -> bool:
    """Whether this CPU's fp32 GEMM rounds (x^T g)^T and g^T x apart for ``case``'s shapes and
    layouts, probed on other operands than the tests': where it sums both layouts alike, no
    input can tell them apart; where it does not, random operands show it in ~40% of elements."""
    make, n_out = _EXACT_INPUTS[case]
    x = make(97)
    return _old_order_differs(x, _rand(*x.shape[:-1], n_out, seed=98), n_out)


def _run(module_or_fn, leaves, g, autocast, record=True):
    """Forward and backward from leaf copies of ``leaves`` (same strides); (the rounding ops
    recorded, or None; the output; the leaves' gradients)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    rec = _RecordRounding() if record else contextlib.nullcontext()
    with rec:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = module_or_fn(*leaves)
        y.backward(g)
    return rec.ops if record else None, y, [None if t is None else t.grad for t in leaves]


def _exact_pair(case, bias, mode):
    make, n_out = _EXACT_INPUTS[case]
    dtype, autocast = _EXACT_MODES[mode]
    x = make(1).to(dtype)
    ref, conv = _pair(x.shape[-1], n_out, bias=bias)
    ref.to(dtype), conv.to(dtype)
    return ref, conv, x, autocast


@pytest.mark.parametrize("mode", list(_EXACT_MODES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(_EXACT_INPUTS))
def test_linear_gradients_are_torchs_bit_for_bit(case, bias, mode):
    """No fused optimizer over the weight: forward and every gradient bit-equal to nn.Linear's,
    on inputs where the GEMM orders round apart (fp32, asserted where this CPU tells them apart)."""
    ref, conv, x, autocast = _exact_pair(case, bias, mode)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = ref(x)
    g = _rand(*y.shape, seed=2).to(y.dtype)
    if mode == "fp32" and _cpu_tells_orders_apart(case):
        assert _old_order_differs(x, g, ref.out_features)  # so this case tells them apart
    _, y_ref, (gx_ref,) = _run(ref, [x], g, autocast, record=False)
    _, y_conv, (gx_conv,) = _run(conv, [x], g, autocast, record=False)
    assert y_ref.dtype == y_conv.dtype and torch.equal(y_ref, y_conv)
    assert gx_ref.dtype == gx_conv.dtype and torch.equal(gx_ref, gx_conv)
    assert conv.weight.grad.dtype == ref.weight.grad.dtype and torch.equal(conv.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(conv.bias.grad, ref.bias.grad)


def _grad_layouts(shape, dtype):
    return {
        "contiguous": _rand(*shape, seed=2).to(dtype),
        "transposed": _rand(*reversed(shape), seed=2).to(dtype).permute(*reversed(range(len(shape)))),
        "expanded": _rand(shape[-1], seed=2).to(dtype).expand(shape),  # what .sum() hands back
    }


@pytest.mark.parametrize("mode", list(_EXACT_MODES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(_EXACT_INPUTS))
def test_linear_runs_torchs_own_ops(one_thread, case, bias, mode):
    """The claim that holds on every CPU: the same GEMMs and sums as nn.Linear, on operands of
    the same shapes, strides and dtypes, whatever the gradient's layout."""
    ref, conv, x, autocast = _exact_pair(case, bias, mode)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = ref(x)
    for layout, g in _grad_layouts(y.shape, y.dtype).items():
        for m in (ref, conv):
            m.zero_grad()
        ops_ref, y_ref, (gx_ref,) = _run(ref, [x], g, autocast)
        ops_conv, y_conv, (gx_conv,) = _run(conv, [x], g, autocast)
        assert any(name.startswith(("aten.mm.", "aten.addmm.")) for name, *_ in ops_ref)
        assert sorted(ops_conv, key=repr) == sorted(ops_ref, key=repr), layout
        assert torch.equal(y_ref, y_conv) and torch.equal(gx_ref, gx_conv), layout
        assert torch.equal(conv.weight.grad, ref.weight.grad), layout
        if bias:
            assert torch.equal(conv.bias.grad, ref.bias.grad), layout


# functional calls nn.Linear never makes: a weight or bias that is a view, a broadcast bias
_FUNCTIONAL = {
    "weight-transposed": (lambda: _rand(6, 40, seed=1), lambda: _rand(40, 10, seed=3).t(), lambda: _rand(10, seed=4)),
    "weight-transposed-3d": (lambda: _rand(2, 3, 40, seed=1), lambda: _rand(40, 10, seed=3).t(), lambda: None),
    "weight-sliced": (
        lambda: _rand(2, 3, 40, seed=1),
        lambda: _rand(10, 80, seed=3)[:, ::2],
        lambda: _rand(10, seed=4),
    ),
    "bias-strided-3d": (lambda: _rand(2, 3, 40, seed=1), lambda: _rand(10, 40, seed=3), lambda: _rand(20, seed=4)[::2]),
    "bias-1xN-3d": (lambda: _rand(2, 3, 40, seed=1), lambda: _rand(10, 40, seed=3), lambda: _rand(1, 10, seed=4)),
    "bias-MxN-2d": (lambda: _rand(6, 40, seed=1), lambda: _rand(10, 40, seed=3), lambda: _rand(6, 10, seed=4)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(_FUNCTIONAL))
def test_functional_linear_runs_torchs_own_ops(one_thread, case, dtype):
    leaves = [None if t is None else t.to(dtype) for t in (make() for make in _FUNCTIONAL[case])]
    with torch.no_grad():
        y = F.linear(*leaves)
    g = _rand(*y.shape, seed=2).to(dtype)
    ops_ref, y_ref, grads_ref = _run(F.linear, leaves, g, False)
    ops_conv, y_conv, grads_conv = _run(fnn.linear, leaves, g, False)
    assert sorted(ops_conv, key=repr) == sorted(ops_ref, key=repr)
    assert torch.equal(y_ref, y_conv)
    for a, b in zip(grads_ref, grads_conv):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", ["2d", "3d", "3d-permuted"])
def test_fused_fp32_first_gradient_is_torchs_bit_for_bit(fake_window, backend, case):
    """The fused path's promise (fused_accum.backends.wgrad): for fp32 operands its GEMM is the
    one autograd runs for nn.Linear's row-major weight, g^T x, so the window's first gradient
    (written over the slice) is bit-equal to torch's .grad; later ones are added in the GEMM
    (beta = 1), which may round apart from torch's separate product and add."""
    ref, conv, x, _ = _exact_pair(case, True, "fp32")
    window = fake_window(conv.weight, backend)
    with torch.no_grad():
        g = _rand(*ref(x).shape, seed=2)
    ref(x).backward(g)
    conv(x).backward(g)
    assert window.done_calls == 1 and conv.weight.grad is None
    if _cpu_tells_orders_apart(case):
        assert _old_order_differs(x, g, ref.out_features)
    assert torch.equal(window.acc, ref.weight.grad)
    assert torch.equal(conv.bias.grad, ref.bias.grad)


def test_convert_keeps_parameters_state_dict_and_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3, bias=False)))
    params = list(model.parameters())
    keys = list(model.state_dict())
    reprs = repr(model)
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))
    assert fnn.convert_linears_(model) is model
    assert [type(m) for m in (model[0], model[2][0])] == [fnn.Linear, fnn.Linear]
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert list(model.state_dict()) == keys and repr(model) == reprs
    model(torch.randn(2, 4))
    assert calls == [1]
    reloaded = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3, bias=False)))
    reloaded.load_state_dict(model.state_dict())  # and back: the same keys and shapes


def test_convert_handles_subclasses():
    class OwnForward(nn.Linear):  # e.g. a LoRA layer: its weight gradient is not g^T x
        def forward(self, x):
            return super().forward(x) * 2

    mha = nn.MultiheadAttention(8, 2)  # out_proj: NonDynamicallyQuantizableLinear
    lazy = nn.LazyLinear(3)
    model = nn.ModuleList([mha, OwnForward(2, 2), lazy])
    fnn.convert_linears_(model)
    assert isinstance(mha.out_proj, fnn.Linear) and isinstance(
        mha.out_proj, nn.modules.linear.NonDynamicallyQuantizableLinear
    )
    assert type(model[1]) is OwnForward and type(lazy) is nn.LazyLinear
    q = torch.randn(5, 1, 8)
    mha(q, q, q)[0].sum().backward()  # MultiheadAttention still works after conversion


# --- nn.Linear with a stand-in window target --------------------------------------------------------


class _Target(NamedTuple):
    acc: torch.Tensor
    overwrite: bool
    backend: str
    done: object


class _FakeWindow:
    """Gives ``weight`` an fp32 accumulator: overwrite on its first gradient, add after."""

    def __init__(self, weight, backend="reference"):
        self.weight, self.backend = weight, backend
        self.acc = torch.full(weight.shape, float("nan"))
        self.has_grad, self.done_calls, self.asked = False, 0, 0

    def target(self, weight):
        self.asked += 1
        if weight is not self.weight:
            return None

        def done():
            self.has_grad = True
            self.done_calls += 1

        return _Target(self.acc, not self.has_grad, self.backend, done)


@pytest.fixture
def fake_window(monkeypatch):
    def install(weight, backend="reference"):
        window = _FakeWindow(weight, backend)
        monkeypatch.setattr(fnn, "_wgrad_target", window.target)
        return window

    return install


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_linear_writes_the_weight_gradient_into_the_target(fake_window, backend, autocast):
    ref, conv = _pair(6, 5, bias=True)
    window = fake_window(conv.weight, backend)
    expected = torch.zeros(5, 6, dtype=torch.float64)
    for j in range(3):
        x = _rand(2, 4, 6, seed=10 + j).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, y2 = ref(x), conv(x2)
            xc = x.detach().to(y.dtype)
        g = _rand(*y.shape, seed=20 + j).to(y.dtype)
        y.backward(g)
        y2.backward(g)
        expected += g.reshape(-1, 5).double().t() @ xc.reshape(-1, 6).double()
        assert window.done_calls == j + 1 and conv.weight.grad is None
        assert torch.equal(x.grad, x2.grad) and torch.equal(ref.bias.grad, conv.bias.grad)
    # fp32 accumulation of exact products: 1e-6 relative (the bf16 path's own .grad is rounded)
    torch.testing.assert_close(window.acc.double(), expected, rtol=1e-6, atol=1e-6)
    tol = dict(rtol=1e-2, atol=1e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window.acc, ref.weight.grad, **tol)


def test_linear_frozen_weight_never_asks_the_window(fake_window):
    _, conv = _pair(4, 3)
    conv.weight.requires_grad_(False)
    window = fake_window(conv.weight)
    conv(torch.randn(2, 4)).sum().backward()
    assert window.asked == 0 and conv.bias.grad is not None and conv.weight.grad is None


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_linear_under_activation_checkpointing_with_target(fake_window, reentrant):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    window = fake_window(conv[2].weight)
    x = torch.randn(3, 6, requires_grad=True)
    checkpoint(ref, x, use_reentrant=reentrant).square().sum().backward()
    checkpoint(conv, x.detach().requires_grad_(), use_reentrant=reentrant).square().sum().backward()
    assert window.done_calls == 1 and conv[2].weight.grad is None
    torch.testing.assert_close(window.acc, ref[2].weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(conv[0].weight.grad, ref[0].weight.grad, rtol=1e-6, atol=1e-7)


def test_compiled_converted_model_has_no_graph_break():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    x = torch.randn(2, 3, 6)
    explanation = torch._dynamo.explain(conv)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for a, b in zip(ref.parameters(), conv.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


# --- end to end with FusedAccumOptimizer's window -------------------------------------------------------


class _Spy:
    """Counts the window's answers to the Linear backward (targets given / None)."""

    def __init__(self, monkeypatch):
        self.given = self.refused = 0
        original = fnn._wgrad_target

        def spy(weight):
            target = original(weight)
            if target is None:
                self.refused += 1
            else:
                self.given += 1
            return target

        monkeypatch.setattr(fnn, "_wgrad_target", spy)


def _mlp(seed=0, width=16, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.GELU(),
        nn.Linear(2 * width, 2 * width, bias=False),
        nn.Tanh(),
        nn.Linear(2 * width, width),
    ).to(dtype)


def _train(model, opt, windows, accum, data_seed=1, autocast=False, forward=None):
    gen = torch.Generator().manual_seed(data_seed)
    forward = forward or model
    grads = []
    for _ in range(windows):
        for _ in range(accum):
            x = torch.randn(3, 5, model[0].in_features, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = forward(x).float().square().mean()
            loss.backward()
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


@pytest.mark.parametrize("backend", E2E_BACKENDS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_converted_model_trains_like_unconverted(monkeypatch, backend, autocast):
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opt_ref = FusedAccumOptimizer(ref.parameters(), "adamw", lr=1e-2, weight_decay=0.1, accum_steps=3, backend=backend)
    opt_conv = FusedAccumOptimizer(
        conv.parameters(), "adamw", lr=1e-2, weight_decay=0.1, accum_steps=3, backend=backend
    )
    g_ref = _train(ref, opt_ref, windows=4, accum=3, autocast=autocast)
    g_conv = _train(conv, opt_conv, windows=4, accum=3, autocast=autocast)
    assert spy.given == 4 * 3 * 3 and spy.refused == 0  # every weight, every micro-batch, fused
    # fp32: both paths run the same fp32 GEMMs (1e-6). autocast: the fused path skips the bf16
    # rounding of each micro-batch's weight gradient, so they differ at bf16's resolution
    # (a lost or doubled micro-batch would be a 1/3 difference), and Adam's normalised steps
    # carry that into the parameters (measured 3e-3 after 4 windows at lr 1e-2).
    tol = 2e-2 if autocast else 1e-6
    for window_ref, window_conv in zip(g_ref, g_conv):
        for a, b in zip(window_ref, window_conv):
            assert norm_rel_err(b, a) <= tol
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= (1e-2 if autocast else 1e-6)


def test_bf16_weights_closer_to_fp64_oracle_than_unfused(monkeypatch):
    """The accumulated weight gradient of a bf16 Linear over 16 micro-batches against the
    fp64 sum of the same bf16 products. Unfused, each micro-batch's gradient is rounded to bf16
    (2^-9 relative) before the fp32 fold; fused, nothing is rounded below fp32."""
    k, m, n_in, n_out = 16, 64, 48, 24
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(n_in, n_out, bias=False)).to(torch.bfloat16)
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    opts = [
        FusedAccumOptimizer(mod.parameters(), "adamw", lr=1e-3, accum_steps=k, backend="auto") for mod in (ref, conv)
    ]
    gen = torch.Generator().manual_seed(1)
    oracle = torch.zeros(n_out, n_in, dtype=torch.float64)
    for _ in range(k):
        x = torch.randn(m, n_in, generator=gen).to(torch.bfloat16)
        c = torch.randn(m, n_out, generator=gen).to(torch.bfloat16)  # grad_output, exactly
        oracle += c.double().t() @ x.double()
        for mod in (ref, conv):
            (mod(x) * c).sum().backward()
    err_unfused = norm_rel_err(ref[0].weight.grad, oracle)
    err_fused = norm_rel_err(conv[0].weight.grad, oracle)
    print(
        f"relative error vs fp64 oracle: unfused {err_unfused:.3g}, fused {err_fused:.3g}, "
        f"ratio {err_unfused / max(err_fused, 1e-30):.3g}"
    )
    # measured 2026-11-30: unfused ~1.1e-3, fused ~1e-7 (fp32 summation only)
    assert err_fused < 1e-6
    assert err_unfused > 100 * err_fused
    del opts


def test_peak_memory_of_backward_drops_by_the_weight_gradients():
    """A bf16 MLP, one bucket (the unfused path holds every bf16 weight gradient until the
    bucket is complete, at the end of the backward): the fused backward's peak is lower by the
    weight gradients' bytes, less what the fused run holds at its own peak that the unfused one
    has freed by its own: the loss gradient (fp32 and its bf16 copy, 6 M W bytes), the cpu
    backend's bounded fp32 copies of one layer's rows, and whatever the input-gradient GEMM
    allocates for itself while it runs. That last term is the CPU's BLAS, not ours: oneDNN's
    bf16 GEMM took none on an AVX-512 AMD EPYC (fused peak 262,148 B) and about 330 KB on a
    Sapphire Rapids with AMX (fused peak 599,684 B), so it is measured on the machine the test
    runs on, by running that GEMM alone (issue 22 item 15)."""
    width, tokens = 512, 32
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)]).to(torch.bfloat16)
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    opts = [
        FusedAccumOptimizer(m.parameters(), "adamw", accum_steps=4, backend="auto", bucket_cap_mb=1000)
        for m in (ref, conv)
    ]
    backend = backends.resolve("auto", "cpu")
    x = torch.randn(4, tokens // 4, width).to(torch.bfloat16)
    peaks = []
    for m in (ref, conv):
        m(x).float().square().mean().backward()  # first micro-batch: anything lazy is allocated
        peaks.append(_peak_bytes(m(x).float().square().mean().backward))
    wgrad_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    if backend == "cpu":
        temp = wgrad.cpu_temp_bytes(tokens, width, width)
    else:  # reference: fp32 copies of all rows and an fp32 product
        temp = 4 * tokens * 2 * width + 4 * width * width
    # The input-gradient GEMM as fused_accum.nn.Linear's backward runs it (grad_output.matmul(w)),
    # less its bf16 output (the loss-gradient term stands for the gradients in flight).
    g = torch.randn(4, tokens // 4, width).to(torch.bfloat16)
    w = conv[1].weight.detach()
    gemm_workspace = max(0, _peak_bytes(lambda: g.matmul(w)) - 2 * tokens * width)
    allowance = temp + 6 * tokens * width + gemm_workspace
    saved = peaks[0] - peaks[1]
    print(
        f"backward peak: unfused {peaks[0]} B, fused {peaks[1]} B, saved {saved} B; "
        f"weight gradients {wgrad_bytes} B; fused allowance {allowance} B ({backend}; "
        f"GEMM workspace {gemm_workspace} B)"
    )
    assert saved >= wgrad_bytes - allowance - 4096  # 4 KiB: small tensors (a scalar loss, shapes) either run may hold
    assert saved >= wgrad_bytes // 2
    del opts


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_converted_model_trains_like_unconverted(monkeypatch, reentrant):
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opts = [FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=2) for m in (ref, conv)]

    def forward_of(model):
        def forward(x):
            h = checkpoint(model[:2], x, use_reentrant=reentrant)
            return model[2:](h)

        return forward

    # use_reentrant=True needs an input that requires grad to backpropagate into the segment
    g_ref = _train(ref, opts[0], 2, 2, forward=lambda x: forward_of(ref)(x.requires_grad_()))
    g_conv = _train(conv, opts[1], 2, 2, forward=lambda x: forward_of(conv)(x.requires_grad_()))
    assert spy.given == 2 * 2 * 3
    for a, b in zip(g_ref[-1], g_conv[-1]):
        assert norm_rel_err(b, a) <= 1e-6
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


class _TiedLM(nn.Module):
    def __init__(self, vocab=37, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: the head's wgrad and the embedding's add up
        self.in_features = vocab

    def __getitem__(self, i):  # _train reads model[0].in_features for the input width
        return self

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def test_tied_embedding_and_head(monkeypatch):
    torch.manual_seed(0)
    ref = _TiedLM()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    assert conv.head.weight is conv.embed.weight
    spy = _Spy(monkeypatch)
    opts = [FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=3) for m in (ref, conv)]
    gen = torch.Generator().manual_seed(2)
    for window in range(3):
        for j in range(3):
            tokens = torch.randint(0, 37, (4, 6), generator=gen)
            for m in (ref, conv):
                F.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(1, 1).flatten()).backward()
        for a, b in zip(ref.parameters(), conv.parameters()):
            assert norm_rel_err(b.grad, a.grad) <= 1e-6  # the embedding's gradient was added to the head's
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert spy.given == 3 * 3 * 2  # head and mix, every micro-batch
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


def test_frozen_weights(monkeypatch):
    ref = _mlp()
    ref[2].weight.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    frozen_before = conv[2].weight.detach().clone()
    opts = [
        FusedAccumOptimizer([p for p in m.parameters() if p.requires_grad], "adamw", lr=1e-2, accum_steps=2)
        for m in (ref, conv)
    ]
    _train(ref, opts[0], 2, 2)
    _train(conv, opts[1], 2, 2)
    assert spy.given == 2 * 2 * 2  # the frozen weight is never asked for
    assert torch.equal(conv[2].weight, frozen_before) and conv[2].weight.grad is None
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


def test_weight_outside_the_optimizer_gets_an_ordinary_grad(monkeypatch):
    """A converted Linear whose weight no FusedAccumOptimizer trains: the window refuses,
    the gradient goes to .grad as nn.Linear's would (e.g. for a torch.optim optimizer)."""
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opt = FusedAccumOptimizer([p for i, p in enumerate(conv.parameters()) if i != 0], "adamw", accum_steps=1)
    conv(torch.randn(2, 16)).square().sum().backward()
    ref(torch.randn(2, 16)).square().sum().backward()
    assert spy.given == 2 and spy.refused == 1
    assert conv[0].weight.grad is not None and conv[0].weight.grad.dtype == torch.float32
    del opt


def test_compiled_converted_model_trains_like_unconverted():
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    opts = [FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=2) for m in (ref, conv)]
    _train(ref, opts[0], 2, 2)
    _train(conv, opts[1], 2, 2, forward=compiled)
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


def test_wgrad_benchmark_smoke(tmp_path):
    import csv

    from benchmarks import wgrad as bench

    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "wgrad.csv") as f:
        rows = list(csv.DictReader(f))
    providers = {r["provider"] for r in rows}
    fold = backends.resolve("auto", "cpu")
    assert providers == {f"unfused({fold} fold)", "bf16_gemm", "fused:reference", "fused:cpu"}
    assert len(rows) == 3 * len(providers) and all(float(r["ms"]) > 0 and r["git_commit"] for r in rows)
    assert (tmp_path / "wgrad.json").exists()


@pytest.mark.parametrize("accum_steps", [3, None], ids=["accum_steps", "no-hint"])
def test_clipping_and_num_items_see_the_fused_gradients(monkeypatch, accum_steps):
    """max_grad_norm clips by the window's global norm and num_items divides the sum: both
    must include the slices the GEMM wrote (clipping is active: the norm is >> 0.05)."""
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opts = [
        FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=accum_steps, max_grad_norm=0.05)
        for m in (ref, conv)
    ]
    gen = torch.Generator().manual_seed(3)
    for window in range(3):
        for j in range(3):
            x = torch.randn(4, 16, generator=gen)
            for m in (ref, conv):
                m(x).square().sum().backward()
        for opt in opts:
            opt.step(num_items=12)
            opt.zero_grad()
    assert spy.given == 3 * 3 * 3
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


def test_non_finite_fused_gradient_skips_the_step(monkeypatch):
    """Only the first Linear's weight gradient overflows (its input has 1e30 in a feature whose
    weight column is 0, so the forward stays finite): the window's non-finite flag must come
    from the GEMM's output, and skip_nonfinite must skip that window for both models alike."""
    ref = _mlp()
    with torch.no_grad():
        ref[0].weight[:, 3] = 0
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    opts = [
        FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=2, skip_nonfinite=True) for m in (ref, conv)
    ]
    gen = torch.Generator().manual_seed(4)
    for window in range(3):
        before = [p.detach().clone() for p in conv.parameters()]
        for j in range(2):
            x = torch.randn(4, 16, generator=gen)
            x[:, 3] = 1e30 if window == 1 and j == 1 else 0  # 0: column 3 stays 0 through the steps
            for m in (ref, conv):
                (m(x).sum() * 1e12).backward()
        assert torch.isinf(conv[0].weight.grad).any() == (window == 1)
        assert all(torch.isfinite(p.grad).all() for p in list(conv.parameters())[1:])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, conv.parameters()))
        assert changed == (window != 1)
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


def test_step_in_backward_gets_ordinary_gradients(monkeypatch):
    """step_in_backward steps buckets from gradients as tensors: the window refuses targets
    and the converted model trains exactly like the unconverted one."""
    ref = _mlp()
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opts = [
        FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-2, accum_steps=2, step_in_backward=True) for m in (ref, conv)
    ]
    gen = torch.Generator().manual_seed(5)
    for window in range(2):
        for j in range(2):
            x = torch.randn(4, 16, generator=gen)
            for m in (ref, conv):
                m(x).square().sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert spy.given == 0 and spy.refused == 2 * 2 * 3
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert torch.equal(a, b)


def test_hf_llama_with_tied_embeddings_converts_and_trains_alike(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    conv = copy.deepcopy(ref)
    n_linear = sum(type(m) is nn.Linear for m in conv.modules())
    fnn.convert_linears_(conv)
    assert sum(type(m) is fnn.Linear for m in conv.modules()) == n_linear == 2 * 7 + 1
    assert conv.lm_head.weight is conv.model.embed_tokens.weight
    assert list(conv.state_dict()) == list(ref.state_dict())
    spy = _Spy(monkeypatch)
    opts = [FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-3, accum_steps=2) for m in (ref, conv)]
    gen = torch.Generator().manual_seed(6)
    for window in range(2):
        for j in range(2):
            ids = torch.randint(0, 97, (2, 12), generator=gen)
            for m in (ref, conv):
                m(input_ids=ids, labels=ids).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert spy.given == 2 * 2 * n_linear
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-6


# --- on a GPU (-m gpu; benchmarks/device_check.sh) ----------------------------------------------------

GPU_OPT_BACKENDS = GPU_KERNEL_BACKENDS


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_OPT_BACKENDS)
def test_gpu_converted_bf16_mlp_memory_precision_and_training(backend):
    """On CUDA, where the fused GEMM needs no temporaries (cuBLAS / Triton write acc): the
    backward's peak drops by the bf16 weight gradients' bytes (one bucket), the accumulated
    gradient is fp32-exact against fp64, and training matches the unconverted model."""
    width, tokens, k = 1024, 256, 4
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)]).to("cuda", torch.bfloat16)
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    opts = [
        FusedAccumOptimizer(m.parameters(), "adamw", lr=1e-4, accum_steps=k, backend=backend, bucket_cap_mb=1000)
        for m in (ref, conv)
    ]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, width, generator=gen).to("cuda", torch.bfloat16) for _ in range(k)]
    peaks = []
    for m in (ref, conv):
        for j, x in enumerate(xs):
            loss = m(x).float().square().mean()
            if j == 1:  # after a warm-up micro-batch (cuBLAS workspace, Triton JIT, lazy state)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                loss.backward()
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
            else:
                loss.backward()
    wgrad_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    saved = peaks[0] - peaks[1]
    print(f"[{backend}] backward peak: unfused {peaks[0]} B, fused {peaks[1]} B, saved {saved} B of {wgrad_bytes} B")
    assert saved >= wgrad_bytes - 6 * tokens * width - (1 << 20)  # loss grads; 1 MiB of allocator rounding
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b.grad, a.grad) <= 2e-2  # the unfused sum carries bf16 roundings
    for opt in opts:
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert norm_rel_err(b, a) <= 1e-2


def _kind_of_hooks(opt) -> str:
    from fused_accum import arrivals

    return "python" if isinstance(opt._window._arrivals, arrivals.PythonArrivals) else "cpp"


@pytest.mark.parametrize("backend", E2E_BACKENDS)
def test_weight_shared_between_a_reentrant_checkpoint_and_a_plain_matmul(hooks, monkeypatch, backend):
    """Issue 26 §6: W feeds ``fused_accum.nn.linear`` inside ``checkpoint(use_reentrant=True)``
    and a plain ``h @ W`` outside it. In the window's first backward, W's gradient arrives twice
    in two graph tasks: through its AccumulateGrad hook from the outer backward, and written in
    place by the fused GEMM inside the reentrant one (whose end must not count a micro-batch).
    ``.grad`` and ``microbatches`` after every backward, and the parameters after each step,
    against plain autograd and torch.optim.AdamW on the same loop."""
    torch.manual_seed(0)
    w_ref = nn.Parameter(torch.randn(8, 8) / 3)
    w_fused = nn.Parameter(w_ref.detach().clone())
    opt_ref = torch.optim.AdamW([w_ref], lr=1e-2, weight_decay=0.1)
    opt = FusedAccumOptimizer([w_fused], "adamw", lr=1e-2, weight_decay=0.1, accum_steps=2, backend=backend)
    assert _kind_of_hooks(opt) == hooks
    spy = _Spy(monkeypatch)

    def loss_of(w, x, linear):
        h = checkpoint(lambda t: torch.tanh(linear(t, w)), x.requires_grad_(), use_reentrant=True)
        return (h @ w).square().sum()

    gen = torch.Generator().manual_seed(1)
    for window in range(2):
        for j in range(2):
            x = torch.randn(4, 8, generator=gen)
            loss_of(w_ref, x.clone(), F.linear).backward()
            loss_of(w_fused, x.clone(), fnn.linear).backward()
            assert spy.given == 2 * window + j + 1  # the checkpointed linear wrote its gradient in place
            assert opt.microbatches == j + 1
            if backend == "reference" and window == 0:  # the same products, added as AccumulateGrad adds
                assert torch.equal(w_fused.grad, w_ref.grad)
            else:  # the cpu GEMM adds into the slice (beta = 1); after a step the weights differ by an ulp
                assert norm_rel_err(w_fused.grad, w_ref.grad) <= 1e-6
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert norm_rel_err(w_fused, w_ref) <= 1e-6


@pytest.mark.parametrize("backend", ["reference", "cpu"])  # (Triton's kernel keeps the precision, not the bits)
def test_fused_window_first_backward_is_torchs_bit_for_bit(monkeypatch, backend):
    """The same promise through a real window: every fp32 weight gradient of the window's first
    backward is written over its slice of the flat buffer (slices 256-byte aligned, as a fresh
    tensor is: MKL rounds by the output's alignment) and ``.grad`` shows it bit-equal to
    nn.Linear's, on a first layer whose (6, 40) x (10, 40) GEMM orders round apart here."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(40, 10), nn.Tanh(), nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 5))
    conv = fnn.convert_linears_(copy.deepcopy(ref))
    spy = _Spy(monkeypatch)
    opt = FusedAccumOptimizer(conv.parameters(), "adamw", accum_steps=2, backend=backend)
    x = _rand(2, 3, 40, seed=1)
    seen = {}  # the gradient of the first layer's output, for the check that its GEMM tells the orders apart

    def keep_output_grad(module, args, out):
        out.register_hook(lambda g: seen.setdefault("g", g))

    ref[0].register_forward_hook(keep_output_grad)
    ref(x).square().sum().backward()
    conv(x).square().sum().backward()
    assert spy.given == 3 and opt.microbatches == 1
    if _cpu_tells_orders_apart("3d"):
        assert _old_order_differs(x, seen["g"], 10)
    for a, b in zip(ref.parameters(), conv.parameters()):
        assert torch.equal(b.grad, a.grad)
