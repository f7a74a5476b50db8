"""fp32 masters follow the weight, element by element: every backend against the reference.

"Values decide, not version counters" (reference.follow_weight, the module docstring's "Masters
follow the weight"): when a step op has ``lp_params``, each element's master is first taken as
``float(lp)`` where the lp element's bits differ from the bits of the master rounded to lp's
dtype, else the master as it is, and the update runs from that value. A weight written from
outside the optimizer (``p.data[mask] = 0``, a broadcast, an EMA swap) restarts its master
there; a write that changes no value keeps the master's full precision.

The cases: a weight edited at a random subset of elements, one rewritten with the values it
had, -0.0 written where the master rounds to +0.0, NaN and +-inf written, NaN masters whose
rounding is the stored NaN (kept, payload and all); sizes 1, primes and around the kernels'
blocks, more than 110 tensors in one call, bf16 and fp16 weights, and params and lp_params
that are strided or offset views. Which backends run depends on the process, as in
tests/test_kernels.py (``TRITON_INTERPRET=1`` for triton on the CPU, ``-m gpu`` for CUDA).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import CPU_KERNEL_BACKENDS, GPU_KERNEL_BACKENDS, device_cases, flat_layout
from test_kernels import ALGOS, _n_states  # (the step-op cases every kernel test steps: tests/cases.py)

import cases  # tests/cases.py
from fused_accum import backends, ops
from fused_accum.backends import reference

CASES = device_cases(CPU_KERNEL_BACKENDS, GPU_KERNEL_BACKENDS)  # the kernel backends
WITH_REFERENCE = [pytest.param("reference", "cpu", id="reference-cpu")] + CASES

SIZES = [1, 2, 3, 31, 257, 1023, 1025, 4097]
MANY = 130  # tensors in one call: past where a kernel-argument table typically fills (~110)
LOW = [torch.bfloat16, torch.float16]
STEP_TOL = dict(rtol=1e-5, atol=1e-6, equal_nan=True)  # tests/test_kernels.py's, NaN-aware

NAN_PAYLOAD = 0x7FC01234  # a quiet NaN master with a payload the bf16/fp16 rounding drops


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a tensor (2 or 4 bytes per element) as int64, flattened."""
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    mask = (1 << (8 * x.element_size())) - 1
    return x.reshape(-1).contiguous().view(ints).to(torch.int64) & mask


def _from_bits(u: torch.Tensor) -> torch.Tensor:
    return (u - (u >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)


def _view(n: int, dtype, i: int, device, kind: int) -> torch.Tensor:
    """An n-element 1-D tensor: contiguous (kind 0), every other element of a buffer (1), or at
    an odd storage offset (2)."""
    if kind == 1:
        return torch.zeros(2 * n, dtype=dtype, device=device)[::2]
    if kind == 2:
        return torch.zeros(n + 3, dtype=dtype, device=device)[3:]
    return torch.zeros(n, dtype=dtype, device=device)


class Inputs:
    """Masters, their low-precision weights written from outside at some elements, state,
    accumulators and step counts of one step call. ``views``: params and lp_params as strided
    and offset views (every third tensor each, at different tensors)."""

    def __init__(self, algo, sizes, device, gen, views=True, same_tensor=0):
        self.sizes = sizes
        n_total = sum(sizes)
        masters = torch.randn(n_total, generator=gen)
        kind = torch.randint(0, 32, (n_total,), generator=gen)
        masters = torch.where(kind == 0, 0.0, masters)  # +0.0 masters: -0.0 is written over some
        masters = torch.where(kind == 1, _from_bits(torch.full((n_total,), NAN_PAYLOAD)), masters)
        masters = torch.where(kind == 2, float("inf"), masters)
        masters = torch.where(kind == 3, masters * 1e-3, masters)  # small: fp16 keeps fewer digits
        self.params, self.lp = [], []
        start = 0
        for i, n in enumerate(sizes):
            m = masters[start : start + n]
            k = kind[start : start + n]
            dtype = LOW[i % 2]
            p = _view(n, torch.float32, i, device, i % 3 if views else 0)
            p.copy_(m)
            low = _view(n, dtype, i, device, (i + 1) % 3 if views else 0)
            low.copy_(reference.rounded(m, dtype))  # the masters' rounding, as a step wrote it ...
            if i != same_tensor:  # (one tensor keeps it: rewritten with the values it had)
                edited = torch.rand(n, generator=gen) < 0.2  # ... written from outside:
                new = torch.randn(n, generator=gen)
                new = torch.where(k == 0, -0.0, new)  # -0.0 over a master that rounds to +0.0
                new = torch.where(k == 4, float("nan"), new)
                new = torch.where(k == 5, float("-inf"), new)
                new = torch.where(k == 6, float("inf"), new)
                edit = edited | (k == 0) | ((k >= 4) & (k <= 6))
                low.copy_(torch.where(edit, new.to(dtype), low.cpu()).to(device))
            self.params.append(p)
            self.lp.append(low)
            start += n
        self.states = [[torch.randn(n, generator=gen).abs().to(device) for n in sizes] for _ in range(_n_states(algo))]
        self.accs = flat_layout(sizes, device, fill=0.0).views
        for a in self.accs:
            a.copy_(torch.randn(a.numel(), generator=gen))
        self.grads = [torch.randn(n, generator=gen).to(device, torch.bfloat16) for n in sizes]
        self.steps = torch.tensor([1.0 + (i % 3) * 4 for i in range(len(sizes))], device=device)

    def clone(self) -> Inputs:
        other = object.__new__(Inputs)
        other.sizes, other.steps, other.grads = self.sizes, self.steps, self.grads
        other.params = [_clone_view(p) for p in self.params]
        other.lp = [_clone_view(x) for x in self.lp]
        other.states = [[x.clone() for x in s] for s in self.states]
        other.accs = [a.clone() for a in self.accs]
        return other


def _clone_view(x: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides and storage offset (so a view stays a view)."""
    if x.is_contiguous() and x.storage_offset() == 0:
        return x.clone()
    base = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype, device=x.device)
    out = base.as_strided(x.shape, x.stride(), x.storage_offset())
    out.copy_(x)
    return out


def call(module, algo, x: Inputs, lr, coef, *, lp=True, fused=None, found_inf=None, hyper=None):
    """module's step op of kernel case ``algo`` on ``x`` (its lp_params unless ``lp`` is False),
    with the case's hyper-parameters or ``hyper`` (the op's record's fields, by name)."""
    op = cases.op_records(ALGOS[algo])[0]
    t = ops.StepTensors(
        x.params,
        x.accs,
        x.steps,
        lr,
        coef,
        lp_params=x.lp if lp else [],
        grads=list(x.grads) if fused else [],
        found_inf=found_inf,
        grad_alpha=0.5,
        grads_overwrite=fused == "overwrite",
    )
    cases.op_call(module, ALGOS[algo], t, x.states, op.hyper(**hyper) if hyper else None)


def _rounded_bits(master: torch.Tensor, dtype) -> torch.Tensor:
    """The bits of the fp32 ``master`` rounded to bf16/fp16 as the steps write lp: to nearest
    even, a NaN as 0x7FC0 in bf16 and as its sign and 0x7E00 in fp16 (torch's .to(bfloat16)
    makes 0xFFFF or 0x7FC0 of a NaN, by layout: not a rule)."""
    master = master.reshape(-1)
    nan = torch.isnan(master)
    if dtype == torch.bfloat16:
        u = _bits(master)
        return torch.where(nan, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    sign = (_bits(master) >> 16) & 0x8000
    return torch.where(nan, sign | 0x7E00, _bits(master.to(dtype)))


def followed(master: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """The rule, restated on bits: float(lp) where lp's bits are not the bits of the master
    rounded to lp's dtype, else the master."""
    differ = _rounded_bits(master, lp.dtype) != _bits(lp)
    return torch.where(differ, _widened(lp), master.reshape(-1))


def _widened(lp: torch.Tensor) -> torch.Tensor:
    """float(lp), the bits moved into place (a NaN's payload kept: torch's fp16 .float() makes
    0x7FFFFFFF or 0x7FC00000 of 0x7E00, by layout)."""
    h = _bits(lp)
    if lp.dtype == torch.bfloat16:
        return _from_bits(h << 16)
    nan = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    return torch.where(torch.isnan(lp.reshape(-1)), _from_bits(nan), lp.reshape(-1).float())


def _same_bits(got: torch.Tensor, want: torch.Tensor, nan_as_nan: bool) -> bool:
    """Bit for bit; with nan_as_nan any NaN equals any NaN (CUDA's arithmetic and conversions
    make their own NaN patterns)."""
    g, w = _bits(got.cpu()), _bits(want.cpu())
    same = g == w
    if nan_as_nan:
        same |= torch.isnan(got.cpu().reshape(-1).float()) & torch.isnan(want.cpu().reshape(-1).float())
    return bool(same.all())


def _check_lp_written(x: Inputs) -> None:
    """Each lp element is its new master rounded (a NaN as any NaN: CUDA writes 0x7FFF)."""
    for p, low in zip(x.params, x.lp):
        assert _same_bits(low, p.to(low.dtype), nan_as_nan=True)


# --- the reference: the rule, then the step as it was ------------------------------------------


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("fused", [None, "add", "overwrite"])
def test_reference_follows_where_bits_differ_then_steps_as_before(algo, fused):
    """The reference with lp_params is exactly "master = where(bits differ, float(lp), master);
    then the step without lp_params": params and states bit for bit (NaN payloads included),
    and lp_params the new masters rounded. Also what the rule is on the special elements: -0.0
    over +0.0 and written NaNs and infs are taken, NaN masters under their rounding kept with
    their payload, and the tensor rewritten with its own values keeps every master."""
    gen = torch.Generator().manual_seed(_seed("ref", algo, fused))
    x = Inputs(algo, SIZES, "cpu", gen, same_tensor=7)
    before = x.clone()
    want = x.clone()
    lr, coef = torch.tensor(0.01, dtype=torch.float64), torch.tensor(0.25)
    for p, low in zip(want.params, want.lp):
        p.copy_(followed(p, low).view_as(p))
    call(reference, algo, x, lr, coef, fused=fused)
    call(reference, algo, want, lr, coef, lp=False, fused=fused)
    for got, exp in zip(x.params + sum(x.states, []), want.params + sum(want.states, [])):
        assert _same_bits(got, exp, nan_as_nan=False)
    _check_lp_written(x)

    masters = torch.cat([p.reshape(-1) for p in before.params])
    weights = torch.cat([low.reshape(-1).float() for low in before.lp])
    rule = torch.cat([reference.follow_weight(p.reshape(-1), low) for p, low in zip(before.params, before.lp)])
    assert torch.equal(_bits(rule), _bits(torch.cat([followed(p, low) for p, low in zip(before.params, before.lp)])))
    negative_zero = (_bits(weights) == 0x80000000) & (_bits(masters) == 0)
    assert negative_zero.any() and (_bits(rule)[negative_zero] == 0x80000000).all(), "-0.0 over +0.0 not taken"
    written_nan = torch.isnan(weights) & ~torch.isnan(masters)
    assert written_nan.any() and torch.isnan(rule[written_nan]).all()
    written_inf = torch.isinf(weights) & ~torch.isinf(masters)
    assert written_inf.any() and torch.equal(rule[written_inf], weights[written_inf])
    kept_nan = (_bits(masters) == NAN_PAYLOAD) & torch.isnan(weights)
    assert kept_nan.any() and (_bits(rule)[kept_nan] == NAN_PAYLOAD).all(), "a NaN master under its NaN not kept"
    same = before.params[7].reshape(-1)  # (4,097 elements)
    assert torch.equal(_bits(followed(same, before.lp[7])), _bits(same)), "an unchanged weight restarted its master"
    precise = same.to(before.lp[7].dtype).float() != same  # masters finer than their weight ...
    assert precise.sum() > 100  # ... kept as they were: the write changed no value


# --- every kernel backend: the rule bit for bit, then every update against the reference --------


def _identity_step(module, x: Inputs, device, fused=None, found_inf=None) -> None:
    """A Lion step that changes no master (lr 0, no decay, zero gradient and momentum): each new
    master is the followed one itself, bit for bit (-0.0 and NaN payloads included)."""
    for a in x.accs:
        a.zero_()
    x.grads = [torch.zeros_like(g) for g in x.grads]
    x.states = [[torch.zeros_like(m) for m in x.states[0]]]
    lr = torch.zeros((), dtype=torch.float64, device=device)
    hyper = dict(beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False)
    call(module, "lion", x, lr, torch.ones((), device=device), fused=fused, found_inf=found_inf, hyper=hyper)


@pytest.mark.parametrize("backend,device", WITH_REFERENCE)
@pytest.mark.parametrize("fused", [None, "add", "overwrite"])
@pytest.mark.parametrize("sizes", ["awkward", "many"])
def test_masters_follow_edited_weights_bit_for_bit(backend, device, fused, sizes):
    """A step that changes no master, on weights edited from outside (Inputs): every new master
    is followed(master, lp) bit for bit (on CUDA a NaN as any NaN: its multiply makes its own
    NaN), every lp the new master rounded, and the tensor rewritten with its own values keeps
    its masters' bits. Sizes 1, primes and around the blocks, or 130 tensors in one call;
    params and lp_params strided and offset views."""
    gen = torch.Generator().manual_seed(_seed("identity", fused, sizes))
    if sizes == "many":
        sizes = torch.randint(1, 300, (MANY,), generator=gen).tolist()
    else:
        sizes = SIZES
    x = Inputs("lion", sizes, device, gen, same_tensor=3)
    before = x.clone()
    _identity_step(backends.get(backend), x, device, fused)
    for p, b, low in zip(x.params, before.params, before.lp):
        assert _same_bits(p, followed(b.cpu(), low.cpu()), nan_as_nan=device == "cuda")
    _check_lp_written(x)
    assert _same_bits(x.params[3], before.params[3], nan_as_nan=device == "cuda")


@pytest.mark.parametrize("backend,device", CASES)
def test_a_skipped_step_writes_nothing_then_the_next_follows(backend, device):
    """found_inf set: no master and no weight written, edits or not (the master stays, the
    weight keeps what was written over it); the next step follows the weight."""
    gen = torch.Generator().manual_seed(_seed("skip"))
    x = Inputs("lion", SIZES, device, gen)
    before = x.clone()
    module = backends.get(backend)
    _identity_step(module, x, device, found_inf=torch.ones((), device=device))
    for got, want in zip(x.params + x.lp, before.params + before.lp):
        assert _same_bits(got, want, nan_as_nan=False)
    _identity_step(module, x, device, found_inf=torch.zeros((), device=device))
    for p, b, low in zip(x.params, before.params, before.lp):
        assert _same_bits(p, followed(b.cpu(), low.cpu()), nan_as_nan=device == "cuda")


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("fused", [None, "add", "overwrite"])
def test_step_on_edited_weights_matches_reference(backend, device, algo, fused):
    """Every algorithm on weights edited from outside, against the reference: params and states
    to tests/test_kernels.py's tolerance, NaN and inf exactly where the reference has them (the
    -0.0, NaN and inf written, the NaN and inf masters); lp the new masters rounded."""
    gen = torch.Generator().manual_seed(_seed("algo", algo, fused))
    x = Inputs(algo, SIZES, device, gen)
    want = x.clone()
    lr = torch.tensor(0.01, dtype=torch.float64, device=device)
    coef = torch.tensor(0.25, device=device)
    call(backends.get(backend), algo, x, lr, coef, fused=fused)
    call(reference, algo, want, lr, coef, fused=fused)
    for got, exp in zip(x.params + sum(x.states, []), want.params + sum(want.states, [])):
        torch.testing.assert_close(got, exp, **STEP_TOL)
    _check_lp_written(x)
