"""Every kernel backend against the reference backend, on fresh random data.

Which backends run depends on the process:
- a plain run checks the C++ CPU extension (``cpu``) when it is built;
- a run with ``TRITON_INTERPRET=1`` (set before triton is imported; ``./run test`` starts one)
  checks ``triton`` on CPU tensors;
- ``-m gpu`` on a CUDA machine checks ``cuda`` and ``triton`` on CUDA tensors.
The reference is never compared with itself: that test could not fail.

Outputs are poisoned (NaN, or random values where the op reads them) before each call, so a
kernel that skips an element or a tensor fails. Sizes cover 1, 2, primes, powers of two and one
past them (one block and one more than a block for any block size up to 4096), and more than 110
tensors in one call (the point where a kernel-argument metadata table typically fills).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from unittest import mock
from typing import NamedTuple

import numpy as np
import pytest
import torch

import cases  # tests/cases.py: every algorithm, its peer, its cases
from fused_accum import backends, ops
from fused_accum.backends import reference
from fused_accum.registry import initial_states
from helpers import (  # tests/helpers.py
    CPU_BACKENDS,
    CPU_KERNEL_BACKENDS,
    GPU_KERNEL_BACKENDS,
    PAD,
    device_cases,
    flat_layout,
    padding_untouched,
)

CASES = device_cases(CPU_KERNEL_BACKENDS, GPU_KERNEL_BACKENDS)  # the kernel backends: never the reference
if not CASES:  # an explicit, visible reason rather than pytest's silent empty parametrisation
    pytestmark = pytest.mark.skip(reason="no kernel backend available in this process")

SIZES = [1, 2, 3, 31, 257, 1023, 1024, 1025, 4096, 4097]
LOW = [torch.bfloat16, torch.float16]
NAN = float("nan")  # what outputs hold before a call, where the op does not read them (see above)


def _seed(*case) -> int:
    """A seed fixed per test case (Python's hash() of strings changes between processes)."""
    return zlib.crc32(repr(case).encode())


def _grads(sizes, dtype, device, gen):
    return [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]


# --- accumulate ----------------------------------------------------------------------------

# fp32 results of alpha*g + acc on O(1) values: a kernel may contract to an FMA (one rounding
# where the reference rounds twice), so results may differ by about 1 ulp (6e-8 relative).
ACC_TOL = dict(rtol=1e-6, atol=1e-6)
# The sum of squares is a reduction over up to ~1e5 values in a different order: relative
# error grows like n * eps ~ 1e-5 in the worst case, far less in practice.
NORM_TOL = dict(rtol=2e-5, atol=0.0)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("overwrite", [True, False])
def test_accumulate_matches_reference(backend, device, dtype, overwrite):
    gen = torch.Generator().manual_seed(_seed(dtype, overwrite))
    grads = _grads(SIZES, dtype, device, gen)
    start = [torch.randn(n, generator=gen).to(device) for n in SIZES]
    got, want = flat_layout(SIZES, device, fill=NAN), flat_layout(SIZES, device, fill=NAN)
    for a, e, s in zip(got.views, want.views, start):
        if not overwrite:  # overwrite must not read acc: leave NaN there as poison
            a.copy_(s)
            e.copy_(s)
    alpha = 0.37
    found_inf, sumsq = torch.zeros((), device=device), torch.full((), 1.5, device=device)
    backends.get(backend).accumulate(got.flat, got.offsets, grads, alpha, overwrite, found_inf, sumsq)
    ref_inf, ref_sumsq = torch.zeros((), device=device), torch.full((), 1.5, device=device)
    reference.accumulate(want.flat, want.offsets, grads, alpha, overwrite, ref_inf, ref_sumsq)
    for g, w in zip(got.views, want.views):
        torch.testing.assert_close(g, w, **ACC_TOL)
    assert padding_untouched(got.flat, got.views)
    assert found_inf.item() == 0.0
    # sumsq is added to (1.5 was there) and equals the squared norm of the values written
    norm2 = torch.linalg.vector_norm(torch.cat(want.views)) ** 2
    torch.testing.assert_close(sumsq, 1.5 + norm2, **NORM_TOL)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("pad", [PAD, 1])
def test_accumulate_many_mixed_tensors_and_views(backend, device, pad):
    """150 tensors, mixed dtypes, non-contiguous and storage-offset grads, in one call; with
    pad=1 the slices are packed, so most start at addresses no vector access may assume."""
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 300, (150,), generator=gen).tolist()
    grads = []
    for i, n in enumerate(sizes):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
        base = torch.randn(2 * n + 5, generator=gen).to(device=device, dtype=dtype)
        kind = i % 4
        if kind == 0:
            grads.append(base[5 : 5 + n])  # storage offset, contiguous
        elif kind == 1:
            grads.append(base[: 2 * n : 2])  # strided
        elif kind == 2 and n > 1:
            grads.append(base[: (n // 2) * 2].view(n // 2, 2).t())  # transposed
            sizes[i] = (n // 2) * 2
        else:
            grads.append(base[:n])
    start = [torch.randn(n, generator=gen).to(device) for n in sizes]
    got, want = flat_layout(sizes, device, pad=pad, fill=NAN), flat_layout(sizes, device, pad=pad, fill=NAN)
    for a, e, s in zip(got.views, want.views, start):
        a.copy_(s)
        e.copy_(s)
    backends.get(backend).accumulate(got.flat, got.offsets, grads, 2.0, False, None, None)
    reference.accumulate(want.flat, want.offsets, grads, 2.0, False, None, None)
    for g, w in zip(got.views, want.views):
        torch.testing.assert_close(g, w, **ACC_TOL)
    assert padding_untouched(got.flat, got.views)


@pytest.mark.parametrize("backend,device", CASES)
def test_accumulate_writes_only_the_slices_it_is_given(backend, device):
    """A call with some of a buffer's slices (the optimizer's partial buckets) leaves the
    others as they were, whatever the gaps between the slices it writes."""
    gen = torch.Generator().manual_seed(4)
    sizes = [33, 1024, 5, 700, 64, 1]
    layout = flat_layout(sizes, device, fill=0.0)
    for v in layout.views:
        v.copy_(torch.randn(v.numel(), generator=gen))
    before = layout.flat.clone()
    chosen = [1, 3, 5]
    grads = _grads([sizes[i] for i in chosen], torch.bfloat16, device, gen)
    backends.get(backend).accumulate(layout.flat, layout.offsets[chosen], grads, 1.0, False, None, None)
    for i, v in enumerate(layout.views):
        start = int(layout.offsets[i])
        old = before[start : start + v.numel()]
        if i in chosen:
            torch.testing.assert_close(v, old + grads[chosen.index(i)].float(), **ACC_TOL)
        else:
            assert torch.equal(v, old)
    assert padding_untouched(layout.flat, layout.views)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_accumulate_flags_nonfinite(backend, device, bad):
    gen = torch.Generator().manual_seed(2)
    grads = _grads([5, 1025, 3], torch.bfloat16, device, gen)
    grads[1][777] = bad
    layout = flat_layout([5, 1025, 3], device, fill=0.5)
    found_inf = torch.zeros((), device=device)
    backends.get(backend).accumulate(layout.flat, layout.offsets, grads, 1.0, False, found_inf, None)
    assert found_inf.item() == 1.0
    # A later finite call must not clear the flag: flags OR together over a window.
    backends.get(backend).accumulate(layout.flat, layout.offsets[:1], grads[:1], 1.0, False, found_inf, None)
    assert found_inf.item() == 1.0


# Every backend, the reference included, rejects a layout it cannot write safely, saying why
# in the same words (the reference states the contract; the C++ binding repeats its checks).
BAD_LAYOUTS = {
    "overlap": (lambda flat, offs: (flat, torch.tensor([0, 10])), "where the previous slice ends"),
    "decreasing": (lambda flat, offs: (flat, torch.tensor([64, 0])), "where the previous slice ends"),
    "past_end": (lambda flat, offs: (flat, torch.tensor([0, 110])), "runs past the end of acc"),
    # start + numel overflows int64: must not wrap around to a "valid" end before acc
    "overflow": (lambda flat, offs: (flat, torch.tensor([0, 2**63 - 1])), "runs past the end of acc"),
    "negative": (lambda flat, offs: (flat, torch.tensor([-1, 64])), "where the previous slice ends"),
    "short_offsets": (lambda flat, offs: (flat, offs[:1]), "offsets has 1 entries but grads has 2"),
    "int32_offsets": (lambda flat, offs: (flat, offs.int()), "offsets must be a 1-D int64 CPU tensor"),
    "2d_offsets": (lambda flat, offs: (flat, offs.view(1, 2)), "offsets must be a 1-D int64 CPU tensor"),
    "bf16_acc": (lambda flat, offs: (flat.bfloat16(), offs), "acc must be a 1-D contiguous float32"),
    "strided_acc": (
        lambda flat, offs: (torch.zeros(2 * flat.numel(), device=flat.device)[::2], offs),
        "acc must be a 1-D contiguous float32",
    ),
}


@pytest.mark.parametrize("backend,device", [pytest.param("reference", "cpu", id="reference-cpu")] + CASES)
@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_accumulate_rejects_bad_layouts(backend, device, case):
    layout = flat_layout([20, 20], device, pad=64, fill=0.0)  # slices at 0 and 64 of a 128-element buffer
    flat, offsets = BAD_LAYOUTS[case][0](layout.flat, layout.offsets)
    grads = [torch.ones(20, device=device), torch.ones(20, device=device)]
    with pytest.raises((ValueError, RuntimeError), match=BAD_LAYOUTS[case][1]):
        backends.get(backend).accumulate(flat, offsets, grads, 1.0, False, None, None)


# --- optimizer steps -----------------------------------------------------------------------

# fp32 state after one step: the kernels evaluate the same formulas in a different order and
# may use FMA and hardware sqrt/division; 1e-5 relative covers that (Adam's m/(sqrt(v)+eps)
# amplifies a 1-ulp difference in v by at most ~2x).
STEP_TOL = dict(rtol=1e-5, atol=1e-6)

ALGOS = cases.kernel_cases(cases.FP32)  # every algorithm's step-op cases (tests/cases.py), by name


def _n_states(algo: str) -> int:
    """How many state lists the step op of kernel case ``algo`` is given."""
    return len(cases.op_records(ALGOS[algo])[2])


def _step_inputs(algo, sizes, param_kind, device, gen):
    """Inputs of one step op. param_kind: 'master' (fp32 master + bf16/fp16 params, read and
    written), 'fp32' (fp32 params are their own master) or 'bf16' (bf16 params, no master)."""
    n_state = _n_states(algo)
    param_dtype = torch.bfloat16 if param_kind == "bf16" else torch.float32
    params = [torch.randn(n, generator=gen).to(device=device, dtype=param_dtype) for n in sizes]
    states = [[torch.randn(n, generator=gen).abs().to(device) for n in sizes] for _ in range(n_state)]
    lp = []
    if param_kind == "master":
        # the masters' rounding, but an eighth of the elements written from outside (the step
        # reads lp: the masters follow it there, reference.follow_weight)
        lp = [p.to(LOW[i % 2]) for i, p in enumerate(params)]
        for low in lp:
            edited = torch.rand(low.numel(), generator=gen) < 0.125
            low[edited.to(device)] = torch.randn(int(edited.sum()), generator=gen).to(device, low.dtype)
    accs = flat_layout(sizes, device, fill=NAN).views
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    # per-tensor step counts, including first steps (SGD's momentum initialisation)
    steps = torch.tensor([1.0 + (i % 3) * 4 for i in range(len(sizes))], device=device)
    return params, states, lp, accs, steps


def _call(module, algo, params, states, lp, accs, steps, lr, coef, grads=(), overwrite=False, found_inf=None):
    """module's step op of kernel case ``algo``; ``states`` in the op's order (amsgrad's max third)."""
    optional = dict(lp_params=lp, grads=list(grads), found_inf=found_inf, grad_alpha=0.5, grads_overwrite=overwrite)
    tensors = ops.StepTensors(params, accs, steps, lr, coef, **optional)
    cases.op_call(module, ALGOS[algo], tensors, states)


def _clone(xs):
    return [x.clone() for x in xs]


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("param_kind", ["master", "fp32", "bf16"])
@pytest.mark.parametrize("fused", [None, "overwrite", "add"])
def test_step_matches_reference(backend, device, algo, param_kind, fused):
    gen = torch.Generator().manual_seed(_seed(algo, param_kind, fused))
    sizes = [1, 3, 257, 1024, 1025, 4097]  # 1024: rows a kernel may take on its vector path
    params, states, lp, accs, steps = _step_inputs(algo, sizes, param_kind, device, gen)
    grads = _grads(sizes, torch.bfloat16, device, gen) if fused else []
    lr = torch.tensor(0.01, device=device)
    coef = torch.tensor(0.25, device=device)
    ref = [_clone(params), [_clone(s) for s in states], _clone(lp), _clone(accs)]
    accs_before = _clone(accs)
    _call(backends.get(backend), algo, params, states, lp, accs, steps, lr, coef, grads, fused == "overwrite")
    _call(reference, algo, ref[0], ref[1], ref[2], ref[3], steps, lr, coef, grads, fused == "overwrite")
    tol = STEP_TOL if param_kind != "bf16" else dict(rtol=1.6e-2, atol=1e-5)  # 1 bf16 ulp: 2^-7
    for got, want in zip(params, ref[0]):
        torch.testing.assert_close(got, want, **tol)
    for got_list, want_list in zip(states, ref[1]):
        for got, want in zip(got_list, want_list):
            torch.testing.assert_close(got, want, **STEP_TOL)
    for p, low in zip(params, lp):  # the low-precision copy is the master rounded to nearest
        assert torch.equal(low, p.to(low.dtype))
    for a, before in zip(accs, accs_before):  # the accumulator is read, never written
        assert torch.equal(a, before)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("algo", list(ALGOS))
def test_step_skips_everything_when_found_inf(backend, device, algo):
    gen = torch.Generator().manual_seed(3)
    params, states, lp, accs, steps = _step_inputs(algo, [7, 1025], "master", device, gen)
    for low, p in zip(lp, params):
        low.copy_(p)
    before = [_clone(params), [_clone(s) for s in states], _clone(lp)]
    found_inf = torch.ones((), device=device)
    lr, coef = torch.tensor(0.1, device=device), torch.tensor(1.0, device=device)
    _call(backends.get(backend), algo, params, states, lp, accs, steps, lr, coef, found_inf=found_inf)
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert all(torch.equal(a, b) for s, t in zip(states, before[1]) for a, b in zip(s, t))
    assert all(torch.equal(a, b) for a, b in zip(lp, before[2]))


def _f32(x: float) -> float:
    return float(np.float32(x))


def _decay_probe(lr: float) -> float:
    """A weight decay at which 1 - lr * wd rounds to another fp32 from the double lr than from lr
    rounded to fp32 first (most do not: the two products differ by ~5e-8 relative)."""
    return next(wd for wd in (k / 100 for k in range(1, 1000)) if _f32(1 - lr * wd) != _f32(1 - _f32(lr) * wd))


@pytest.mark.parametrize("backend,device", [pytest.param("reference", "cpu", id="reference-cpu")] + CASES)
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32])
def test_step_scalars_start_from_the_double_lr(backend, device, lr_dtype):
    """Each step op takes lr as the double its tensor holds (torch's fused optimizers take a
    double), and forms the scalars derived from it in double, rounded to fp32 once (issue 22
    item 16). Inputs are chosen so that the updated param is exactly one such scalar: SGD's -lr
    (p = 0, g = 1), Adam's step size -lr / (1 - beta1) at step 1 (p = 0, m = g = 1, beta2 = 0 and
    eps = 0 make the denominator 1), AdamW's and Lion's decay factor 1 - lr * wd (p = 1, g = m =
    v = 0). At lr = 1e-3 the step size and decay factor (at the weight decay _decay_probe finds)
    differ in fp32 between the double lr and lr rounded to fp32 first, so a backend that rounds
    lr early fails the float64 case. A float32 lr tensor must give its own value's scalars (the
    binding and the launcher widen it, exactly). Two sizes: a vector body and a scalar tail."""
    lr = torch.tensor(1e-3, dtype=lr_dtype, device=device)
    held = float(lr)  # the double the tensor holds: 1e-3, or float32(1e-3)
    wd = _decay_probe(1e-3)
    step_size = lambda x: _f32(-(x / (1 - 0.9)))  # noqa: E731 (step 1: 1 - beta1**1)
    assert step_size(1e-3) != step_size(_f32(1e-3)), "the Adam case cannot tell the two lrs apart"
    sizes = [3, 1025]
    module = backends.get(backend)
    one = torch.ones((), device=device)

    def run(algo_call, p, m, v, g):
        params = [torch.full((n,), p, device=device) for n in sizes]
        m_, v_ = ([torch.full((n,), x, device=device) for n in sizes] for x in (m, v))
        accs = flat_layout(sizes, device, fill=g).views
        algo_call(module, params, m_, v_, accs, torch.ones(len(sizes), device=device))
        return torch.cat(params)

    def expect(got, value, what):
        want = torch.full_like(got, value)
        assert torch.equal(got, want), f"{what}: got {got[0].item()!r}, want {value!r}"

    got = run(
        lambda mod, ps, m, v, accs, steps: mod.step(
            ops.sgd_step,
            *ops.sgd_step.records(
                params=ps,
                accs=accs,
                steps=steps,
                lr=lr,
                coef=one,
                momentum=0.0,
                dampening=0.0,
                weight_decay=0.0,
                nesterov=False,
                maximize=False,
            ),
        ),
        p=0.0,
        m=0.0,
        v=0.0,
        g=1.0,
    )
    expect(got, _f32(-held), "SGD's -lr")
    got = run(
        lambda mod, ps, m, v, accs, steps: mod.step(
            ops.adam_step,
            *ops.adam_step.records(
                params=ps,
                exp_avgs=m,
                exp_avg_sqs=v,
                accs=accs,
                steps=steps,
                lr=lr,
                coef=one,
                beta1=0.9,
                beta2=0.0,
                eps=0.0,
                weight_decay=0.0,
                decoupled=False,
                maximize=False,
            ),
        ),
        p=0.0,
        m=1.0,
        v=1.0,
        g=1.0,
    )
    expect(got, step_size(held), "Adam's step size")
    got = run(
        lambda mod, ps, m, v, accs, steps: mod.step(
            ops.adam_step,
            *ops.adam_step.records(
                params=ps,
                exp_avgs=m,
                exp_avg_sqs=v,
                accs=accs,
                steps=steps,
                lr=lr,
                coef=one,
                beta1=0.9,
                beta2=0.999,
                eps=1.0,
                weight_decay=wd,
                decoupled=True,
                maximize=False,
            ),
        ),
        p=1.0,
        m=0.0,
        v=0.0,
        g=0.0,
    )
    expect(got, _f32(1 - held * wd), "AdamW's decay factor")
    got = run(
        lambda mod, ps, m, v, accs, steps: mod.step(
            ops.lion_step,
            *ops.lion_step.records(
                params=ps,
                exp_avgs=m,
                accs=accs,
                steps=steps,
                lr=lr,
                coef=one,
                beta1=0.9,
                beta2=0.99,
                weight_decay=wd,
                maximize=False,
            ),
        ),
        p=1.0,
        m=0.0,
        v=0.0,
        g=0.0,
    )
    expect(got, _f32(1 - held * wd), "Lion's decay factor")


@pytest.mark.parametrize("backend,device", [pytest.param("reference", "cpu", id="reference-cpu")] + CASES)
@pytest.mark.parametrize("bad", ["float16", "two_elements"])
def test_step_rejects_an_lr_that_is_not_one_float64_or_float32(backend, device, bad):
    """Every backend checks lr the same way (a float16 lr would lose digits; two lrs are not a
    scalar)."""
    shape, dtype = {"float16": ((), torch.float16), "two_elements": ((2,), torch.float64)}[bad]
    lr = torch.full(shape, 1e-3, dtype=dtype, device=device)
    p, accs = torch.zeros(4, device=device), flat_layout([4], device, fill=1.0).views
    with pytest.raises((ValueError, RuntimeError), match=r"lr must be a one-element float64 or float32 tensor"):
        backends.get(backend).step(
            ops.sgd_step,
            *ops.sgd_step.records(
                params=[p],
                accs=accs,
                steps=torch.ones(1, device=device),
                lr=lr,
                coef=torch.ones((), device=device),
                momentum=0.0,
                dampening=0.0,
                weight_decay=0.0,
                nesterov=False,
                maximize=False,
            ),
        )


# --- a split step's two ops (Muon's prologue and epilogue) -----------------------------------

SPLIT = cases.kernel_cases(split=True)  # tests/cases.py: the kernel cases of the split steps
# one element, one row, one column, primes, past a block (1024) with a tail past any vector
# width; tall and wide
SPLIT_SHAPES = [(1, 1), (1, 13), (7, 1), (17, 61), (37, 29), (3, 1367)]
SPLIT_KINDS = ["fp32", "master", "bf16", "remainder"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits (NaN payloads and -0.0 included), as integers of its width: a copy."""
    return x.detach().cpu().clone().view({4: torch.int32, 2: torch.int16}[x.element_size()])


def _split_weights(kind, device, gen):
    """t's weight fields for a param kind: fp32 params of the matrices' shapes; fp32 masters (1-D,
    as the optimizer's) with bf16/fp16 weights, an eighth of their elements written from outside;
    bf16 params without a master; or bf16 weights with int16 remainders (exact masters)."""
    matrices = [torch.randn(s, generator=gen) for s in SPLIT_SHAPES]
    if kind == "fp32":
        return dict(params=[m.to(device) for m in matrices])
    if kind == "bf16":
        return dict(params=[m.to(device, torch.bfloat16) for m in matrices])
    if kind == "remainder":
        pairs = [reference.split_master(m.reshape(-1)) for m in matrices]
        return dict(params=[w.view(m.shape).to(device) for (w, _), m in zip(pairs, matrices)],
                    remainders=[r.to(device) for _, r in pairs])  # fmt: skip
    lp = [m.to(LOW[i % 2]) for i, m in enumerate(matrices)]
    for low in lp:
        edited = torch.rand(low.shape, generator=gen) < 0.125
        low[edited] = torch.randn(int(edited.sum()), generator=gen).to(low.dtype)
    return dict(params=[m.reshape(-1).to(device) for m in matrices], lp_params=[low.to(device) for low in lp])


def _split_tensors(weights, device, gen, variant):
    """StepTensors around ``weights``: fresh random accumulators (and the fused micro-batch's
    gradients), every found_inf variant."""
    numels = [r * c for r, c in SPLIT_SHAPES]
    accs = flat_layout(numels, device, fill=NAN).views
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    fused = variant.startswith("fused")
    return ops.StepTensors(
        accs=accs,
        steps=torch.ones(len(numels), device=device),
        lr=torch.tensor(0.02, dtype=torch.float64, device=device),
        coef=torch.tensor(0.25, device=device),
        grads=[torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in SPLIT_SHAPES] if fused else [],
        grad_alpha=0.5,
        grads_overwrite=variant == "fused_overwrite",
        found_inf=torch.tensor(1.0 if variant == "skipped" else 0.0, device=device),
        **weights,
    )


def _weights_of(t):
    return [*t.params, *t.lp_params, *t.remainders]


def _clone_weights(t):
    return t._replace(**{k: _clone(getattr(t, k)) for k in ("params", "lp_params", "remainders")})


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("algo", list(SPLIT))
@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("variant", ["window", "fused_overwrite", "fused_add", "skipped"])
def test_split_step_prologue_matches_reference(backend, device, algo, kind, variant):
    """The prologue (Muon's momentum, and the middle's input written into ``updates``, poisoned
    before the call): the reference's bits in both lists, from the window's gradient or with the
    last micro-batch fused in; no weight, lp or remainder bit changes (none is read or written);
    a skipped window (found_inf) writes neither list."""
    gen = torch.Generator().manual_seed(_seed("prologue", algo, kind, variant))
    op, h, _ = cases.op_records(SPLIT[algo])
    t = _split_tensors(_split_weights(kind, device, gen), device, gen, variant)
    buffers = [torch.randn(s, generator=gen).reshape(-1).to(device) for s in SPLIT_SHAPES]
    updates = [torch.full(s, NAN, device=device) for s in SPLIT_SHAPES]
    want = [_clone(buffers), _clone(updates)]
    weights_before = [_bits(w) for w in _weights_of(t)]
    backends.get(backend).step(op.prologue, t, op.prologue.states(buffers, updates), h)
    t_ref = _clone_weights(t)
    reference.step(op.prologue, t_ref, op.prologue.states(*want), h)
    for got, expect in zip(buffers + updates, want[0] + want[1]):
        assert torch.equal(_bits(got), _bits(expect))
    assert all(torch.equal(_bits(w), b) for w, b in zip(_weights_of(t), weights_before))
    if variant == "skipped":
        assert all(torch.isnan(u).all() for u in updates)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("algo", list(SPLIT))
@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("variant", ["window", "fused_add", "skipped"])
def test_split_step_epilogue_matches_reference(backend, device, algo, kind, variant):
    """The epilogue (Muon's decay and adjusted-lr update) from the middle's output (bf16 as
    torch's Newton-Schulz gives it, transposed where the matrix is tall, or fp32): the
    reference's bits in every weight format, whatever gradient the call carries (it reads
    none); a skipped window writes nothing."""
    gen = torch.Generator().manual_seed(_seed("epilogue", algo, kind, variant))
    op, h, _ = cases.op_records(SPLIT[algo])
    t = _split_tensors(_split_weights(kind, device, gen), device, gen, variant)
    updates = []
    for i, (rows, columns) in enumerate(SPLIT_SHAPES):
        if i % 3 == 2:
            updates.append(torch.randn(rows, columns, generator=gen).to(device))
        else:
            updates.append(torch.randn(columns, rows, generator=gen).to(device, torch.bfloat16).T)
    weights_before = [_bits(w) for w in _weights_of(t)]
    t_ref = _clone_weights(t)
    backends.get(backend).step(op.epilogue, t, op.epilogue.states(updates), h)
    reference.step(op.epilogue, t_ref, op.epilogue.states(updates), h)
    for got, expect in zip(_weights_of(t), _weights_of(t_ref)):
        assert torch.equal(_bits(got), _bits(expect)), f"{(_bits(got) != _bits(expect)).sum()} elements differ"
    if variant == "skipped":
        assert all(torch.equal(_bits(w), b) for w, b in zip(_weights_of(t), weights_before))


@pytest.mark.parametrize("backend,device", [pytest.param("reference", "cpu", id="reference-cpu")] + CASES)
def test_split_step_epilogue_refuses_an_update_that_is_not_a_matrix(backend, device):
    op, h, _ = cases.op_records(SPLIT["muon"])
    t = ops.StepTensors(
        [torch.zeros(6, device=device)],
        flat_layout([6], device, fill=0.0).views,
        torch.ones(1, device=device),
        torch.tensor(0.02, dtype=torch.float64, device=device),
        torch.ones((), device=device),
    )
    with pytest.raises((ValueError, RuntimeError), match=r"updates\[0\] must be a matrix \(2-D\), got shape"):
        backends.get(backend).step(op.epilogue, t, op.epilogue.states([torch.zeros(6, device=device)]), h)


# --- the same numbers as torch.optim's fused CPU optimizers ----------------------------------

# The optimizer configurations: every case of the algorithms whose torch.optim class has a fused
# CPU step (tests/cases.py), as torch's keywords but lr. Together they cover coupled and
# decoupled weight decay, amsgrad, maximize, both ends of exp_avg's lerp (1 - beta1 below and
# above 0.5), SGD's dampening and nesterov, and SGD without momentum.
TORCH_FUSED = {
    c.id: c._replace(kwargs={k: v for k, v in c.kwargs.items() if k != "lr"})
    for c in cases.cases(every=True)
    if cases.TABLE[c.algorithm].torch_fused
}
TORCH_FUSED_BACKENDS = CPU_BACKENDS  # the reference too: here every backend is checked against torch


# lr = 1e-3 is not exact in fp32: torch's fused CPU optimizers take it as a double (a tensor lr
# as lr.item<double>()), so our ops must too (issue 22 item 16: rounded to fp32 first, Adam's step
# size was 1 ulp off in 70 of the first 1,000 steps). A float64 tensor lr keeps the double; an
# fp32 one holds float(1e-3), which torch and the ops then take as that double.
LRS = {
    "float": lambda: 1e-3,
    "tensor_f64": lambda: torch.tensor(1e-3, dtype=torch.float64),
    "tensor_f32": lambda: torch.tensor(1e-3),
}


def _op_lr(lr):
    """The lr tensor an op gets for torch's lr: a Python float as the float64 tensor the
    optimizer fills (FlatGroup.lr), a tensor as it is."""
    return lr.clone() if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=torch.float64)


def _run_torch_fused(case, lr, params0, grads):
    """torch's fused CPU optimizer of ``case``: the params, and its states in the op's order."""
    params = [p.clone().requires_grad_() for p in params0]
    opt = case.peer(params, lr=lr.clone() if isinstance(lr, torch.Tensor) else lr, fused=True, **case.kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    states = [[opt.state[p][name] for p in params] for name in cases.op_records(case)[2]]
    return [p.detach() for p in params], states


def _run_op_steps(module, case, lr, params0, grads):
    """The same steps through a backend's op: the gradient in acc, coef 1, per-tensor step counts,
    each state from its record's initial value (Adagrad's sum from initial_accumulator_value)."""
    params = [p.clone() for p in params0]
    n = len(params)
    lr_t, coef = _op_lr(lr), torch.tensor(1.0)
    initial = initial_states(case.algorithm, cases.group(case))
    states = [[torch.full_like(p, initial[key]) for p in params] for key in cases.op_records(case)[2]]
    for i, step_grads in enumerate(grads):
        accs = [g.clone() for g in step_grads]
        steps = torch.full((n,), float(i + 1))
        cases.op_call(module, case, ops.StepTensors(params, accs, steps, lr_t, coef), states)
    return params, states


def _random_run(sizes, seed, steps=100):
    gen = torch.Generator().manual_seed(seed)
    params0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(steps)]
    return params0, grads


@pytest.mark.parametrize("backend", TORCH_FUSED_BACKENDS)
@pytest.mark.parametrize("case", list(TORCH_FUSED))
@pytest.mark.parametrize("lr", list(LRS))
@pytest.mark.usefixtures("one_thread")
def test_steps_match_torch_fused_bit_for_bit(backend, case, lr):
    """100 steps on fp32 params at lr = 1e-3 (a float, a float64 or an fp32 tensor: LRS), against
    torch.optim.<cls>(fused=True) on the CPU: the same bits in params and every state. Exact,
    because reference and kernels follow torch's fused kernel's order of operations and FMAs
    (csrc/math.h says which) and take lr as the double torch takes. Every size is a multiple of
    16: torch's scalar tail (the last numel % 8 or % 16 elements) contracts SGD's momentum FMA the
    other way; test_steps_match_torch_fused_within_1e_7 covers the tails. Triton computes its own
    formulas: it is held to the 1e-7 test only."""
    if backend == "triton":
        pytest.skip("triton is held to test_steps_match_torch_fused_within_1e_7")
    params0, grads = _random_run([16, 48, 1024, 4112], _seed("bitwise", case))
    want_p, want_s = _run_torch_fused(TORCH_FUSED[case], LRS[lr](), params0, grads)
    got_p, got_s = _run_op_steps(backends.get(backend), TORCH_FUSED[case], LRS[lr](), params0, grads)
    assert len(got_s) == len(want_s)
    for got, want in zip(got_p + sum(got_s, []), want_p + sum(want_s, [])):
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"


@pytest.mark.parametrize("backend", TORCH_FUSED_BACKENDS)
@pytest.mark.parametrize("case", list(TORCH_FUSED))
@pytest.mark.usefixtures("one_thread")
def test_steps_match_torch_fused_within_1e_7(backend, case):
    """100 steps, awkward sizes, lr = 1e-3: ||ours - torch|| / ||torch|| <= 1e-7 over all params.
    Not exact, for one 1-ulp effect: torch's scalar tail elements (sizes 1, 7, 13, 4099 have
    tails) contract some FMAs the other way (SGD's momentum, Adam's coupled weight decay).
    Measured after 100 steps: at most 1.3e-9 (reference, cpu, and triton in the interpreter);
    1e-7 leaves a 77x margin, while a formula difference (fp32 bias corrections: 5e-6 per step)
    fails it."""
    params0, grads = _random_run([1, 7, 13, 1000, 4099], _seed("1e-7", case))
    want_p, want_s = _run_torch_fused(TORCH_FUSED[case], 1e-3, params0, grads)
    got_p, got_s = _run_op_steps(backends.get(backend), TORCH_FUSED[case], 1e-3, params0, grads)
    want, got = torch.cat(want_p), torch.cat(got_p)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-7, rel
    for got_list, want_list in zip(got_s, want_s):
        g, w = torch.cat(got_list), torch.cat(want_list)
        assert ((g - w).norm() / w.norm()).item() <= 1e-7


def _optimizer_run(make, lr, params0, grads):
    """Steps the optimizer make(params, lr) over fp32 nn.Parameters, one backward per step whose
    gradients are exactly grads[step] (the loss is sum(p * g)); returns the params and each
    param's state but its step count."""
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = make(params, lr)
    for step_grads in grads:
        sum((p * g).sum() for p, g in zip(params, step_grads)).backward()
        opt.step()
        opt.zero_grad()
    states = [{k: v.clone() for k, v in opt.state[p].items() if k != "step"} for p in params]
    return [p.detach() for p in params], states


@pytest.mark.parametrize("backend", TORCH_FUSED_BACKENDS)
@pytest.mark.parametrize("case", list(TORCH_FUSED))
@pytest.mark.parametrize("lr", list(LRS))
@pytest.mark.usefixtures("one_thread")
def test_optimizer_matches_torch_fused_bit_for_bit(backend, case, lr):
    """fused_accum.SGD / Adam / AdamW over fp32 params, 20 steps at lr = 1e-3 (a float, a
    float64 and an fp32 tensor), against torch.optim.<cls>(fused=True) on the CPU: the same bits
    in params and state. The optimizer hands the step op lr as the double torch takes
    (FlatGroup.lr is float64). Before issue 22 item 16 it rounded lr to fp32 first, and Adam's
    and AdamW's params differed from torch's in 0.2-4.7% of elements here (float and float64 lr;
    an fp32 tensor lr matched: torch too takes its fp32 value). The params start at std 0.02 (a
    transformer's initialisation), where a step of ~1e-3 is a large share of a param, so a
    1-ulp step size changes the param's rounding often. Sizes are multiples of 16, as in
    test_steps_match_torch_fused_bit_for_bit (torch's scalar tail)."""
    if backend == "triton":
        pytest.skip("triton is held to test_steps_match_torch_fused_within_1e_7")
    c = TORCH_FUSED[case]
    params0, grads = _random_run([16, 48, 1024, 4112], _seed("optimizer", case), steps=20)
    params0 = [p * 0.02 for p in params0]
    want_p, want_s = _optimizer_run(
        lambda ps, lr_: c.peer(ps, lr=lr_, fused=True, **c.kwargs), LRS[lr](), params0, grads
    )
    got_p, got_s = _optimizer_run(lambda ps, lr_: c.make(ps, lr=lr_, backend=backend), LRS[lr](), params0, grads)
    for got, want in zip(got_p, want_p):
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"
    for got, want in zip(got_s, want_s):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def _lion_lucidrains(params0, grads, lr, beta1, beta2, weight_decay):
    """Lion as lucidrains/lion-pytorch writes it (an independent implementation, torch ops only)."""
    params = [p.clone() for p in params0]
    exp_avgs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, m, g in zip(params, exp_avgs, step_grads):
            p.mul_(1 - lr * weight_decay)
            update = m.clone().mul_(beta1).add(g, alpha=1 - beta1).sign_()
            p.add_(update, alpha=-lr)
            m.mul_(beta2).add_(g, alpha=1 - beta2)
    return params, exp_avgs


@pytest.mark.parametrize("backend", TORCH_FUSED_BACKENDS)
@pytest.mark.usefixtures("one_thread")
def test_lion_matches_an_independent_implementation(backend):
    """100 Lion steps against lucidrains' formula. reference and cpu: bit for bit (lr = 1e-4,
    Lion's default, not exact in fp32, reaches the op as the float64 tensor the optimizer passes;
    the kernels round it to fp32 and form 1 - lr * wd in double, as lucidrains' ops do with a
    Python float). triton: ||diff|| / ||lucidrains|| <= 100 * 2**-24 (= 6e-6: it evaluates its
    own FMAs, at most an fp32 rounding apart per step, and 100 steps can add them up on the
    one-element tensor, where the norm averages nothing (1.7e-7 seen with triton 3.6); a wrong
    order of sign and momentum update moves params by ~lr = 1e-4 relative, 17x more)."""
    lr, beta1, beta2, wd = 1e-4, 0.9, 0.99, 0.1
    params0, grads = _random_run([1, 7, 1000, 4099], _seed("lion"))
    want_p, want_m = _lion_lucidrains(params0, grads, lr, beta1, beta2, wd)
    params = [p.clone() for p in params0]
    exp_avgs = [torch.zeros_like(p) for p in params]
    module = backends.get(backend)
    for i, step_grads in enumerate(grads):
        module.step(
            ops.lion_step,
            ops.StepTensors(
                params,
                [g.clone() for g in step_grads],
                torch.full((len(params),), i + 1.0),
                _op_lr(lr),
                torch.tensor(1.0),
            ),
            ops.lion_step.states(exp_avgs),
            ops.lion_step.hyper(beta1=beta1, beta2=beta2, weight_decay=wd, maximize=False),
        )
    for got, want in zip(params + exp_avgs, want_p + want_m):
        if backend == "triton":
            assert ((got - want).norm() / want.norm()).item() <= len(grads) * 2.0**-24
        else:
            assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"


# --- AdEMAMix against pytorch-optimizer ------------------------------------------------------

ADEMAMIX = {c.id: c for c in cases.cases(every=True) if c.algorithm == "ademamix"}  # tests/cases.py
ADEMAMIX_STATES = ("exp_avg", "exp_avg_sq", "exp_avg_slow")


def _run_ademamix_peer(case, params0, grads, foreach=False, ieee_sqrt=True):
    """pytorch-optimizer's AdEMAMix(weight_decouple=True) (tests/cases.py: AdEMAMixPeer) with
    ``case``'s keywords over fp32 copies of ``params0``, one step per entry of ``grads``: its
    params and states. With ``ieee_sqrt`` its ``exp_avg_sq.sqrt()`` is correctly rounded while it
    steps (reference._sqrt): torch's fp32 CPU sqrt is not, in ~17% of elements (the kernels' sqrtf
    and torch's fused optimizers' are)."""
    params = [p.clone().requires_grad_() for p in params0]
    opt = case.peer(params, foreach=foreach, **case.kwargs)
    with mock.patch.object(torch.Tensor, "sqrt", reference._sqrt) if ieee_sqrt else contextlib.nullcontext():
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    return [p.detach() for p in params], [[opt.state[p][key] for p in params] for key in ADEMAMIX_STATES]


@pytest.mark.parametrize("backend", TORCH_FUSED_BACKENDS)
@pytest.mark.parametrize("case", list(ADEMAMIX))
@pytest.mark.usefixtures("one_thread")
def test_ademamix_steps_as_pytorch_optimizer(backend, case):
    """100 steps, awkward sizes, against pytorch-optimizer 4.1.0's AdEMAMix(weight_decouple=True):
    reference and cpu bit for bit in params and every state, where the peer's square root is
    correctly rounded (as every backend's is; torch's fp32 CPU sqrt is not). The peer's own
    foreach and for-loop paths step the same bits on the CPU (checked here), so this is as close
    as they are to each other. Triton computes its own powers (bits._pow_whole: ~log2(step)
    roundings) and, in the interpreter, numpy's exp: ||diff|| / ||peer|| <= 100 * 2**-24 (6e-6,
    at most an fp32 rounding apart per step over 100 steps, as test_lion_matches_an_independent_
    implementation's bound; measured 3e-7), where a wrong warm-up or bias correction moves params
    by ~lr = 1e-3 relative."""
    c = ADEMAMIX[case]
    params0, grads = _random_run([1, 7, 16, 1000, 4099], _seed("ademamix", case))
    want_p, want_s = _run_ademamix_peer(c, params0, grads)
    foreach_p, foreach_s = _run_ademamix_peer(c, params0, grads, foreach=True, ieee_sqrt=False)
    loop_p, loop_s = _run_ademamix_peer(c, params0, grads, foreach=False, ieee_sqrt=False)
    assert all(torch.equal(a, b) for a, b in zip(foreach_p + sum(foreach_s, []), loop_p + sum(loop_s, [])))
    got_p, got_s = _run_op_steps(backends.get(backend), c, c.kwargs["lr"], params0, grads)
    for got, want in zip(got_p + sum(got_s, []), want_p + sum(want_s, [])):
        if backend == "triton":
            assert ((got - want).norm() / want.norm()).item() <= len(grads) * 2.0**-24
        else:
            assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"


@pytest.mark.parametrize("backend", [b for b in TORCH_FUSED_BACKENDS if b != "triton"])
@pytest.mark.parametrize("case", list(ADEMAMIX))
@pytest.mark.usefixtures("one_thread")
def test_ademamix_optimizer_steps_as_pytorch_optimizer_bit_for_bit(backend, case):
    """fused_accum.AdEMAMix over fp32 params (std 0.02), 20 steps, against pytorch-optimizer's
    with a correctly rounded sqrt (see above): the same bits in params and every state (triton
    is held to test_ademamix_steps_as_pytorch_optimizer's bound instead)."""
    c = ADEMAMIX[case]
    params0, grads = _random_run([16, 48, 1024, 4112], _seed("ademamix_optimizer", case), steps=20)
    params0 = [p * 0.02 for p in params0]
    want_p, want_s = _run_ademamix_peer(c, params0, grads)
    got_p, got_s = _optimizer_run(lambda ps, lr: c.make(ps, backend=backend), None, params0, grads)
    for got, want in zip(got_p, want_p):
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"
    for i, got in enumerate(got_s):
        assert got.keys() == set(ADEMAMIX_STATES)
        for k, key in enumerate(ADEMAMIX_STATES):
            assert torch.equal(got[key], want_s[k][i]), key


def test_reference_primitives_round_as_torch_fused_kernels():
    """What the reference's bit-exactness rests on (so a torch upgrade that changes one fails
    here, naming it, rather than as an unexplained 1-ulp mismatch): addcmul is one FMA, lerp is
    torch's two-sided FMA formula, and the reference's sqrt is correctly rounded. The exact
    values come from float64, where a product of two fp32 values is exact."""
    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.randn(100_003, generator=gen) for _ in range(3))
    exact_fma = (a.double() * b.double() + c.double()).float()  # double rounding: ~2^-29 chance
    assert (torch.addcmul(c, a, b) != exact_fma).sum() <= 2
    for w in (0.1, 0.7):
        wf = torch.tensor(w).double()
        ends = (wf * (b - a).double() + a.double()) if w < 0.5 else ((wf - 1) * (b - a).double() + b.double())
        assert (torch.lerp(a, b, w) != ends.float()).sum() <= 2
    v = torch.rand(100_003, generator=gen)
    assert torch.equal(reference._sqrt(v), torch.from_numpy(np.sqrt(v.numpy())))  # IEEE sqrt


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter process only")
def test_interpreter_process_really_checks_triton():
    """Guards the CI wiring: the Triton matrix must really run in the interpreter process."""
    assert "triton" in CPU_KERNEL_BACKENDS, backends.availability("triton", "cpu")


# --- exact 2-byte masters: bf16 params plus int16 remainders (issue 28) ----------------------
#
# With ``remainders`` a step op's params are the bf16 parameters and its fp32 masters are
# rebuilt from them and the remainders (reference.split_master / rebuild_master, csrc/math.h):
# from the same master, the new master must be the fp32-master mode's bit for bit, on every
# backend, and the weight split_master's (= master.to(bfloat16) except at exact ties, where it
# rounds away from zero). Comparisons are of bit patterns (NaN-safe), never tolerances.

REMAINDER_ALGOS = {
    **cases.kernel_cases(cases.REMAINDER),
    "sgd_momentum": cases.Case("sgd_momentum", "sgd", dict(momentum=0.9)),
}
REMAINDER_SIZES = [1, 7, 257, 1030]  # 1030: a block and a tail past any vector width
_OVERFLOWING, _INF_BITS = 0x7F7F8000, 0x7F800000


def _u32(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of an fp32 tensor as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_u32(u: torch.Tensor) -> torch.Tensor:
    return (u - (u >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)


def _u16(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a bf16 (or int16) tensor as int64 in [0, 2**16), flattened."""
    return x.reshape(-1).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _awkward_fp32(n: int, gen: torch.Generator, kinds: int = 10) -> torch.Tensor:
    """fp32 values of ten kinds, mixed at random: normal, exact bf16 ties (low half 0x8000), one
    ulp either side of a tie, denormals, huge (~1e37), tiny normals (~1e-37), +-0, random finite
    bit patterns (every exponent), finite masters that round to inf (>= 0x7F7F8000), and values
    within a few ulp of an exact tie of a bf16 near 1 (where updates of ~lr cross ties)."""
    kind = torch.randint(0, kinds, (n,), generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen).long() << 31
    bf16 = torch.randint(0, 0x7F80, (n,), generator=gen).long()  # finite bf16 magnitudes
    low = torch.randint(0, 2**16, (n,), generator=gen).long()
    normal = _u32(torch.randn(n, generator=gen))
    tie = (bf16 << 16) | 0x8000
    near_tie = tie + torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1)
    denormal = torch.randint(0, 1 << 23, (n,), generator=gen).long()
    huge = _u32(torch.randn(n, generator=gen) * 1e37) & 0x7FFFFFFF
    tiny = _u32(torch.randn(n, generator=gen) * 1e-37) & 0x7FFFFFFF
    finite_bits = (bf16 << 16) | low
    overflowing = _OVERFLOWING + torch.randint(0, 0x8000, (n,), generator=gen).long()
    near_one = 0x3F808000 + torch.randint(-3, 4, (n,), generator=gen).long()
    choices = [normal, tie, near_tie, denormal, huge, tiny, torch.zeros_like(low), finite_bits, overflowing, near_one]
    u = torch.zeros(n, dtype=torch.int64)
    for k, values in enumerate(choices[:kinds]):
        u = torch.where(kind == k, values & 0x7FFFFFFF, u)
    return _from_u32(u | sign)


def _awkward_grads(n: int, gen: torch.Generator) -> torch.Tensor:
    """Gradients: mostly normal, some exactly 0 (so a master at a tie stays there), denormals,
    tiny and large (1e3) magnitudes."""
    kind = torch.randint(0, 6, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    g = torch.where(kind == 1, 0.0, g)
    g = torch.where(kind == 2, _from_u32(torch.randint(0, 1 << 23, (n,), generator=gen).long()), g)
    g = torch.where(kind == 3, g * 1e-36, g)
    g = torch.where(kind == 4, g * 1e3, g)
    return g


class TieCount(NamedTuple):
    ties: int  # finite masters at an exact tie
    differing: int  # ... whose weight is not master.to(bfloat16) (the even neighbour is nearer 0)


def canonical(master: torch.Tensor) -> torch.Tensor:
    """What the remainder mode keeps of an fp32 master: rebuild_master(split_master(master)),
    the master itself below 3.3961e38 in magnitude, +-inf from there to inf, the canonical NaN
    (with its sign) for a NaN."""
    return reference.rebuild_master(*reference.split_master(master.contiguous()))


def check_split_weights(masters, weights, remainders) -> TieCount:
    """The written (weight, remainder) of each fp32 master, checked on its bits: it is
    split_master(master), so it rebuilds the master exactly below the overflowing magnitudes
    (3.3961e38), +-inf from there to inf, the canonical NaN for a NaN; the weight is finite
    exactly when the master is finite and below 3.3961e38, NaN exactly when the master is; below
    the overflowing magnitudes it is master.to(bfloat16) except at exact ties, where it is the
    neighbour away from zero; from there up it is master.to(bfloat16) (+-inf, or a NaN)."""
    ties = differing = 0
    for master, weight, remainder in zip(masters, weights, remainders):
        master = master.reshape(-1)
        want_w, want_r = reference.split_master(master)
        assert torch.equal(_u16(weight), _u16(want_w)), "weights are not split_master's"
        assert torch.equal(_u16(remainder), _u16(want_r)), "remainders are not split_master's"
        m = _u32(master) & 0x7FFFFFFF
        shown = m < _OVERFLOWING  # finite masters that round to a finite bf16
        rebuilt = _u32(reference.rebuild_master(weight.reshape(-1), remainder.reshape(-1)))
        assert torch.equal(rebuilt[shown], _u32(master)[shown]), "a master below 3.3961e38 not rebuilt exactly"
        sign = _u32(master) & 0x80000000
        huge = (m >= _OVERFLOWING) & (m <= _INF_BITS)
        assert torch.equal(rebuilt[huge], (sign | _INF_BITS)[huge]), "a master from 3.3961e38 up not rebuilt as inf"
        nan = m > _INF_BITS
        assert torch.equal(rebuilt[nan], (sign | 0x7FC00000)[nan]), "a NaN not rebuilt as the canonical NaN"
        w32 = weight.reshape(-1).float()
        assert torch.equal(torch.isfinite(w32), shown), "a weight finite where its master is huge or not finite"
        assert torch.equal(torch.isnan(w32), torch.isnan(master)), "a weight NaN where its master is not"
        rne = _u16(master.to(torch.bfloat16))
        at_tie = shown & ((m & 0xFFFF) == 0x8000)
        differs = shown & (_u16(weight) != rne)
        assert not (differs & ~at_tie).any(), "a weight differs from master.to(bfloat16) away from a tie"
        away = ((m + 0x8000) >> 16) | ((_u32(master) >> 16) & 0x8000)
        assert torch.equal(_u16(weight)[at_tie], away[at_tie]), "a tie not rounded away from zero"
        assert torch.equal(_u16(weight)[huge], rne[huge]), "an overflowing master not shown as +-inf"
        ties += int(at_tie.sum())
        differing += int(differs.sum())
    return TieCount(ties, differing)


def _remainder_call(module, algo, params, remainders, lp, states, accs, steps, lr, coef, grads, overwrite, found_inf):
    t = ops.StepTensors(
        params,
        accs,
        steps,
        lr,
        coef,
        lp_params=lp,
        remainders=remainders,
        grads=list(grads),
        found_inf=found_inf,
        grad_alpha=0.5,
        grads_overwrite=overwrite,
    )
    cases.op_call(module, REMAINDER_ALGOS[algo], t, states)


def _n_states_of(algo: str) -> int:
    return len(cases.op_records(REMAINDER_ALGOS[algo])[2])


def _strided_bf16(n: int, i: int, device="cpu") -> torch.Tensor:
    """A bf16 parameter of n elements: every other one a transposed 2-D view (any strides)."""
    if i % 2 and n % 2 == 0:
        return torch.empty(2, n // 2, dtype=torch.bfloat16, device=device).t()
    return torch.empty(n, dtype=torch.bfloat16, device=device)


def run_both_modes(module, algo, sizes, n_steps, seed, device="cpu"):
    """n_steps of ``algo`` in the fp32-master mode (fp32 masters + bf16 lp_params) and in the
    remainder mode (bf16 params + int16 remainders), from the same masters and states, with
    the same gradients, coef, fused micro-batches (none, added, overwriting) and skipped steps
    (found_inf) each step: after each step the rebuilt masters are the fp32-master mode's as
    the remainder mode keeps them (canonical: bit for bit below 3.3961e38), the states are the
    fp32-master mode's bit for bit, and the weights are checked by check_split_weights; then
    both modes go on from those masters. The data is drawn on the CPU (the same on every
    device). Returns the tie counts summed over the steps."""
    gen = torch.Generator().manual_seed(seed)
    # from masters the remainder mode keeps (the overflowing ones as +-inf); the fp32 mode's
    # lp_params their rounding (the masters follow them where they are not)
    masters = [canonical(_awkward_fp32(n, gen)).to(device) for n in sizes]
    lp = [master.to(torch.bfloat16) for master in masters]
    weights = [_strided_bf16(n, i, device) for i, n in enumerate(sizes)]
    remainders = [torch.empty(n, dtype=torch.int16, device=device) for n in sizes]
    for master, w, r in zip(masters, weights, remainders):
        w0, r0 = reference.split_master(master)
        w.copy_(w0.view(w.shape))  # in the logical order of a strided weight
        r.copy_(r0)
    states = [[torch.randn(n, generator=gen).abs().to(device) for n in sizes] for _ in range(_n_states_of(algo))]
    states_r = [_clone(s) for s in states]
    accs = flat_layout(sizes, device, fill=0.0).views
    # an eighth of the elements never get a gradient: without weight decay their masters (at a
    # tie, for some) stay put; elsewhere updates land on ties by chance (~2**-16 per update)
    still = [torch.rand(n, generator=gen) < 0.125 for n in sizes]
    total = TieCount(0, 0)
    for k in range(n_steps):
        for a, z in zip(accs, still):
            a.copy_(_awkward_grads(a.numel(), gen).masked_fill(z, 0.0))
        fused = k % 3  # 0: none, 1: added to acc, 2: overwriting it
        grads = []
        if fused:
            grads = [
                _awkward_grads(n, gen).masked_fill(z, 0.0).to(device, torch.bfloat16) for n, z in zip(sizes, still)
            ]
        coef = torch.tensor(float(torch.empty(()).uniform_(0.1, 2.0, generator=gen)), device=device)
        found_inf = torch.tensor(1.0 if k % 7 == 6 else 0.0, device=device)
        steps = torch.full((len(sizes),), float(k + 1), device=device)
        lr = torch.tensor(0.01, dtype=torch.float64, device=device)
        before = [_u16(w.cpu()) for w in weights], [_u16(r.cpu()) for r in remainders]
        args = (accs, steps, lr, coef, grads, fused == 2, found_inf)
        _remainder_call(module, algo, masters, [], lp, states, *args)
        _remainder_call(module, algo, weights, remainders, [], states_r, *args)
        cpu = lambda xs: [x.cpu() for x in xs]  # noqa: E731
        got_w, got_r, want = cpu(weights), cpu(remainders), cpu(masters)
        if k % 7 == 6:  # skipped: neither weight nor remainder written
            assert all(torch.equal(_u16(w), b) for w, b in zip(got_w, before[0])), f"step {k}"
            assert all(torch.equal(_u16(r), b) for r, b in zip(got_r, before[1])), f"step {k}"
        for master, w, r in zip(want, got_w, got_r):
            rebuilt = reference.rebuild_master(w.reshape(-1), r)
            diff = (_u32(rebuilt) != _u32(canonical(master))).sum().item()
            assert diff == 0, f"step {k}: {diff} of {master.numel()} masters differ"
        for s, s_r in zip(states, states_r):
            for x, y in zip(s, s_r):
                assert torch.equal(_u32(x.cpu()), _u32(y.cpu())), f"step {k}: states differ"
        for master, low in zip(want, cpu(lp)):  # (a NaN as any NaN: CUDA writes 0x7FFF, torch 0x7FC0)
            same = (_u16(low) == _u16(master.to(torch.bfloat16))) | (torch.isnan(low) & torch.isnan(master))
            assert bool(same.all())
        count = check_split_weights(want, got_w, got_r)
        total = TieCount(total.ties + count.ties, total.differing + count.differing)
        for master in masters:  # both modes go on from the same masters
            master.copy_(canonical(master))
    return total


REMAINDER_BACKENDS = [pytest.param("reference", "cpu", id="reference-cpu")] + CASES


@pytest.mark.parametrize("backend,device", REMAINDER_BACKENDS)
@pytest.mark.parametrize("algo", list(REMAINDER_ALGOS))
@pytest.mark.usefixtures("one_thread")
def test_remainder_masters_follow_fp32_masters_bit_for_bit(backend, device, algo, monkeypatch):
    """1,000 steps per algorithm (the interpreter: 60 steps of 16,652 elements at BLOCK 16,384;
    it takes ~0.1 s per block of BLOCK elements at any BLOCK, 0.2 s a step of both modes here,
    so 1,000 steps of 7 algorithms would take 25 minutes; on a GPU 100 steps of those 16,652),
    awkward data (_awkward_fp32:
    denormals, ties, huge and tiny magnitudes, masters that round to inf), each step a
    different coef and fused micro-batch, every 7th skipped: the remainder mode's rebuilt
    masters and states equal the fp32-master mode's, bit for bit, after every step, and its
    weights follow the tie rule (check_split_weights). The ties are counted (deterministic:
    fixed seeds): with decoupled weight decay (AdamW, Lion) or SGD's, only updates that land on
    a tie make one (10-25 in 1,000 steps of 1,295 elements, ~2**-16 per update; 10-20 in the
    interpreter's run), without it the still elements at ties add 40-75 per step; about half of
    the ties round to the odd neighbour, where the weight is not torch's."""
    sizes, n_steps = REMAINDER_SIZES, 1000
    if device == "cuda":  # the device check's gpu-matrix stage has 65 s for every GPU test: as
        sizes, n_steps = [1, 7, 257, 16387], 100  # many element updates as 1,000 steps, 100 syncs
    elif backend == "triton":
        tb = backends.get("triton")
        monkeypatch.setattr(tb, "BLOCK", 16384)  # (the plan cache is keyed by it: no stale plan)
        sizes, n_steps = [1, 7, 257, 16387], 60
    count = run_both_modes(backends.get(backend), algo, sizes, n_steps, _seed("remainder", algo), device)
    assert 0 < count.differing < count.ties, count  # the tie rule was exercised, both ways


# fp32 bit patterns of every class (and their negatives): +-0, denormals (smallest, largest),
# the smallest normal, a tie and one ulp either side of it (odd and even lower neighbours), the
# largest finite and the first that rounds to inf, inf, NaNs with low halves below and above
# 0x8000 (the smallest payload, quiet, signalling, 0x7FFF7FFF, 0x7FFF8000, 0x7FFFFFFF).
SPECIAL_BITS = [
    0x00000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x3F807FFF, 0x3F808000, 0x3F808001, 0x3F818000,
    0x3F80FFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7F807FFF, 0x7F808000,
    0x7FA00000, 0x7FC00000, 0x7FC01234, 0x7FFF7FFF, 0x7FFF8000, 0x7FFFFFFF,
]  # fmt: skip
SPECIAL = _from_u32(torch.tensor(SPECIAL_BITS + [b | 0x80000000 for b in SPECIAL_BITS], dtype=torch.int64))
# Every low half of these high halves: where the rounding, the swaps and the sign meet.
EDGE_HIGH_HALVES = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80, 0x7F81, 0x7FBF, 0x7FC0]
EDGE_HIGH_HALVES += [0x7FFE, 0x7FFF] + [h | 0x8000 for h in EDGE_HIGH_HALVES]


def _edge_patterns() -> torch.Tensor:
    high = torch.tensor(EDGE_HIGH_HALVES, dtype=torch.int64)
    u = (high[:, None] << 16) | torch.arange(2**16, dtype=torch.int64)[None, :]
    sample = torch.arange(0, 2**32, 4099, dtype=torch.int64)  # ~1M patterns spread over all
    return _from_u32(torch.cat([u.reshape(-1), sample]))


def test_split_and_rebuild_special_values():
    """Each class splits by the rule (check_split_weights: rebuilt bit for bit below 3.3961e38,
    +-inf from there to inf, the canonical NaN for a NaN), and the documented weights: ties away
    from zero (torch's .to(bfloat16) rounds 1 + 2**-8 to even, 1.0), the finite masters that
    round to inf as +-inf, every NaN as the NaN 0x7FC0 (with its sign). Then every low half of
    the edge high halves (14 per sign) and a spread sample of all 2**32 patterns, by the same
    rule; and every pair with an edge weight (each of the 2**16 remainders): the rebuilt master
    rounds to its weight (its split gives the weight back, a NaN weight as the canonical NaN),
    is NaN, inf or finite as the weight is, and lies within half a bf16 ulp of it.
    csrc/tests/test_math.cpp checks math.h's split on every pattern and its rebuild on every
    pair; the kernels are checked against this one in test_remainder_step_special_values."""
    weight, remainder = reference.split_master(SPECIAL)
    check_split_weights([SPECIAL], [weight], [remainder])
    shown = dict(zip(SPECIAL_BITS, _u16(weight).tolist()))
    expect = {
        0x00000000: 0x0000,
        0x00000001: 0x0000,
        0x007FFFFF: 0x0080,  # the largest denormal rounds up to the smallest normal
        0x3F807FFF: 0x3F80,  # one ulp below a tie: down
        0x3F808000: 0x3F81,  # the tie: away from zero (torch: 0x3F80, even)
        0x3F808001: 0x3F81,  # one ulp above: up
        0x3F818000: 0x3F82,  # a tie whose upper neighbour is even: torch's too
        0x7F7F7FFF: 0x7F7F,  # the largest finite bf16
        0x7F7F8000: 0x7F80,  # rounds to inf: inf, as .to(bfloat16)
        0x7F7FFFFF: 0x7F80,  # the largest finite fp32
        0x7F800000: 0x7F80,  # inf
        0x7F800001: 0x7FC0,  # NaNs: the NaN 0x7FC0, whatever their payload
        0x7FC00000: 0x7FC0,
        0x7FFF7FFF: 0x7FC0,
        0x7FFF8000: 0x7FC0,
        0x7FFFFFFF: 0x7FC0,
    }
    for bits, want in expect.items():
        assert shown[bits] == want, f"{bits:#010x} shows as {shown[bits]:#06x}, expected {want:#06x}"
    negative = dict(zip(SPECIAL_BITS, _u16(weight).tolist()[len(SPECIAL_BITS) :]))
    assert all(negative[b] == shown[b] | 0x8000 for b in SPECIAL_BITS), "the sign rides along"
    assert _u16(SPECIAL[5:6].to(torch.bfloat16)).item() == 0x3F80  # (torch rounds that tie to even)
    assert (_u16(remainder)[torch.tensor(SPECIAL_BITS * 2) & 0x7FFFFFFF >= _OVERFLOWING] == 0).all()

    masters = _edge_patterns()
    weight, remainder = reference.split_master(masters)
    check_split_weights([masters], [weight], [remainder])
    # every pair with an edge weight (each remainder): decoded next to its weight
    high = torch.tensor(EDGE_HIGH_HALVES, dtype=torch.int64).repeat_interleave(2**16)
    pair_w = (high - (high >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.bfloat16)
    pair_r = torch.arange(-(2**15), 2**15, dtype=torch.int64).repeat(len(EDGE_HIGH_HALVES)).to(torch.int16)
    check_rebuilt_pairs(pair_w, pair_r)


def check_rebuilt_pairs(pair_w: torch.Tensor, pair_r: torch.Tensor) -> None:
    """For every (bf16 weight, int16 remainder) pair: the rebuilt master splits back to the
    weight (a NaN weight: to the canonical NaN with its sign), is NaN exactly when the weight
    is, +-inf exactly when the weight is, has the weight's sign, and lies within half a bf16
    ulp of it (the distance from W << 16 to its tie W << 16 | 0x8000, in float64: exact)."""
    rebuilt = reference.rebuild_master(pair_w, pair_r)
    again_w, _ = reference.split_master(rebuilt)
    wb = _u16(pair_w)
    w_nan, w_inf = (wb & 0x7FFF) > 0x7F80, (wb & 0x7FFF) == 0x7F80
    want_w = torch.where(w_nan, (wb & 0x8000) | 0x7FC0, wb)
    assert torch.equal(_u16(again_w), want_w), "a pair whose master does not round to its weight"
    assert torch.equal(torch.isnan(rebuilt), w_nan) and torch.equal(torch.isinf(rebuilt), w_inf)
    finite = ~w_nan & ~w_inf
    assert torch.equal((_u32(rebuilt) >> 31)[~w_nan], (wb >> 15)[~w_nan]), "a master with another sign"
    w64 = pair_w.float().double()[finite]
    mag = (wb & 0x7FFF)[finite] << 16
    half_ulp = _from_u32(mag | 0x8000).double() - _from_u32(mag).double()
    assert ((rebuilt.double()[finite] - w64).abs() <= half_ulp).all(), "a master more than half an ulp away"


@pytest.mark.parametrize("backend,device", REMAINDER_BACKENDS)
def test_remainder_step_special_values(backend, device):
    """A step that keeps the masters, then one step of each algorithm, on masters of every
    special class (SPECIAL) and on the edge patterns (for the interpreter: SPECIAL only: 1.8M
    elements take it minutes), random gradients, in both modes from the same masters (those
    the remainder mode keeps: canonical): the rebuilt masters equal the fp32-master mode's as
    the remainder mode keeps them, the states equal its bit for bit (NaN payloads included),
    and the weights are split_master's (check_split_weights): the kernels' split and rebuild
    are the reference's on these patterns."""
    masters0 = SPECIAL if backend == "triton" else torch.cat([SPECIAL, _edge_patterns()])
    gen = torch.Generator().manual_seed(28)
    n = masters0.numel()
    module = backends.get(backend)
    # First a step that changes no master (Lion, lr = 0, no decay, zero gradient and momentum):
    # the kernels' split then writes every pattern, the ties included (2 of SPECIAL's 4 show
    # another weight than torch's, and one per edge high half), and a signalling NaN as the
    # same quieted NaN in both modes.
    masters = [masters0.to(device).clone()]
    weight, remainder = (x.to(device) for x in reference.split_master(masters0))
    zeros = lambda: [torch.zeros(n, device=device)]  # noqa: E731
    for params, rem, m in (([masters[0]], [], zeros()), ([weight], [remainder], zeros())):
        t = ops.StepTensors(
            params,
            flat_layout([n], device, fill=0.0).views,
            torch.ones(1, device=device),
            torch.zeros((), dtype=torch.float64, device=device),
            torch.ones((), device=device),
            remainders=rem,
        )
        module.step(ops.lion_step, t, ops.lion_step.states(m), ops.lion_step.hyper(0.9, 0.99, 0.0, False))
    assert torch.equal(_u32(reference.rebuild_master(weight.cpu(), remainder.cpu())), _u32(canonical(masters[0].cpu())))
    count = check_split_weights([masters[0].cpu()], [weight.cpu()], [remainder.cpu()])
    assert count.ties >= 4 and count.differing >= 2, count
    for algo in REMAINDER_ALGOS:  # both modes from the masters the remainder mode keeps
        masters = [canonical(masters0).to(device)]
        weight, remainder = (x.to(device) for x in reference.split_master(masters0))
        states = [[torch.randn(n, generator=gen).abs().to(device)] for _ in range(_n_states_of(algo))]
        states_r = [_clone(s) for s in states]
        accs = flat_layout([n], device, fill=0.0).views
        accs[0].copy_(torch.randn(n, generator=gen))
        args = (accs, torch.tensor([3.0], device=device), torch.tensor(0.01, dtype=torch.float64, device=device))
        args += (torch.tensor(0.5, device=device), [], False, None)
        _remainder_call(module, algo, masters, [], [], states, *args)
        _remainder_call(module, algo, [weight], [remainder], [], states_r, *args)
        rebuilt = reference.rebuild_master(weight.cpu(), remainder.cpu())
        assert torch.equal(_u32(rebuilt), _u32(canonical(masters[0].cpu()))), algo
        for x, y in zip(states, states_r):
            assert torch.equal(_u32(x[0].cpu()), _u32(y[0].cpu())), algo
        check_split_weights([masters[0].cpu()], [weight.cpu()], [remainder.cpu()])


# What the remainder mode refuses, in the same words on every backend.
BAD_REMAINDERS = {
    "fp16_params": (dict(param_dtype=torch.float16), r"params\[0\] must be bfloat16 with remainders"),
    "fp32_params": (dict(param_dtype=torch.float32), r"params\[0\] must be bfloat16 with remainders"),
    "int32_remainders": (dict(rem_dtype=torch.int32), r"remainders\[0\] must be int16, got"),
    "short_remainder": (dict(rem_numel=3), r"remainders\[0\] has 3 elements but params\[0\] has 4"),
    "one_too_few": (dict(n_rem=0), r"remainders has 1 tensors, expected 0 \(none\) or 2"),
    "with_lp_params": (dict(lp=True), r"remainders and lp_params are exclusive"),
}


@pytest.mark.parametrize("backend,device", REMAINDER_BACKENDS)
@pytest.mark.parametrize("case", list(BAD_REMAINDERS))
def test_remainder_mode_rejects_what_it_cannot_rebuild(backend, device, case):
    """fp16 params are not a truncation of an fp32 (the same 16 bits hold another exponent
    range): no remainder rebuilds their master; fp32 params need none."""
    bad, message = BAD_REMAINDERS[case]
    params = [torch.zeros(4, device=device, dtype=torch.bfloat16) for _ in range(2)]
    params[0] = params[0].to(bad.get("param_dtype", torch.bfloat16))
    remainders = [torch.zeros(4, device=device, dtype=torch.int16) for _ in range(2)]
    remainders[0] = torch.zeros(bad.get("rem_numel", 4), device=device, dtype=bad.get("rem_dtype", torch.int16))
    if "n_rem" in bad:
        remainders = remainders[:1]
    lp = [torch.zeros(4, device=device, dtype=torch.bfloat16) for _ in range(2)] if bad.get("lp") else []
    t = ops.StepTensors(
        params,
        flat_layout([4, 4], device, fill=1.0).views,
        torch.ones(2, device=device),
        torch.tensor(1e-3, dtype=torch.float64, device=device),
        torch.ones((), device=device),
        lp_params=lp,
        remainders=remainders,
    )
    with pytest.raises((ValueError, RuntimeError), match=message):
        backends.get(backend).step(
            ops.lion_step,
            t,
            ops.lion_step.states([torch.zeros(4, device=device)] * 2),
            ops.lion_step.hyper(0.9, 0.99, 0.0, False),
        )
