"""Triton-backend checks beyond the kernel-vs-reference matrix of test_kernels.py.

- the chunk table and the table rows (host code, any process);
- the compiled kernels for sm_90: vector accesses on aligned rows in one register layout, a
  scalar fallback, IEEE sqrt/division and a register budget in Adam. These compile through
  Triton's own ptxas and need no GPU, but need the real (not interpreted) kernels: they run in
  a plain pytest process;
- the kernels on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported; run
  this file in that process too): 2,000+ tensors in at most 2 launches, the table cache,
  non-contiguous parameters written back, torch.compile tracing the op without a graph break;
- ``-m gpu``: the same on CUDA tensors, and a tensor of more than 2**31 elements (int64 offsets).
"""

from __future__ import annotations

import os
import re

import numpy as np

import pytest
import torch

from fused_accum import backends, ops
from fused_accum.backends import reference

tb = pytest.importorskip("fused_accum.backends.triton", reason="triton is not installed")
import triton  # noqa: E402  (importable: the backend above imported it)
import triton.language as tl  # noqa: E402

kernels, updates = tb.kernels, tb.updates

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ([pytest.param("cpu", id="cpu")] if INTERPRETED else []) + (
    # the interpreter refuses CUDA tensors (the tables hold device addresses it cannot read)
    [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() and not INTERPRETED else []
)
needs_device = pytest.mark.skipif(
    not DEVICES, reason="Triton kernels run on CUDA, or on CPU only under TRITON_INTERPRET=1"
)
PAD = 64


def _flat_views(sizes, device):
    """(flat buffer, int64 CPU offsets, 1-D views): slices padded to 64, -7 in the padding."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + PAD - 1) // PAD * PAD
    flat = torch.full((total,), -7.0, device=device)
    return flat, torch.tensor(offsets, dtype=torch.int64), [flat[o : o + n] for o, n in zip(offsets, sizes)]


class _CountLaunches:
    """Stands in for a kernel in the kernels module and counts ``kernel[grid]`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


# --- tables, chunking, specialisation (host only) --------------------------------------------


def test_chunk_table_covers_every_element_once_with_int64_starts():
    c = 4 * tb.BLOCK
    numels = [0, 1, c, c + 1, 3 * c - 1, 0, 5_000_000_000]
    table = tb.chunk_table(numels, c)
    assert table.dtype == np.int64
    for row, n in enumerate(numels):
        starts = table[table[:, 0] == row, 1].tolist()
        assert starts == list(range(0, n, c)), f"tensor {row} of {n} elements"
    # rows appear in order, so a tensor's chunks are adjacent programs
    assert (np.diff(table[:, 0]) >= 0).all()
    assert table[-1, 1] == (5_000_000_000 - 1) // c * c  # past 2**32: int64 survived


@pytest.mark.parametrize("total", [1, 1_000_000, 50_000_000, 10**9, 10**12])
def test_chunk_size_gives_enough_programs_for_an_h200(total):
    """Issue 10 item 4: >= PROGRAMS_PER_SM programs per SM (132 SMs) wherever a chunk of at
    least BLOCK allows it, chunks a power-of-two multiple of BLOCK, at most MAX_CHUNK_BLOCKS."""
    c = tb.chunk_size(total, 132)
    programs = -(-total // c)
    assert c % tb.BLOCK == 0 and (c // tb.BLOCK) & (c // tb.BLOCK - 1) == 0
    assert c <= tb.MAX_CHUNK_BLOCKS * tb.BLOCK
    if c < tb.MAX_CHUNK_BLOCKS * tb.BLOCK:
        # the chunk stopped growing: doubling it would drop below the target
        assert c == tb.BLOCK or programs >= tb.PROGRAMS_PER_SM * 132
    if total == 1_000_000:
        assert programs >= 4 * 132  # the old fixed 16,384-element chunk gave 62
    if total == 10**12:
        assert c == tb.MAX_CHUNK_BLOCKS * tb.BLOCK


def test_alignment_is_decided_by_the_addresses_not_the_size():
    def aligned(*operands):
        return tb._aligned({i: (np.array([t.data_ptr()]), t.element_size()) for i, t in enumerate(operands)})[0]

    base = torch.zeros(64)
    assert aligned(base[:8], base[4:12])  # 16-byte multiples
    assert not aligned(base[:8], base[1:9])  # an odd offset
    assert aligned(base[:7])  # a size that is not a multiple of 4: the kernels add a tail
    half = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned(base[:8], half[4:12])  # 4 bf16 elements are 8 bytes
    assert not aligned(base[:8], half[2:10])


def test_table_rows_match_the_kernels_columns():
    t = {name: torch.zeros(8) for name in ("acc", "grad", "param", "lp", "state0", "state1", "state2")}
    columns = dict(
        acc=kernels.ACC,
        grad=kernels.GRAD,
        param=kernels.PARAM,
        lp=kernels.LP,
        state0=kernels.STATE0,
        state1=kernels.STATE1,
        state2=kernels.STATE2,
    )
    addresses = {c.value: (np.array([t[name].data_ptr()]), 4) for name, c in columns.items() if name != "grad"}
    tables = tb._build(torch.device("cpu"), np.array([7]), np.array([5]), addresses, False)
    row = tables.tensors[0].tolist()
    assert len(row) == kernels.ROW.value
    assert (row[kernels.NUMEL.value], row[kernels.INDEX.value], row[kernels.IS_ALIGNED.value]) == (7, 5, 1)
    for name, column in columns.items():
        assert row[column.value] == (0 if name == "grad" else t[name].data_ptr()), name  # absent: 0
    assert tables.chunks.tolist() == [[0, 0]]


_KERNELS = ["accumulate_kernel", "reduce_stats_kernel", "step_kernel"]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not specialise")
@pytest.mark.parametrize("name", _KERNELS)
def test_no_argument_is_specialised_on_value_or_alignment(name):
    """Issue 10 item 8: a chunk table at an odd offset, a found_inf that is a view into a stats
    buffer, a tensor count of 1 or a multiple of 16 must not compile a new variant: only the
    constexprs (dtypes, switches, BLOCK) select one."""
    fn = getattr(kernels, name)
    loose = [
        p.name
        for p in fn.params
        if not p.is_constexpr and not (p.do_not_specialize and p.do_not_specialize_on_alignment)
    ]
    assert loose == []
    assert any(p.is_constexpr for p in fn.params)


def test_step_requires_exactly_one_step_count_per_tensor():
    """Issue 10 item 12: parity with the C++ binding (steps.numel() == n, not >= n)."""
    p = [torch.randn(5), torch.randn(3)]
    accs = [torch.randn(5), torch.randn(3)]
    bufs = [torch.zeros(5), torch.zeros(3)]
    one = torch.tensor(1.0)
    hyper = dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    for steps in (torch.ones(3), torch.ones(1)):
        t, s, h = ops.sgd_step.records(
            params=p, momentum_buffers=bufs, accs=accs, steps=steps, lr=one, coef=one, **hyper
        )
        with pytest.raises(ValueError, match="2 step counts"):
            tb.step(ops.sgd_step, t, s, h)


@pytest.mark.parametrize(
    "case, message",
    [
        ("bf16_acc", r"accs\[1\] must be a 1-D contiguous float32"),
        ("short_param", r"params\[0\] must have 5 elements"),
        ("strided_state", r"exp_avg_sqs\[1\] must be a contiguous float32 tensor of 3 elements"),
        ("int_lp", r"lp_params\[1\] must be bfloat16, float16 or float32"),
    ],
)
def test_step_validation_names_the_bad_tensor(case, message):
    """The whole-list checks of a plan miss fall back to the per-tensor ones for the message."""
    params, accs = [torch.randn(5), torch.randn(3)], [torch.randn(5), torch.randn(3)]
    m, v = [torch.randn(5), torch.randn(3)], [torch.rand(5), torch.rand(3)]
    lp = [torch.randn(5).bfloat16(), torch.randn(3).bfloat16()]
    if case == "bf16_acc":
        accs[1] = accs[1].bfloat16()
    elif case == "short_param":
        params[0] = torch.randn(4)
    elif case == "strided_state":
        v[1] = torch.rand(6)[::2]
    else:
        lp[1] = torch.zeros(3, dtype=torch.int32)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=message):
        tb.step(
            ops.adam_step,
            *ops.adam_step.records(
                params=params,
                exp_avgs=m,
                exp_avg_sqs=v,
                accs=accs,
                steps=torch.ones(2),
                lr=one,
                coef=one,
                lp_params=lp,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
                decoupled=True,
                maximize=False,
            ),
        )


def test_capture_arena_hands_out_fresh_aligned_slices_until_released(monkeypatch):
    """Tables first built during CUDA-graph capture are copied from slices of a pinned arena
    (pinned in eager mode): slices never overlap (every replay copies from them again), start
    16-byte aligned, fail clearly when the arena is full or was never pinned, and come back
    with release_captured_tables(). (The arena is a plain tensor here: no pinned memory on CPU.)"""
    dev = torch.device("cuda", 0)  # only a key: nothing here touches a GPU
    monkeypatch.setattr(tb, "_arenas", {dev: [torch.zeros(16, dtype=torch.int64), 0]})
    monkeypatch.setattr(tb, "_captured", {})
    a = tb._arena_slice(dev, torch.arange(5))
    b = tb._arena_slice(dev, torch.arange(10, 13))
    assert a.tolist() == [0, 1, 2, 3, 4] and b.tolist() == [10, 11, 12]
    assert b.data_ptr() - a.data_ptr() == 6 * 8  # 5 rounded up to 6 int64: 16-byte aligned
    with pytest.raises(RuntimeError, match="capture arena is full"):
        tb._arena_slice(dev, torch.arange(8))
    assert tb.release_captured_tables() == 0 and tb._arenas[dev][1] == 0
    assert tb._arena_slice(dev, torch.arange(8)).data_ptr() == a.data_ptr()  # reused after release
    monkeypatch.setattr(tb, "_arenas", {})
    with pytest.raises(RuntimeError, match="warm-up"):
        tb._arena_slice(dev, torch.arange(3))


def test_plan_cache_is_locked_and_bounded_under_threads(monkeypatch):
    """Issue 10 item 12: autograd hooks run on one thread per device, so lookups and stores
    race. 8 threads x 500 lookups/stores of distinct keys: no exception, the LRU stays at its
    bound, and every access went through the lock."""
    import threading

    class CountingLock:
        def __init__(self):
            self.inner, self.entered = threading.Lock(), 0

        def __enter__(self):
            self.inner.acquire()
            self.entered += 1

        def __exit__(self, *exc):
            self.inner.release()

    lock = CountingLock()
    monkeypatch.setattr(tb, "_lock", lock)
    monkeypatch.setattr(tb, "_table_cache", type(tb._table_cache)())
    errors = []

    def work(t):
        try:
            for i in range(500):
                key = tb._Key("test", t, i)
                if tb._lookup(key, False) is None:
                    tb._store(key, tb._Plan((), 0), False)
                tb._lookup(tb._Key("test", t, i // 2), False)
        except Exception as e:  # pragma: no cover - what the test is for
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(tb._table_cache) == tb._TABLE_CACHE_SIZE
    assert lock.entered == 8 * 500 * 3  # lookup, store (every key is new), lookup: all locked


# --- what the compiler makes of the kernels (no GPU needed) ----------------------------------


def _compile_sm90(fn, pointers, hyper=(), **constexprs):
    """``fn`` compiled for sm_90 (``.asm["ptx"]``, ``.asm["ttgir"]``...): ``pointers`` name its
    fp32-tensor arguments; the tables are int64 tensors, ``hyper`` (a step's tuple of scalars)
    has the types of the values given and every other non-constexpr argument is an fp32 scalar."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {
        "chunks": "*i64",
        "tensors": "*i64",
        "first": "i64",
        "chunk": "i64",
        "n": "i64",
        **{name: "*fp32" for name in pointers},
    }
    types["hyper"] = tuple("i64" if isinstance(x, int) else "fp32" for x in hyper)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "fp32") for n in fn.arg_names}
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target, options={"num_warps": tb.NUM_WARPS, "enable_fp_fusion": tb.FP_FUSION})


def _global_accesses(ptx):
    return set(re.findall(r"\b((?:ld|st)\.global(?:\.v\d)?\.b\d+)", ptx))


def _registers(compiled):
    """Registers per thread of a compiled kernel, by the cuobjdump that ships with Triton."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip(f"no cuobjdump at {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True)
    return int(re.search(r"REG:(\d+)", out.stdout).group(1))


def _aligned_branch(compiled):
    """The TTGIR of the kernel up to the else of its first branch: the prologue and the body
    for aligned rows (``if _row_is_aligned(...)``)."""
    ttgir = compiled.asm["ttgir"]
    assert "} else {" in ttgir
    return ttgir.split("} else {")[0]


# Under the interpreter the kernels are interpreted functions, with nothing to compile.
_COMPILABLE = not INTERPRETED and hasattr(kernels.accumulate_kernel, "arg_names")
compiles = pytest.mark.skipif(not _COMPILABLE, reason="needs the compiled (not interpreted) kernels")


@compiles
def test_accumulate_compiles_to_vector_accesses_with_a_scalar_fallback():
    compiled = _compile_sm90(
        kernels.accumulate_kernel,
        ("partial_sumsq", "partial_bad"),
        GRAD_DTYPE=tl.bfloat16,
        OVERWRITE=False,
        STATS=False,
        BLOCK=tb.BLOCK,
    )
    accesses = _global_accesses(compiled.asm["ptx"])
    # aligned rows: bf16 grad 4 elements = 8 bytes (v2.b32); fp32 acc 16 bytes (v4.b32)
    assert {"ld.global.v2.b32", "ld.global.v4.b32", "st.global.v4.b32"} <= accesses
    # other rows: scalar accesses, correct at any offset
    assert {"ld.global.b16", "st.global.b32"} <= accesses
    # one register layout for bf16 and fp32 on aligned rows: no trip through shared memory
    assert "convert_layout" not in _aligned_branch(compiled)


def _compile_adamw_sm90(**dtypes):
    """The fused AdamW step (fused last micro-batch, found_inf, decoupled decay) for sm_90: the
    generic step kernel with Adam's update rule, its arguments as the launcher makes them."""
    update = updates.UPDATES["adam_step"]
    hyper, switches = update.arguments(
        ops.adam_step.hyper(0.9, 0.999, 1e-8, 0.01, True, False), ops.adam_step.states([], [])
    )
    assert switches == (True, True, False)  # weight decay, decoupled, no amsgrad
    return _compile_sm90(
        kernels.step_kernel,
        ("steps", "lr_ptr", "coef_ptr", "found_inf"),
        hyper,
        **dtypes,
        GRAD_DTYPE=tl.bfloat16,
        FUSED=True,
        GRADS_OVERWRITE=False,
        HAS_FOUND_INF=True,
        MAXIMIZE=False,
        PREPARE=update.prepare,
        UPDATE=update.update,
        SWITCHES=switches,
        BLOCK=tb.BLOCK,
    )


def _check_adamw_vectorized(compiled) -> None:
    """16-byte (v4) and 8-byte (v2) global accesses, one register layout, IEEE sqrt/div, and
    <= 96 registers: at least 5 programs of 128 threads on an SM's 65,536 registers."""
    ptx = compiled.asm["ptx"]
    accesses = _global_accesses(ptx)
    assert {"ld.global.v2.b32", "ld.global.v4.b32", "st.global.v4.b32", "st.global.v2.b32"} <= accesses
    assert "convert_layout" not in _aligned_branch(compiled)
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "sqrt.approx" not in ptx
    # 72 at the time of writing; the scalar branch at full BLOCK took 156 (3 programs per SM).
    assert _registers(compiled) <= 96


@compiles
def test_fused_adamw_compiles_vectorized_in_one_layout_with_ieee_sqrt():
    _check_adamw_vectorized(
        _compile_adamw_sm90(PARAM_DTYPE=tl.float32, LP_DTYPE=tl.bfloat16, HAS_LP=True, HAS_REM=False)
    )


@compiles
def test_remainder_adamw_compiles_vectorized_in_one_layout():
    """The exact 2-byte master's fused AdamW (bf16 params + int16 remainders, issue 28): on
    aligned rows the bf16 param, its remainder and the bf16 gradient move 4 elements (8 bytes,
    ld/st.global.v2.b32) per access and the fp32 acc and moments 16 bytes (v4.b32), in the one
    register layout of the fp32-master kernel (VEC = 4: see kernels); the split and rebuild
    are integer selects, no new division or square root; <= 96 registers as the other Adam."""
    _check_adamw_vectorized(_compile_adamw_sm90(PARAM_DTYPE=tl.bfloat16, LP_DTYPE=tl.int16, HAS_LP=False, HAS_REM=True))


# --- on a device (CPU under the interpreter, or CUDA) ----------------------------------------


class _RecordLaunches:
    """Stands in for a kernel and records the ``num_warps`` of each launch."""

    def __init__(self, kernel):
        self.kernel, self.warps = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.warps.append(kwargs["num_warps"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_adam_on_16_bit_params_in_place_launches_at_the_warps_the_spill_gate_compiles(device, monkeypatch):
    """The launch shape of each Adam variant is step_num_warps's (what
    scripts/check_triton_spills.py compiles): twice the warps for bf16 params without a master
    (under triton 3.6 they spill at 4), NUM_WARPS with fp32 masters and with remainders."""
    recorder = _RecordLaunches(kernels.step_kernel)
    monkeypatch.setattr(kernels, "step_kernel", recorder)
    n = 70
    views = lambda: _flat_views([n], device)[2]  # noqa: E731
    hyper = ops.adam_step.hyper(0.9, 0.99, 1e-8, 0.01, True, False)
    common = (torch.ones(1, device=device), torch.tensor(1e-3, dtype=torch.float64, device=device))
    common += (torch.ones((), device=device),)
    masters = views()
    cases = {
        "bf16 in place": dict(params=[torch.randn(n, device=device).bfloat16()]),
        # (the bf16 copy is its master's rounding, as the optimizer keeps it: the step reads it)
        "fp32 master": dict(params=masters, lp_params=[masters[0].to(torch.bfloat16)]),
        "remainder": dict(
            params=[torch.randn(n, device=device).bfloat16()],
            remainders=[torch.zeros(n, device=device, dtype=torch.int16)],
        ),
    }
    for case in cases.values():
        accs, m, v = views(), views(), views()
        for x in (accs, m, v):
            x[0].fill_(0.5)
        t = ops.StepTensors(case.pop("params"), accs, *common, **case)
        tb.step(ops.adam_step, t, ops.adam_step.states(m, v), hyper)
    assert recorder.warps == [2 * tb.NUM_WARPS, tb.NUM_WARPS, tb.NUM_WARPS]
    assert tb.step_num_warps("adam_step", 16, False, False) == 2 * tb.NUM_WARPS


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_accumulates_2000_small_tensors_in_two_launches(device, monkeypatch):
    """2,050 tensors of one dtype, aligned and not (sizes 1-4): one accumulate launch and one
    launch folding the norm/non-finite partials."""
    gen = torch.Generator().manual_seed(11)
    sizes = [1 + i % 4 for i in range(2050)]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16) for n in sizes]
    flat, offsets, accs = _flat_views(sizes, device)
    want, _, expect = _flat_views(sizes, device)
    for a, e in zip(accs, expect):
        a.copy_(torch.randn(a.numel(), generator=gen))
        e.copy_(a)
    grads[1234][0] = float("inf")
    counters = [_CountLaunches(kernels.accumulate_kernel), _CountLaunches(kernels.reduce_stats_kernel)]
    monkeypatch.setattr(kernels, "accumulate_kernel", counters[0])
    monkeypatch.setattr(kernels, "reduce_stats_kernel", counters[1])
    found_inf, sumsq = torch.zeros((), device=device), torch.zeros((), device=device)
    tb.accumulate(flat, offsets, grads, 0.5, False, found_inf, sumsq)
    assert [c.launches for c in counters] == [1, 1]
    ref_inf, ref_sumsq = torch.zeros((), device=device), torch.zeros((), device=device)
    reference.accumulate(want, offsets, grads, 0.5, False, ref_inf, ref_sumsq)
    for got, want in zip(accs, expect):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert found_inf.item() == 1.0
    assert sumsq.item() == float("inf") and ref_sumsq.item() == float("inf")


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_step_over_many_tensors_is_one_launch(device, monkeypatch):
    gen = torch.Generator().manual_seed(12)
    sizes = [1 + (i * 7) % 40 for i in range(300)]
    params = [torch.randn(n, generator=gen).to(device) for n in sizes]
    # the bf16 copies are their masters' rounding, as the optimizer keeps them (the step reads
    # them and restarts a master whose copy is not: a weight written from outside)
    lp = [p.to(torch.bfloat16) for p in params]
    m = [torch.randn(n, generator=gen).to(device) for n in sizes]
    v = [torch.rand(n, generator=gen).to(device) for n in sizes]
    accs = _flat_views(sizes, device)[2]
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32, device=device)
    lr, coef = torch.tensor(1e-3, device=device), torch.tensor(0.5, device=device)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False)
    want = [[t.clone() for t in ts] for ts in (params, m, v, lp)]
    counter = _CountLaunches(kernels.step_kernel)
    monkeypatch.setattr(kernels, "step_kernel", counter)
    common = dict(accs=accs, steps=steps, lr=lr, coef=coef, **hyper)
    tb.step(ops.adam_step, *ops.adam_step.records(params=params, exp_avgs=m, exp_avg_sqs=v, lp_params=lp, **common))
    reference.adam_step(
        *ops.adam_step.records(params=want[0], exp_avgs=want[1], exp_avg_sqs=want[2], lp_params=want[3], **common)
    )
    assert counter.launches == 1
    for got_list, want_list in zip((params, m, v, lp), want):
        for got, exp in zip(got_list, want_list):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


def _row_flags(tables):
    return tables.tensors[:, kernels.IS_ALIGNED.value].tolist()


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["sgd", "adamw", "lion"])
def test_triton_step_on_aligned_rows_with_and_without_a_tail_matches_reference(device, algo):
    """The vector branch of each step kernel, with sizes that are multiples of VEC and sizes
    that leave a 1-3 element scalar tail (issue 10 item 7: an odd size no longer sends the
    whole tensor to the scalar branch), on the fused last micro-batch."""
    from test_kernels import ALGOS, _call, _step_inputs  # the matrix's inputs and hyper-parameters

    assert algo in ALGOS
    gen = torch.Generator().manual_seed(15)
    sizes = [4, 1024, 4100, 1, 7, 2053, 50_257 % 4099]
    params, states, lp, accs, steps = _step_inputs(algo, sizes, "master", device, gen)
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16) for n in sizes]
    lr, coef = torch.tensor(0.01, device=device), torch.tensor(0.25, device=device)
    want = [[t.clone() for t in params], [[t.clone() for t in s] for s in states], [t.clone() for t in lp]]
    tb.clear_table_cache()
    _call(tb, algo, params, states, lp, accs, steps, lr, coef, grads, False)
    _call(reference, algo, *want, accs, steps, lr, coef, grads, False)
    ((_, plan),) = tb._table_cache.values()  # the precondition: every row took the vector branch
    assert [f for _, t, _ in plan.launches for f in _row_flags(t)] == [1] * len(sizes)
    # test_kernels' STEP_TOL: the kernels place the reference's FMAs, so what may differ is
    # beta**step (fp64 by squaring vs pow: ~1e-16 relative before rounding to fp32) - 1e-5
    # is that matrix's bound, far above it
    for got, exp in zip(params + [t for s in states for t in s], want[0] + [t for s in want[1] for t in s]):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
    for got, exp in zip(lp, want[2]):
        assert torch.equal(got, exp)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_accumulate_mixes_vector_tail_and_scalar_rows(device):
    """Aligned rows with odd sizes (vector body + tail) next to rows whose gradient is a view
    at an odd element offset (scalar branch) in one launch; statistics over all of them."""
    gen = torch.Generator().manual_seed(21)
    sizes = [1, 3, 5, 8, 1021, 2053, 4097, 6, 2]
    storage = torch.randn(sum(sizes) + 66 * len(sizes), generator=gen).to(device=device, dtype=torch.float16)
    grads, at = [], 1  # every other gradient is a view starting at an odd fp16 element
    for i, n in enumerate(sizes):
        if i % 2:
            grads.append(storage[at : at + n])
            at = (at + n + 64) | 1
        else:
            grads.append(torch.randn(n, generator=gen).to(device=device, dtype=torch.float16))
    flat, offsets, accs = _flat_views(sizes, device)
    want, _, expect = _flat_views(sizes, device)
    for a, e in zip(accs, expect):
        a.copy_(torch.randn(a.numel(), generator=gen))
        e.copy_(a)
    found_inf, sumsq = torch.zeros((), device=device), torch.full((), 0.5, device=device)
    ref_inf, ref_sumsq = torch.zeros((), device=device), torch.full((), 0.5, device=device)
    tb.clear_table_cache()
    tb.accumulate(flat, offsets, grads, -1.5, False, found_inf, sumsq)
    reference.accumulate(want, offsets, grads, -1.5, False, ref_inf, ref_sumsq)
    ((_, plan),) = tb._table_cache.values()
    assert _row_flags(plan.launches[0][1]) == [1 - i % 2 for i in range(len(sizes))]
    assert torch.equal(flat, want)  # same two roundings (no FMA contraction), padding untouched
    assert found_inf.item() == 0.0
    # the sum of squares is summed in another order than the reference's per-slice dot
    torch.testing.assert_close(sumsq, ref_sumsq, rtol=2e-5, atol=0.0)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_triton_adam_amsgrad_matches_reference(device, found):
    """amsgrad (the ``max_exp_avg_sqs=`` keyword): the running max is written and used in the
    denominator; a NaN in v propagates into the max (torch.maximum); a set found_inf changes
    nothing. Sizes: 1, a prime, > a block, with tails; 130 tensors (> 110 in one call)."""
    gen = torch.Generator().manual_seed(31)
    sizes = [1, 13, 1031, 4099] + [1 + (i * 37) % 97 for i in range(126)]
    params = [torch.randn(n, generator=gen).to(device) for n in sizes]
    m = [torch.randn(n, generator=gen).to(device) for n in sizes]
    v = [torch.rand(n, generator=gen).to(device) for n in sizes]
    # half the max above v (kept), half below (replaced by the new v)
    vmax = [x + torch.rand(n, generator=gen).to(device) * (i % 2) for i, (x, n) in enumerate(zip(v, sizes))]
    lp = [p.to(torch.bfloat16) for p in params]  # (their masters' rounding, as the optimizer keeps them)
    accs = _flat_views(sizes, device)[2]
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    accs[2][5] = float("nan")
    steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32, device=device)
    lr, coef = torch.tensor(3e-3, device=device), torch.tensor(0.5, device=device)
    found_inf = torch.tensor(found, device=device)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=False, maximize=False)
    want = [[t.clone() for t in ts] for ts in (params, m, v, vmax, lp)]
    common = dict(accs=accs, steps=steps, lr=lr, coef=coef, found_inf=found_inf, **hyper)
    tb.step(
        ops.adam_step,
        *ops.adam_step.records(params=params, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=vmax, lp_params=lp, **common),
    )
    reference.adam_step(
        *ops.adam_step.records(
            params=want[0], exp_avgs=want[1], exp_avg_sqs=want[2], max_exp_avg_sqs=want[3], lp_params=want[4], **common
        )
    )
    assert torch.isnan(vmax[2][5]) == (found == 0.0)
    for got_list, want_list in zip((params, m, v, vmax), want):
        for got, exp in zip(got_list, want_list):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6, equal_nan=True)
    for got, exp in zip(lp, want[4]):  # bit for bit: both round the same fp32 to bf16
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    if found:  # a skipped step writes nothing: the bf16 copies are still their masters' rounding
        assert all(torch.equal(t, p.to(torch.bfloat16)) for t, p in zip(lp, params))


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_table_cache_tells_sizes_apart_at_equal_addresses(device):
    """Two calls whose tensors start at the same addresses but differ in size must not share
    a cached table (the key holds every size, not only the addresses)."""
    flat = torch.zeros(256, device=device)
    grads = torch.ones(256, device=device, dtype=torch.float16)
    offsets = torch.tensor([0, 64])
    tb.accumulate(flat, offsets, [grads[:8], grads[64:72]], 1.0, False)
    tb.accumulate(flat, offsets, [grads[:40], grads[64:104]], 1.0, False)
    want = torch.zeros(256, device=device)
    want[:8] += 1
    want[64:72] += 1
    want[:40] += 1
    want[64:104] += 1
    assert torch.equal(flat, want)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_step_writes_back_non_contiguous_params(device):
    """fp32 params that are their own master may be non-contiguous (a transposed weight):
    the update lands on the right elements."""
    gen = torch.Generator().manual_seed(13)
    params = [torch.randn(6, 5, generator=gen).to(device).t(), torch.randn(40, generator=gen).to(device)[::2]]
    bufs = [torch.randn(p.numel(), generator=gen).to(device) for p in params]
    accs = _flat_views([p.numel() for p in params], device)[2]
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    steps = torch.tensor([2.0, 2.0], device=device)
    lr, coef = torch.tensor(0.1, device=device), torch.tensor(1.0, device=device)
    hyper = dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    want_p, want_b = [p.clone() for p in params], [b.clone() for b in bufs]
    common = dict(accs=accs, steps=steps, lr=lr, coef=coef, **hyper)
    tb.step(ops.sgd_step, *ops.sgd_step.records(params=params, momentum_buffers=bufs, **common))
    reference.sgd_step(*ops.sgd_step.records(params=want_p, momentum_buffers=want_b, **common))
    for got, exp in zip(params + bufs, want_p + want_b):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_op_traces_under_torch_compile_without_graph_break(device):
    import fused_accum.ops  # noqa: F401  (registers torch.ops.fused_accum)

    gen = torch.Generator().manual_seed(14)
    sizes = [5, 100]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16) for n in sizes]
    flat, offsets, accs = _flat_views(sizes, device)
    want, _, expect = _flat_views(sizes, device)
    for a, e in zip(accs, expect):
        a.fill_(1.0)
        e.fill_(1.0)
    sumsq = torch.zeros((), device=device)

    def micro_batch(flat, offsets, grads, sumsq):
        torch.ops.fused_accum.accumulate_(flat, offsets, grads, 0.5, False, None, sumsq, "triton")
        return sumsq * 2  # read after the op: the mutation must be ordered before it

    torch._dynamo.reset()
    compiled = torch.compile(micro_batch, backend="aot_eager", fullgraph=True)  # fails on a break
    out = compiled(flat, offsets, grads, sumsq)
    ref_sumsq = torch.zeros((), device=device)
    reference.accumulate(want, offsets, grads, 0.5, False, None, ref_sumsq)
    for got, want in zip(accs, expect):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, 2 * ref_sumsq, rtol=2e-5, atol=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA, compiled")
def test_triton_accumulates_past_2_pow_31_elements():
    """One tensor of 2**31 + 3076 elements (4.3 GB of bf16 grad, 8.6 GB of fp32 acc; a multiple
    of 4, so the vector branch): element offsets past int32 must land where they belong.
    Checked on slices around 2**31."""
    n = 2**31 + 3076
    device = "cuda"
    assert backends.availability("triton", device) == ""
    grad = torch.randn(n, device=device, dtype=torch.bfloat16)
    acc = torch.full((n,), 0.25, device=device)
    grad[2**31 + 5] = float("nan")
    found_inf, sumsq = torch.zeros((), device=device), torch.zeros((), device=device)
    tb.accumulate(acc, torch.zeros(1, dtype=torch.int64), [grad], 2.0, False, found_inf, sumsq)
    for lo in (0, 2**31 - 1000, n - 3000):
        hi = lo + 2000
        want = 0.25 + 2.0 * grad[lo:hi].float()
        torch.testing.assert_close(acc[lo:hi], want, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert found_inf.item() == 1.0
    assert torch.isnan(sumsq)


# --- caller plans: plan= (issue 10 item 5) ---------------------------------------------------


def _bf16_or_fp32(n, gen, device, bf16):
    return torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_accumulate_with_a_plan_follows_new_gradients_and_dtypes(device):
    """A window's micro-batches under one plan: every call has new gradient tensors (new
    addresses), one of them changes dtype between calls, the first call overwrites; then a
    subset of the slots under another plan, and the accumulator moved under the first plan.
    Bit-exact against the reference (the kernels round as it does: no FMA contraction) with
    the statistics of each call."""
    gen = torch.Generator().manual_seed(41)
    sizes = [1, 5, 64, 131, 1029, 3]
    flat, offsets, _ = _flat_views(sizes, device)
    flat.copy_(torch.randn(flat.numel(), generator=gen))
    want = flat.clone()
    plan = object()
    for call in range(4):
        grads = [_bf16_or_fp32(n, gen, device, bf16=i != 2 or call % 2) for i, n in enumerate(sizes)]
        if call == 2:
            grads[4][7] = float("inf")
        stats = [torch.zeros((), device=device), torch.full((), 0.25, device=device)]
        ref_stats = [torch.zeros((), device=device), torch.full((), 0.25, device=device)]
        tb.accumulate(flat, offsets, grads, 0.75, call == 0, *stats, plan=plan)
        reference.accumulate(want, offsets, grads, 0.75, call == 0, *ref_stats)
        assert torch.equal(flat, want), call
        assert stats[0].item() == ref_stats[0].item() == (call >= 2)  # the inf stays in the sum
        # summed in another order than the reference's per-slice dots: a few ulp of fp32
        torch.testing.assert_close(stats[1], ref_stats[1], rtol=2e-5, atol=0.0)
    # a changed active set: slots 1 and 4 only, as the window passes a partial bucket
    subset = torch.tensor([offsets[1].item(), offsets[4].item()])
    grads = [_bf16_or_fp32(sizes[i], gen, device, bf16=True) for i in (1, 4)]
    tb.accumulate(flat, subset, grads, -2.0, False, plan=object())
    reference.accumulate(want, subset, grads, -2.0, False)
    assert torch.equal(flat, want)
    # the accumulator reallocated (a model moved): its address is part of the plan's key
    flat2 = flat.clone()
    grads = [_bf16_or_fp32(n, gen, device, bf16=True) for n in sizes]
    tb.accumulate(flat2, offsets, grads, 1.0, False, plan=plan)
    reference.accumulate(want, offsets, grads, 1.0, False)
    assert torch.equal(flat2, want)


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_plan_checks_its_first_call_and_every_new_dtype(device):
    """A plan's first call is checked like an unplanned miss (a gradient too big for its slice
    is refused, and no plan is kept); later calls check each dtype they have not seen."""
    flat, offsets, _ = _flat_views([5, 9], device)
    plan = object()
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        tb.accumulate(
            flat, offsets, [torch.ones(5, device=device), torch.ones(200, device=device)], 1.0, False, plan=plan
        )
    tb.accumulate(flat, offsets, [torch.ones(5, device=device), torch.ones(9, device=device)], 1.0, True, plan=plan)
    bad = [torch.ones(5, device=device), torch.ones(9, device=device, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"grads\[1\] must be bfloat16, float16 or float32"):
        tb.accumulate(flat, offsets, bad, 1.0, False, plan=plan)
    assert flat[:5].tolist() == [1.0] * 5 and flat[64:73].tolist() == [1.0] * 9


def _planned_step_inputs(sizes, device, gen):
    """AdamW's lists as the optimizer passes them: accs, masters and states are views of flat
    fp32 buffers (64-element slices), the bf16 parameters are the model's own tensors."""
    flats = [_flat_views(sizes, device) for _ in range(4)]
    for flat, _, _ in flats:
        flat.copy_(torch.randn(flat.numel(), generator=gen))
    flats[3][0].abs_()  # exp_avg_sq >= 0
    accs, masters, m, v = (views for _, _, views in flats)
    lp = [x.to(torch.bfloat16) for x in masters]  # (their masters' rounding, as the optimizer keeps them)
    return accs, masters, m, v, lp


@needs_device
@pytest.mark.parametrize("device", DEVICES)
def test_triton_adamw_with_a_plan_follows_new_parameters_active_sets_and_moved_buffers(device):
    """Steps under one plan: new bf16 parameter tensors (the model's, re-read each call); a
    partial active set under its own plan; the flat buffers reallocated as a whole (the first
    addresses are checked); the fused last micro-batch with new gradients under its plan. Each
    against the reference on copies."""
    gen = torch.Generator().manual_seed(43)
    sizes = [1, 7, 64, 131, 1029]
    accs, masters, m, v, lp = _planned_step_inputs(sizes, device, gen)
    steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32, device=device)
    lr, coef = torch.tensor(1e-2, device=device), torch.tensor(0.5, device=device)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False)
    want = [[t.clone() for t in ts] for ts in (masters, m, v)]

    def step(rows, plan, lp_now, grads=()):
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        wlp = [t.clone() for t in lp_now]
        common = dict(accs=pick(accs), steps=steps[rows], lr=lr, coef=coef, grads=list(grads), **hyper)
        tb.step(
            ops.adam_step,
            *ops.adam_step.records(
                params=pick(masters), exp_avgs=pick(m), exp_avg_sqs=pick(v), lp_params=lp_now, **common
            ),
            plan=plan,
        )
        reference.adam_step(
            *ops.adam_step.records(
                params=pick(want[0]), exp_avgs=pick(want[1]), exp_avg_sqs=pick(want[2]), lp_params=wlp, **common
            )
        )
        for got, exp in zip(masters + m + v, want[0] + want[1] + want[2]):
            # test_kernels' STEP_TOL: beta**step in another order than the reference, 1e-5
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
        for got, exp in zip(lp_now, wlp):  # both round the same fp32 master to bf16
            torch.testing.assert_close(got, exp, rtol=0, atol=0)

    every, plan = list(range(len(sizes))), object()
    step(every, plan, lp)
    step(every, plan, [t.clone() for t in lp])  # the model's tensors replaced: new addresses
    step([0, 3, 4], object(), [lp[i] for i in (0, 3, 4)])  # a changed active set
    # the optimizer's buffers moved as a whole (to_empty, a rehome): same plan, new addresses
    for xs, ws in ((masters, want[0]), (m, want[1]), (v, want[2]), (accs, None)):
        moved = _flat_views(sizes, device)
        for i, x in enumerate(xs):
            moved[2][i].copy_(x)
        xs[:] = moved[2]
    step(every, plan, lp)
    # the fused last micro-batch: its gradients are new each window, bf16 then fp32
    fused = object()
    for bf16 in (True, False):
        step(every, fused, lp, [_bf16_or_fp32(n, gen, device, bf16) for n in sizes])


@needs_device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["sgd", "lion"])
def test_triton_fp32_step_with_a_plan_rereads_the_parameters(device, algo):
    """fp32 parameters that are their own master (no lp_params) belong to the model: under a
    plan they are read each call, so new parameter tensors are updated, not the old ones."""
    gen = torch.Generator().manual_seed(47)
    sizes = [3, 67, 1025]
    accs = _flat_views(sizes, device)[2]
    flat, _, bufs = _flat_views(sizes, device)
    flat.copy_(torch.randn(flat.numel(), generator=gen))
    for a in accs:
        a.copy_(torch.randn(a.numel(), generator=gen))
    steps = torch.full((len(sizes),), 4.0, device=device)
    lr, coef = torch.tensor(0.05, device=device), torch.tensor(1.0, device=device)
    if algo == "sgd":
        hyper = dict(momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=True, maximize=False)
    else:
        hyper = dict(beta1=0.9, beta2=0.99, weight_decay=0.01, maximize=True)
    op = ops.STEP_OPS[f"{algo}_step"]
    state = op.states._fields[0]  # momentum_buffers, exp_avgs

    def call(backend, params, bufs, **plan):
        backend.step(
            op, *op.records(params=params, **{state: bufs}, accs=accs, steps=steps, lr=lr, coef=coef, **hyper), **plan
        )

    want_b = [b.clone() for b in bufs]
    plan = object()
    for _ in range(2):
        params = [torch.randn(n, generator=gen).to(device) for n in sizes]  # new tensors each call
        want_p = [p.clone() for p in params]
        call(tb, params, bufs, plan=plan)
        call(reference, want_p, want_b)
        for got, exp in zip(params + bufs, want_p + want_b):
            torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)  # one fp32 update: a few ulp


def test_ops_pass_the_plan_to_triton_only():
    """ops.* take plan= for the eager path: the triton backend receives it, the others never
    see it (their functions take no such argument), and an op without plan= calls as before."""
    seen = []
    real = tb.accumulate
    flat, offsets, _ = _flat_views([3], "cpu")
    grads = [torch.ones(3)]
    real_step = tb.step
    records = ops.lion_step.records(
        params=[torch.zeros(3)],
        exp_avgs=[torch.zeros(3)],
        accs=[flat[:3]],
        steps=torch.ones(1),
        lr=torch.ones(()),
        coef=torch.ones(()),
        beta1=0.9,
        beta2=0.99,
        weight_decay=0.0,
        maximize=False,
    )
    try:
        tb.accumulate = lambda *args, **kwargs: seen.append(kwargs)
        tb.step = lambda *args, **kwargs: seen.append(kwargs)
        plan = object()
        ops.accumulate(flat, offsets, grads, 1.0, True, None, None, "triton", plan=plan)
        ops.accumulate(flat, offsets, grads, 1.0, True, None, None, "triton")
        ops.lion_step(*records, "triton", plan=plan)
        ops.lion_step(*records, "triton")
    finally:
        tb.accumulate = real
        tb.step = real_step
    assert seen == [{"plan": plan}, {}, {"plan": plan}, {}]
    ops.lion_step(*records, "reference", plan=object())  # (reference.step takes no plan=)
    ops.accumulate(flat, offsets, grads, 2.0, True, None, None, "reference", plan=object())
    assert flat[:3].tolist() == [2.0, 2.0, 2.0]


# --- the host-time benchmark (issue 10 item 5) -----------------------------------------------


def test_host_benchmark_runs_every_row_and_restores_the_kernels(tmp_path):
    """benchmarks/triton_host.py is the rerunnable measurement of the launcher's host cost: it
    must run here (kernels stubbed, CPU tensors), write its CSV, and put the kernels back."""
    import csv
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_host.py"
    spec = importlib.util.spec_from_file_location("triton_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = kernels.accumulate_kernel, kernels.step_kernel
    assert module.main(["--tensors", "16", "2048", "--repeat", "3", "--out", str(tmp_path)]) == 0
    assert (kernels.accumulate_kernel, kernels.step_kernel) == before
    with open(tmp_path / "triton_host.csv") as f:
        rows = list(csv.DictReader(f))
    cases = [(r["op"], r["case"], r["tensors"]) for r in rows]
    assert cases == [("floor: map(data_ptr)", "-", "2048")] + [
        (op, case, str(n))
        for n in (16, 2048)
        for op in ("accumulate", "adamw", "sgd", "lion")
        for case in ("plan", "plan, new", "no plan")
    ]
    assert all(0 < float(r["p10_ms"]) <= float(r["median_ms"]) <= float(r["p90_ms"]) for r in rows)
    # the verdict columns are filled exactly for the goal rows (2,048 tensors, planned, cached)
    assert [(r["op"], r["goal_ms"]) for r in rows if r["goal_ms"]] == [
        ("accumulate", "0.5"),
        ("adamw", "1.0"),
        ("sgd", "1.0"),
        ("lion", "1.0"),
    ]
