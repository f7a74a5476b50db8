"""Out-of-place steps (issue 37): with ``StepTensors.sources`` a step reads the old values of
everything it writes from the sources and writes the new ones into its written lists, so that
offload's double-buffered host state steps from its live buffers into their twins (a commit is a
swap).

For every algorithm and parameter format, fused micro-batch or not, skipped or not, on the
reference (the contract) and the C++ CPU backend: an out-of-place step writes the bits the
in-place step gives (a skipped one: the sources' bits), whatever the written tensors held
before, and leaves the sources as they were. The C++ loops write an out-of-place step's operands
with streaming stores, whole lines from each operand's first line-aligned chunk on, or with
ordinary stores under a size (csrc/cpu/kernels.cpp, run_block): both forms are run at every
size here (the size set through the test hook ``fused_accum_cpu_stream_min_bytes``), and
streamed into views at every alignment, the bytes around them untouched. The kernel backends
that do not step on the host refuse sources.
"""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch

import cases  # tests/cases.py: every algorithm and its step-op cases
from fused_accum import ops
from helpers import CPU_KERNEL_BACKENDS  # tests/helpers.py

HOST = ["reference"] + [b for b in CPU_KERNEL_BACKENDS if b == "cpu"]
# ("cpu", streamed): the C++ loops streaming at any size, or never
HOST_STORES = ["reference"] + [pytest.param(("cpu", s), id=f"cpu-{s}") for s in ("streamed", "direct") if "cpu" in HOST]
SIZES = [1, 7, 1000, 20_000]  # 20,000: past one 16K-element block of the C++ loop

# every algorithm's step-op cases (tests/cases.py), and of each update rule the case that writes
# the most lists (the most operands streamed)
ALGOS = cases.kernel_cases(cases.STEP_SOURCES)
WIDEST = cases.per_update_rule(cases.STEP_SOURCES)
# fp32 params; fp32 masters with bf16, fp16 or fp32 copies; bf16 params stepped in place; bf16
# params with int16 remainders (exact 2-byte masters)
FORMATS = ["fp32", "master_bf16", "master_f16", "master_f32", "bf16", "remainder"]
COPY_DTYPES = {"master_bf16": torch.bfloat16, "master_f16": torch.float16, "master_f32": torch.float32}


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _records(algo, fmt, fused, skip, gen):
    op, hyper, keys = cases.op_records(ALGOS[algo])
    n = len(SIZES)
    randn = lambda size: torch.randn(size, generator=gen)  # noqa: E731
    accs = [randn(s) for s in SIZES]
    if fmt in ("bf16", "remainder"):
        params = [randn(s).bfloat16() for s in SIZES]
    else:
        params = [randn(s) for s in SIZES]
    lp = [p.to(COPY_DTYPES[fmt], copy=True) for p in params] if fmt in COPY_DTYPES else []
    if lp:  # some weights written from outside: the master follows them, widened from the
        # copy's dtype (non-zero values: a 0 reads the same as fp16 and as bf16)
        lp[2][:10] = torch.randn(10, generator=gen)
    rem = (
        [torch.randint(-(2**15), 2**15, (s,), generator=gen, dtype=torch.int16) for s in SIZES]
        if fmt == "remainder"
        else []
    )
    # the state lists the case keeps (positive: valid for any state, a second moment's too)
    s = op.states(*([randn(n).abs() for n in SIZES] if key in keys else [] for key in op.state_keys))
    t = ops.StepTensors(
        params,
        accs,
        torch.tensor([1.0, 2.0, 3.0, 4.0][:n]),
        torch.tensor(1e-3, dtype=torch.float64),
        torch.tensor(0.5),
        lp_params=lp,
        remainders=rem,
        grads=[randn(sz).bfloat16() for sz in SIZES] if fused else [],
        found_inf=torch.tensor(1.0 if skip else 0.0),
    )
    return op, t, s, hyper


def _written(op, t, s, hyper):
    """The lists the step writes, in the sources' order (ops.StepTensors.sources)."""
    return [t.params, *(x for x in (t.lp_params, t.remainders) if x), *(x for x in s if len(x))]


def _clone(records):
    op, t, s, h = records
    c = lambda xs: [x.clone() for x in xs]  # noqa: E731
    t2 = t._replace(params=c(t.params), lp_params=c(t.lp_params), remainders=c(t.remainders))
    return op, t2, op.states(*map(c, s)), h


def _bits(x):
    return x.reshape(-1).view(torch.int16 if x.element_size() == 2 else torch.int32)


def _stream_min_bytes(bytes_: int) -> int:
    """Sets the C++ loops' size under which out-of-place steps store directly (-1: only read);
    returns the old one."""
    from fused_accum.backends import ext

    fn = ctypes.CDLL(ext._C.__file__).fused_accum_cpu_stream_min_bytes
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return fn(bytes_)


@pytest.fixture
def stores(request):
    """The backend of a HOST_STORES case, the C++ loops' stores set for it (and put back)."""
    if request.param == "reference":
        yield "reference"
        return
    backend, how = request.param
    old = _stream_min_bytes(0 if how == "streamed" else 2**62)
    try:
        yield backend
    finally:
        _stream_min_bytes(old)


@pytest.mark.parametrize("stores", HOST_STORES, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("algo", list(ALGOS))
def test_out_of_place_is_the_in_place_step(stores, algo, fmt):
    backend = stores
    for fused, skip in [(False, False), (True, False), (False, True), (True, True)]:
        gen = torch.Generator().manual_seed(_seed(algo, fmt, fused, skip))
        records = _records(algo, fmt, fused, skip, gen)
        op, t, s, h = records
        plain = _clone(records)
        old = [[x.clone() for x in lst] for lst in _written(op, t, s, h)]
        # the sources: the old values, some of another shape (same numel), some one element past
        # an allocation's start (unaligned); the written tensors poisoned (every element must
        # be written, from the sources)
        sources = [
            x.clone().reshape(x.numel(), 1) if j % 2 else torch.cat([x.reshape(-1)[:1], x.reshape(-1)])[1:]
            for j, x in enumerate(x for lst in old for x in lst)
        ]
        kept = [x.clone() for x in sources]
        for lst in _written(op, t, s, h):
            for x in lst:
                x.copy_(torch.full_like(x, -7))
        op(t._replace(sources=sources), s, h, backend)
        plain[0](plain[1], plain[2], plain[3], backend)
        for got, want in zip(_written(op, t, s, h), _written(*plain)):
            for g, w in zip(got, want):
                assert torch.equal(_bits(g), _bits(w)), (fused, skip)
        for src, k in zip(sources, kept):  # untouched
            assert torch.equal(_bits(src), _bits(k)), (fused, skip)
        if skip:  # nothing stepped: written == sources
            for lst, o in zip(_written(op, t, s, h), old):
                assert all(torch.equal(_bits(g), _bits(x)) for g, x in zip(lst, o))


@pytest.mark.skipif("cpu" not in HOST, reason="the C++ extension is not built")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("algo", list(WIDEST))
def test_streamed_into_views_at_any_alignment(algo, fmt):
    """Written tensors that are views at element offsets 0..33 into larger allocations, each
    list at its own offset (so lists whose lines start at different elements: those blocks store
    directly), two tensors per list: bits as in place, the allocations' other bytes untouched."""
    old = _stream_min_bytes(0)
    try:
        for case, offsets in enumerate([(0, 0, 0, 0), (1, 1, 1, 1), (16, 16, 16, 16), (17, 1, 17, 33), (5, 3, 0, 16)]):
            gen = torch.Generator().manual_seed(_seed(algo, fmt, case))
            records = _records(algo, fmt, False, False, gen)
            op, t, s, h = records
            plain = _clone(records)
            written = _written(op, t, s, h)
            sources = [x.clone() for lst in written for x in lst]
            views, allocations = [], []
            for lst, off in zip(written, offsets * 2):
                vs = []
                for x in lst:
                    a = torch.full((x.numel() + 2 * 64,), -3, dtype=x.dtype)
                    allocations.append((a, off, x.numel()))
                    vs.append(a[64 + off - 32 : 64 + off - 32 + x.numel()].view(x.shape))
                views.append(vs)
            names = ["params", "lp_params", "remainders"]
            fields = {n: views[i] for i, n in enumerate(x for x in names if getattr(t, x))}
            k = len(fields)
            stepped_t = t._replace(sources=sources, **fields)
            state_views = iter(views[k:])  # (the written states: the non-empty lists, in order)
            stepped_s = op.states(*(next(state_views) if len(x) else x for x in s))
            op(stepped_t, stepped_s, h, "cpu")
            plain[0](plain[1], plain[2], plain[3], "cpu")
            for got, want in zip(_written(op, stepped_t, stepped_s, h), _written(*plain)):
                for g, w in zip(got, want):
                    assert torch.equal(_bits(g), _bits(w)), (offsets, g.numel())
            for a, off, n in allocations:
                lo, hi = 64 + off - 32, 64 + off - 32 + n
                outside = torch.cat([a[:lo], a[hi:]])
                assert torch.equal(_bits(outside), _bits(torch.full_like(outside, -3))), offsets
    finally:
        _stream_min_bytes(old)


@pytest.mark.parametrize("backend", HOST)
def test_sources_are_checked(backend):
    gen = torch.Generator().manual_seed(1)
    op, t, s, h = _records("adamw", "master_bf16", False, False, gen)
    n = len(t.params)  # params, lp_params, exp_avgs, exp_avg_sqs: 4 lists
    good = [torch.empty_like(x) for lst in _written(op, t, s, h) for x in lst]
    with pytest.raises(
        (ValueError, RuntimeError), match=f"sources has {3 * n} tensors, expected 0 \\(none\\) or {4 * n}"
    ):
        op(t._replace(sources=good[: 3 * n]), s, h, backend)
    wrong = list(good)
    wrong[n + 1] = torch.empty(SIZES[1], dtype=torch.float32)  # lp_params[1] is bf16
    with pytest.raises((ValueError, RuntimeError), match=rf"sources\[{n + 1}\] must be .*(bfloat16|BFloat16)"):
        op(t._replace(sources=wrong), s, h, backend)


def test_device_backends_refuse_sources():
    """triton (under the interpreter here) refuses them; cuda's refusal is in its binding
    (csrc/bindings_cuda.cpp), checked by -m gpu runs of this file on a GPU machine."""
    import os

    if "triton" not in CPU_KERNEL_BACKENDS or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton runs on CPU tensors under TRITON_INTERPRET=1 only")
    gen = torch.Generator().manual_seed(2)
    op, t, s, h = _records("adamw", "fp32", False, False, gen)
    sources = [torch.empty_like(x) for lst in _written(op, t, s, h) for x in lst]
    with pytest.raises(ValueError, match="sources are for host"):
        op(t._replace(sources=sources), s, h, "triton")


@pytest.mark.gpu
def test_cuda_refuses_sources():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from helpers import GPU_KERNEL_BACKENDS

    if "cuda" not in GPU_KERNEL_BACKENDS:
        pytest.skip("the cuda backend is not built")
    x = torch.randn(8, device="cuda")
    t = ops.StepTensors(
        [x.clone()], [x.clone()], torch.ones(1, device="cuda"), torch.tensor(1e-3, dtype=torch.float64, device="cuda"),
        torch.ones((), device="cuda"), sources=[torch.empty_like(x)] * 3,
    )  # fmt: skip
    s = ops.adam_step.states([x.clone()], [x.abs()])
    with pytest.raises(RuntimeError, match="sources are for host"):
        ops.adam_step(t, s, cases.op_records(ALGOS["adamw"])[1], "cuda")
