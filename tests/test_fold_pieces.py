"""fold_pieces (issue 38): several same-sized pieces summed into one fp32 accumulator, in order.

The reference is checked against its definition, fp32 adds in list order computed here one by
one (never zeros: fresh random data, -0.0, inf and NaN planted); every kernel backend of the
process (the C++ CPU extension; triton under ``TRITON_INTERPRET=1``; cuda and triton with
``-m gpu``) against the reference, bit for bit: the order of the adds per element is fixed, so
nothing may differ but which NaN a NaN is (its payload: the contract leaves it open).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from fused_accum import backends, ops
from fused_accum.backends import reference
from helpers import CPU_KERNEL_BACKENDS, GPU_KERNEL_BACKENDS, device_cases  # tests/helpers.py

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CASES = device_cases(CPU_KERNEL_BACKENDS, GPU_KERNEL_BACKENDS)
ALL = [pytest.param("reference", "cpu", id="reference-cpu")] + CASES
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# the interpreter runs a kernel element by element in numpy: small sizes there
SIZES = [1, 7, 1000, 4097] if INTERPRETED else [1, 7, 1000, 4097, 65_537, 300_007]


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit equality, except that a NaN may be any NaN (its payload is not in the contract)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN where the reference has none, or the reverse"
    differ = (_bits(got) != _bits(want)) & ~nan
    assert not differ.any(), (
        f"{int(differ.sum())} of {got.numel()} elements differ, first at {int(differ.nonzero()[0])}: "
        f"{got[differ][:4].tolist()} against {want[differ][:4].tolist()}"
    )


def _pieces(n_pieces, n, dtype, device, gen, special=True, rows=True):
    """``n_pieces`` pieces of n elements, of magnitudes that make the order of the adds matter;
    with ``special`` some -0.0, +-inf and NaN planted. ``rows``: the rows of one [N, n] buffer
    (what the all-to-all's receive buffer gives), else separate tensors."""
    data = torch.randn(n_pieces, n, generator=gen) * torch.logspace(-3, 3, n_pieces).unsqueeze(1)
    if special and n >= 7:
        data[0, 0] = -0.0
        if n_pieces > 1:
            data[1, 0] = -0.0
            data[1, 1] = float("inf")
            data[n_pieces - 1, 2] = float("-inf")
        data[0, 3] = float("nan")
        data[n_pieces - 1, 4] = float("inf")
    data = data.to(device=device, dtype=dtype)
    return list(data.unbind(0)) if rows else [row.clone() for row in data]


def _definition(acc, pieces, overwrite):
    """fp32 adds in list order, each its own tensor op (the contract, spelled out)."""
    widened = [reference.widened(p) for p in pieces]
    total = widened[0].clone() if overwrite else acc.clone() + widened[0]
    for w in widened[1:]:
        total = total + w
    return total


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_its_definition(dtype, overwrite):
    gen = torch.Generator().manual_seed(_seed("ref", dtype, overwrite))
    for n_pieces in range(1, 6):
        acc = torch.randn(1000, generator=gen)
        acc[0] = -0.0
        pieces = _pieces(n_pieces, 1000, dtype, "cpu", gen)
        want = _definition(acc, pieces, overwrite)
        reference.fold_pieces(acc, pieces, overwrite)
        assert_same_bits(acc, want)


def test_overwrite_starts_from_the_first_piece():
    """-0.0 in the first piece stays -0.0 (0.0 + -0.0 would be +0.0); without overwrite acc is
    added to."""
    for backend, device in [("reference", "cpu")] + [(p.values[0], p.values[1]) for p in CASES]:
        if device == "cuda" and not torch.cuda.is_available():
            continue
        acc = torch.full((3,), 5.0, device=device)
        ops.fold_pieces(acc, [torch.tensor([-0.0, 1.0, 2.0], device=device)], True, backend)
        assert _bits(acc)[0] == _bits(torch.tensor([-0.0]))[0] and acc[1:].tolist() == [1.0, 2.0], backend
        ops.fold_pieces(acc, [torch.tensor([-0.0, 1.0, 2.0], device=device)] * 2, False, backend)
        assert _bits(acc)[0] == _bits(torch.tensor([-0.0]))[0] and acc[1:].tolist() == [3.0, 6.0], backend


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_match_the_reference_bit_for_bit(backend, device, dtype, overwrite):
    for n in SIZES:
        for n_pieces in range(1, 6):
            for rows in (True, False) if n_pieces > 1 else (True,):
                gen = torch.Generator().manual_seed(_seed(backend, dtype, overwrite, n, n_pieces, rows))
                acc = torch.randn(n, generator=gen) * 10
                if n >= 7:
                    acc[5] = float("nan")
                    acc[6] = -0.0
                pieces = _pieces(n_pieces, n, dtype, "cpu", gen, rows=rows)
                want = acc.clone()
                reference.fold_pieces(want, pieces, overwrite)
                got = acc.to(device)
                ops.fold_pieces(got, [p.to(device) for p in pieces] if device != "cpu" else pieces, overwrite, backend)
                assert_same_bits(got.cpu(), want)


@pytest.mark.parametrize("backend,device", ALL)
def test_strided_and_shaped_pieces(backend, device):
    """A piece may have any shape and strides (acc's numel): read in its element order."""
    gen = torch.Generator().manual_seed(_seed("strided", backend))
    acc = torch.randn(60, generator=gen, device="cpu").to(device)
    wide = torch.randn(12, 10, generator=gen).to(device)
    pieces = [wide[:, ::2], torch.randn(6, 10, generator=gen).to(device).t(), torch.randn(60, generator=gen).to(device)]
    want = _definition(acc, pieces, False)
    ops.fold_pieces(acc, pieces, False, backend)
    assert_same_bits(acc.cpu(), want.cpu())


@pytest.mark.parametrize("backend,device", ALL)
def test_refusals(backend, device):
    acc = torch.zeros(4, device=device)
    f32 = lambda n=4: torch.ones(n, device=device)  # noqa: E731
    bad = [
        (acc.double(), [f32()], "acc must be a 1-D contiguous float32"),
        (torch.zeros(8, device=device)[::2], [f32()], "acc must be a 1-D contiguous float32"),
        (acc, [], "pieces is empty"),
        (acc, [f32(), f32(5)], r"pieces\[1\] has 5 elements but acc has 4"),
        (acc, [f32(), f32().half()], r"pieces\[1\] is .*(16|Half) but pieces\[0\] is"),
        (acc, [f32().double()], r"pieces\[0\] must be bfloat16, float16 or float32"),
    ]
    for a, pieces, message in bad:
        with pytest.raises((ValueError, RuntimeError), match=message):
            ops.fold_pieces(a, pieces, False, backend)


def test_every_backend_module_has_it():
    """Every backend the package resolves here has fold_pieces (ops.fold_pieces calls it)."""
    for name in backends.NAMES:
        if backends.availability(name, "cpu") == "" or (name == "triton" and backends._load(name)[0] is not None):
            assert callable(backends.get(name).fold_pieces), name


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    acc = torch.randn(9, generator=gen)
    pieces = list(torch.randn(3, 9, generator=gen).bfloat16().unbind(0))
    torch.library.opcheck(ops.fold_pieces_, (acc, pieces, False, "reference"))


@pytest.mark.skipif("cpu" not in CPU_KERNEL_BACKENDS, reason="the C++ extension is not built")
def test_the_cpu_backend_runs_the_cpp_kernel():
    """Not the reference fallback (which a _C built before fold_pieces_ gets)."""
    from fused_accum.backends import ext

    assert ext._has_fold_kernel("CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fused_accum_ext::fold_pieces_", "CPU")
    gen = torch.Generator().manual_seed(4)
    acc, pieces = torch.randn(33, generator=gen), list(torch.randn(3, 33, generator=gen).half().unbind(0))
    torch.library.opcheck(torch.ops.fused_accum_ext.fold_pieces_.default, (acc, pieces, True))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_KERNEL_BACKENDS)
def test_one_launch_on_the_gpu(backend):
    """The rows of one [N, n] receive buffer: exactly one kernel runs (the profiler's count)."""
    gen = torch.Generator().manual_seed(5)
    acc = torch.randn(1_000_003, generator=gen).cuda()
    pieces = list(torch.randn(4, 1_000_003, generator=gen).bfloat16().cuda().unbind(0))
    ops.fold_pieces(acc, pieces, False, backend)  # compiled and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.fold_pieces(acc, pieces, True, backend)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.skipif("triton" not in CPU_KERNEL_BACKENDS, reason="triton runs on CPU tensors under TRITON_INTERPRET=1")
def test_triton_launches_once(monkeypatch):
    """One launch per call: the rows of one [N, n] buffer are found from the first row's address
    and the spacing (no table); separate pieces through an address table, still one launch."""
    from fused_accum.backends.triton import fold

    launches = []
    kernel = fold.fold_pieces_kernel

    class Counting:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["FROM_TABLE"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(fold, "fold_pieces_kernel", Counting())
    gen = torch.Generator().manual_seed(6)
    acc = torch.randn(3000, generator=gen)
    rows = list(torch.randn(5, 3000, generator=gen).bfloat16().unbind(0))
    want = acc.clone()
    reference.fold_pieces(want, rows, False)
    ops.fold_pieces(acc, rows, False, "triton")
    assert launches == [False]
    assert_same_bits(acc, want)
    shuffled = [rows[2], rows[0], rows[4], rows[1], rows[3]]  # not equally spaced
    want = acc.clone()
    reference.fold_pieces(want, shuffled, True)
    ops.fold_pieces(acc, shuffled, True, "triton")
    assert launches == [False, True]
    assert_same_bits(acc, want)
    assert fold.row_stride(rows) == 3000 and fold.row_stride(shuffled) is None
