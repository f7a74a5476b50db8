"""The C++/CUDA extension (fused_accum._C, backends "cpu" and "cuda") beyond tests/test_kernels.py.

test_kernels.py compares every kernel with the reference on awkward sizes and dtypes. This file
checks what is particular to the extension:
- ``torch.library.opcheck`` on every op: the schemas declare exactly what is mutated, the fake
  implementations work, and AOT autograd can trace the ops (so can ``torch.compile``);
- the boundary checks: a bad argument raises an error that names it and what was expected;
- strided parameters are written back, zero-size tensors and empty lists are no-ops;
- the package works without ``_C``;
- on a GPU (``pytest -m gpu``): CUDA vs Triton vs reference on the same inputs, lists longer than
  one kernel-argument table, a tensor of more than 2^31 elements, CUDA graph capture (no host
  sync), and device mismatches.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import cases  # tests/cases.py: every algorithm and its step-op cases
from fused_accum import backends, ops
from fused_accum.backends import ext, reference
from helpers import GPU_KERNEL_BACKENDS, PAD, flat_layout  # tests/helpers.py

if backends.availability("cpu", "cpu"):
    pytestmark = pytest.mark.skip(reason=f"the C++ extension is not built: {ext.unavailable_reason('cpu')}")

OPS = torch.ops.fused_accum_ext if ext._C is not None else None
STEP_TOL = dict(rtol=1e-5, atol=1e-6)  # as in test_kernels.py, which says why


def _randn(n, dtype, device, gen):
    return torch.randn(n, generator=gen).to(device=device, dtype=dtype)


def _accumulate_args(device, gen, sizes=(5, 300, 1), pad=PAD):
    """(acc, offsets, grads) of accumulate: a random buffer, and gradients of mixed dtypes."""
    acc, offsets, _ = flat_layout(sizes, device, pad=pad, gen=gen)
    grads = [_randn(n, (torch.bfloat16, torch.float16, torch.float32)[i % 3], device, gen) for i, n in enumerate(sizes)]
    return acc, offsets, grads


ALGOS = cases.kernel_cases()  # every algorithm's step-op cases (tests/cases.py), by name


def _step_args(algo, device, gen, sizes=(5, 300, 1), fused=True, lp=True):
    """The arguments of kernel case ``algo``'s step op by name (the flat keyword form of its
    records: see _step), fp32 masters with bf16/fp16 copies, the state lists its case keeps."""
    _, hyper, keys = cases.op_records(ALGOS[algo])
    states = [f"{key}s" for key in keys]
    named = dict(
        params=flat_layout(sizes, device, gen=gen).views,
        **{name: [s.abs() for s in flat_layout(sizes, device, gen=gen).views] for name in states},
        accs=flat_layout(sizes, device, gen=gen).views,
        steps=torch.tensor([1.0 + 3 * i for i in range(len(sizes))], device=device),
        # lr as the optimizer passes it: float64 (test_cuda_step_captures_... also passes float32)
        lr=torch.tensor(0.01, dtype=torch.float64, device=device),
        coef=torch.tensor(0.5, device=device),
        lp_params=[
            torch.zeros(n, device=device, dtype=(torch.bfloat16, torch.float16)[i % 2]) for i, n in enumerate(sizes)
        ]
        if lp
        else [],
        grads=[_randn(n, torch.bfloat16, device, gen) for n in sizes] if fused else [],
        grad_alpha=0.5,
        grads_overwrite=False,
        found_inf=torch.zeros((), device=device),
    )
    return {**named, **hyper._asdict()}


def _op(algo) -> ops.StepOp:
    return cases.op_records(ALGOS[algo])[0]


def _step(module, algo, named):
    """module's step op of ``algo`` on _step_args' arguments."""
    op = _op(algo)
    module.step(op, *op.records(**named))


def _op_args(algo, named):
    """The positional argument list of torch.ops.fused_accum_ext.<op>_ for _step_args' output."""
    op = _op(algo)
    return tuple(op.flatten(*op.records(**named)))


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    return x


def _assert_trees_close(got, want, **tol):
    if isinstance(got, torch.Tensor):
        torch.testing.assert_close(got.float(), want.float(), **tol)
    elif isinstance(got, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_trees_close(g, w, **tol)
    elif isinstance(got, dict):
        for k in got:
            _assert_trees_close(got[k], want[k], **tol)


# --- opcheck ---------------------------------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stats", [True, False])
def test_opcheck_accumulate(device, stats):
    gen = torch.Generator().manual_seed(0)
    acc, offsets, grads = _accumulate_args(device, gen)
    found_inf = torch.zeros((), device=device) if stats else None
    sumsq = torch.zeros((), device=device) if stats else None
    torch.library.opcheck(OPS.accumulate_.default, (acc, offsets, grads, 0.5, False, found_inf, sumsq))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("fused", [True, False])
def test_opcheck_steps(device, algo, fused):
    """(sgd_plain: SGD without momentum, no momentum buffers)"""
    gen = torch.Generator().manual_seed(1)
    named = _step_args(algo, device, gen, fused=fused, lp=fused)
    op = getattr(OPS, f"{_op(algo).name}_").default
    torch.library.opcheck(op, _op_args(algo, named))


def _remainder_args(algo, device, gen, named):
    """_step_args' arguments in the remainder mode: bf16 params (the masters' high halves) and
    int16 remainders, no lp_params."""
    weights, remainders = zip(*(reference.split_master(p.clone()) for p in named["params"]))
    return {**named, "params": list(weights), "remainders": list(remainders), "lp_params": []}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", list(ALGOS))
def test_opcheck_remainder_steps(device, algo):
    """With remainders the kernels write the bf16 params and the remainders: the schema says so
    (opcheck fails on an undeclared mutation)."""
    gen = torch.Generator().manual_seed(11)
    named = _remainder_args(algo, device, gen, _step_args(algo, device, gen, fused=True, lp=False))
    op = getattr(OPS, f"{_op(algo).name}_").default
    torch.library.opcheck(op, _op_args(algo, named))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("remainder", [False, True])
def test_opcheck_split_step_ops(device, remainder):
    """Muon's prologue (momentum and the middle's input written, no weight) and epilogue (the
    middle's bf16 output read, one of them a transposed view; the weights written): each writes
    what its schema declares, and nothing else (opcheck fails on an undeclared mutation)."""
    gen = torch.Generator().manual_seed(12)
    split = ops.step_op("muon")
    _, hyper, _ = cases.op_records(cases.kernel_cases(split=True)["muon"])
    shapes = [(3, 5), (1, 7), (6, 2)]
    named = _step_args("sgd", device, gen, sizes=[r * c for r, c in shapes], fused=True, lp=not remainder)
    if remainder:
        named = _remainder_args("sgd", device, gen, named)
    t = ops.StepTensors(**{k: v for k, v in named.items() if k in ops.StepTensors._fields})
    buffers = [_randn(r * c, torch.float32, device, gen) for r, c in shapes]
    updates = [torch.zeros(s, device=device) for s in shapes]
    middle = [_randn(c * r, torch.bfloat16, device, gen).view(c, r).T for r, c in shapes]
    for op, states in ((split.prologue, (buffers, updates)), (split.epilogue, (middle,))):
        args = op.flatten(t, op.states(*states), hyper)
        torch.library.opcheck(getattr(OPS, f"{op.name}_").default, tuple(args))


def test_compiles_without_graph_break():
    """torch.compile traces the ops through their fake implementations (fullgraph: no break)."""
    gen = torch.Generator().manual_seed(3)
    named = _step_args("adam", "cpu", gen)
    named_ref = _clone_tree(named)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(t, s, h):
        ext.step(ops.adam_step, t, s, h)

    step(*ops.adam_step.records(**named))
    _step(reference, "adam", named_ref)
    _assert_trees_close(named, named_ref, **STEP_TOL)


# --- boundary checks -----------------------------------------------------------------------------


def _bad_accumulate(change):
    gen = torch.Generator().manual_seed(4)
    acc, offsets, grads = _accumulate_args(
        "cpu", gen, sizes=(4, 6), pad=64
    )  # slices at 0 and 64: the messages name them
    found_inf, sumsq = torch.zeros(()), torch.zeros(())
    kw = dict(acc=acc, offsets=offsets, grads=grads, found_inf=found_inf, sumsq=sumsq)
    change(kw)
    ext.accumulate(kw["acc"], kw["offsets"], kw["grads"], 1.0, False, kw["found_inf"], kw["sumsq"])


# The layout checks (offsets order, bounds, dtypes) are tested on every backend in test_kernels.py.
ACCUMULATE_ERRORS = {
    "acc dtype": (
        lambda kw: kw.__setitem__("acc", kw["acc"].double()),
        r"accumulate_: acc must be a 1-D contiguous float32 tensor \(the flat accumulator\), got Double",
    ),
    "lengths": (lambda kw: kw["grads"].pop(), r"offsets has 2 entries but grads has 1 tensors"),
    "grad overruns the next slice": (
        lambda kw: kw["grads"].__setitem__(0, torch.zeros(65)),
        r"offsets\[1\] is 64, before 65, where the previous slice ends",
    ),
    "grad dtype": (
        lambda kw: kw["grads"].__setitem__(1, torch.zeros(6, dtype=torch.int32)),
        r"grads\[1\] must be float32, bfloat16 or float16, got Int",
    ),
    "found_inf": (
        lambda kw: kw.__setitem__("found_inf", torch.zeros(2)),
        r"found_inf must be a one-element float32 tensor",
    ),
    "sumsq dtype": (
        lambda kw: kw.__setitem__("sumsq", torch.zeros((), dtype=torch.float64)),
        r"sumsq must be a one-element float32 tensor, got Double",
    ),
}


@pytest.mark.parametrize("case", list(ACCUMULATE_ERRORS))
def test_accumulate_rejects_bad_arguments_by_name(case):
    change, message = ACCUMULATE_ERRORS[case]
    with pytest.raises(RuntimeError, match=message):
        _bad_accumulate(change)


def _set(name, value):
    return lambda kw: kw.__setitem__(name, value)


STEP_ERRORS = {
    "state length": ("adam", lambda kw: kw["exp_avgs"].pop(), r"adam_step_: exp_avgs has 2 tensors but params has 3"),
    "state dtype": (
        "lion",
        lambda kw: kw["exp_avgs"].__setitem__(0, kw["exp_avgs"][0].bfloat16()),
        r"lion_step_: exp_avgs\[0\] must be float32, got BFloat16",
    ),
    "state numel": (
        "adam",
        lambda kw: kw["exp_avg_sqs"].__setitem__(2, torch.zeros(2)),
        r"exp_avg_sqs\[2\] has 2 elements but params\[2\] has 1",
    ),
    "momentum missing": (
        "sgd",
        _set("momentum_buffers", []),
        r"sgd_step_: momentum_buffers has 0 tensors but params has 3",
    ),
    "acc dtype": (
        "sgd",
        lambda kw: kw["accs"].__setitem__(0, kw["accs"][0].half()),
        r"accs\[0\] must be float32, got Half",
    ),
    "param dtype": (
        "adam",
        lambda kw: kw["params"].__setitem__(1, kw["params"][1].double()),
        r"params\[1\] must be float32, bfloat16 or float16, got Double",
    ),
    "steps shape": (
        "adam",
        _set("steps", torch.ones(2)),
        r"steps must be a contiguous 1-D float32 tensor of 3 step counts",
    ),
    "steps dtype": (
        "lion",
        _set("steps", torch.ones(3, dtype=torch.float64)),
        r"steps must be a contiguous 1-D float32 tensor",
    ),
    "lr dtype": (
        "adam",
        _set("lr", torch.tensor(0.1, dtype=torch.float16)),
        r"adam_step_: lr must be a one-element float64 or float32 tensor, got Half",
    ),
    "lr shape": (
        "lion",
        _set("lr", torch.ones(2, dtype=torch.float64)),
        r"lion_step_: lr must be a one-element float64 or float32 tensor, got Double of shape \[2\]",
    ),
    "coef shape": ("sgd", _set("coef", torch.ones(2)), r"coef must be a one-element float32 tensor"),
    "lp length": ("adam", lambda kw: kw["lp_params"].pop(), r"lp_params has 2 tensors, expected 0 \(none\) or 3"),
    "lp dtype": (
        "sgd",
        lambda kw: kw["lp_params"].__setitem__(0, torch.zeros(5, dtype=torch.int8)),
        r"lp_params\[0\] must be float32, bfloat16 or float16, got Char",
    ),
    "grads numel": (
        "lion",
        lambda kw: kw["grads"].__setitem__(1, torch.zeros(3)),
        r"grads\[1\] has 3 elements but params\[1\] has 300",
    ),
    "found_inf": (
        "adam",
        lambda kw: kw.__setitem__("found_inf", torch.zeros((), dtype=torch.bool)),
        r"found_inf must be a one-element float32 tensor, got Bool",
    ),
    "amsgrad length": (
        "adam_amsgrad",
        lambda kw: kw["max_exp_avg_sqs"].pop(),
        r"adam_step_: max_exp_avg_sqs has 2 tensors but params has 3",
    ),
    "amsgrad dtype": (
        "adam_amsgrad",
        lambda kw: kw["max_exp_avg_sqs"].__setitem__(1, kw["max_exp_avg_sqs"][1].half()),
        r"max_exp_avg_sqs\[1\] must be float32, got Half",
    ),
    "amsgrad numel": (
        "adam_amsgrad",
        lambda kw: kw["max_exp_avg_sqs"].__setitem__(0, torch.zeros(4)),
        r"max_exp_avg_sqs\[0\] has 4 elements but params\[0\] has 5",
    ),
}


@pytest.mark.parametrize("case", list(STEP_ERRORS))
def test_steps_reject_bad_arguments_by_name(case):
    algo, change, message = STEP_ERRORS[case]
    named = _step_args(algo, "cpu", torch.Generator().manual_seed(5))
    change(named)
    with pytest.raises(RuntimeError, match=message):
        _step(ext, algo, named)


def test_rejected_call_changes_nothing():
    """Checks run before any kernel: an error leaves every tensor as it was."""
    named = _step_args("adam", "cpu", torch.Generator().manual_seed(6))
    named["lp_params"][2] = torch.zeros(1, dtype=torch.int8)
    before = _clone_tree(named)
    with pytest.raises(RuntimeError, match=r"lp_params\[2\]"):
        _step(ext, "adam", named)
    _assert_trees_close(named, before, rtol=0, atol=0)


# --- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", list(ALGOS))
def test_strided_params_are_written_back(algo):
    """Params and low-precision copies that are transposed views (channels-last-like layouts) are
    updated in their logical element order, as the reference does."""
    gen = torch.Generator().manual_seed(7)
    named = _step_args(algo, "cpu", gen, sizes=(12, 35))
    named["params"] = [torch.randn(4, 3, generator=gen).t(), torch.randn(7, 5, generator=gen).t()]
    named["lp_params"] = [torch.zeros(4, 3, dtype=torch.bfloat16).t(), torch.zeros(7, 5, dtype=torch.float16).t()]
    assert not named["params"][0].is_contiguous()
    named_ref = _clone_tree(named)
    _step(ext, algo, named)
    _step(reference, algo, named_ref)
    _assert_trees_close(named, named_ref, **STEP_TOL)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_strided_remainders_and_params_are_written_back(algo):
    """A remainder that is a strided view (every other element of a buffer) and a transposed
    bf16 param: the binding copies both, the kernel updates the copies, both are written back,
    bit for bit the reference's (the remainder mode is exact on every backend)."""
    gen = torch.Generator().manual_seed(8)
    named = _step_args(algo, "cpu", gen, sizes=(12, 35), lp=False)
    masters = [torch.randn(4, 3, generator=gen).t(), torch.randn(35, generator=gen)]
    weights, remainders = [], []
    for i, master in enumerate(masters):
        w, r = reference.split_master(master.contiguous())
        weights.append(w if i else w.t().contiguous().t())  # transposed, like master
        buffer = torch.zeros(2 * master.numel(), dtype=torch.int16)
        buffer[::2] = r.reshape(-1)
        remainders.append(buffer[::2] if i else r.reshape(-1))
    named.update(params=weights, remainders=remainders)
    assert not weights[0].is_contiguous() and not remainders[1].is_contiguous()
    named_ref = _clone_tree(named)
    _step(ext, algo, named)
    _step(reference, algo, named_ref)
    for got, want in zip(named["params"] + named["remainders"], named_ref["params"] + named_ref["remainders"]):
        assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))


def test_empty_lists_and_zero_size_tensors():
    ext.accumulate(torch.zeros(0), torch.zeros(0, dtype=torch.int64), [], 1.0, False, None, None)
    acc = torch.ones(64)
    ext.accumulate(
        acc,
        torch.tensor([0, 3, 6]),
        [torch.zeros(0), torch.full((3,), 2.0, dtype=torch.bfloat16)] + [torch.zeros(0)],
        1.0,
        False,
        None,
        None,
    )
    assert acc[3:6].tolist() == [3.0] * 3 and acc[:3].tolist() == [1.0] * 3 and bool((acc[6:] == 1).all())
    gen = torch.Generator().manual_seed(8)
    named = _step_args("adam", "cpu", gen, sizes=(0, 17, 0))
    named_ref = _clone_tree(named)
    _step(ext, "adam", named)
    _step(reference, "adam", named_ref)
    _assert_trees_close(named, named_ref, **STEP_TOL)
    named = _step_args("lion", "cpu", gen, sizes=())
    _step(ext, "lion", named)  # nothing to do, and no error


@pytest.mark.skipif(
    shutil.which("nm") is None or not sys.platform.startswith("linux"), reason="needs nm (binutils), Linux"
)
def test_extension_is_built_with_openmp():
    """at::parallel_for is an inline template: without -fopenmp it compiles to a serial loop in
    _C, silently (issue 11: a second thread gave 1.07x). With it, _C calls libgomp."""
    symbols = subprocess.run(["nm", "-D", ext._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "GOMP_parallel" in symbols


def test_unavailable_reason_matches_the_build():
    assert ext.unavailable_reason("cpu") == ""
    assert (ext.unavailable_reason("cuda") == "") == bool(ext._C.built_with_cuda)


def test_package_works_without_the_extension():
    """With _C unimportable the package still imports, says why, and auto selection falls back."""
    code = (
        "import sys; sys.modules['fused_accum._C'] = None\n"  # makes `from fused_accum import _C` fail
        "import torch\n"
        "from fused_accum import backends\n"
        "why = backends.availability('cpu', 'cpu')\n"
        "assert why.startswith('fused_accum._C is not built'), why\n"
        "assert backends.resolve('auto', 'cpu') == 'reference'\n"
        "try:\n"
        "    backends.resolve('cpu', 'cpu')\n"
        "except RuntimeError as err:\n"
        "    assert 'not built' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('forcing an unbuilt backend must fail')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_no_ext_at_run_time_loads_no_extension():
    """FUSED_ACCUM_NO_EXT=1 when the package is imported: _C is built but not loaded (./run demo
    while the extension is older than its sources), and the hooks and the backend say so."""
    code = (
        "import sys\n"
        "from fused_accum import arrivals, backends, extension\n"
        "assert extension._C is None and extension.WHY_NOT.startswith('FUSED_ACCUM_NO_EXT=1'), extension.WHY_NOT\n"
        "assert backends.resolve('auto', 'cpu') == 'reference'\n"
        "assert 'fused_accum._C' not in sys.modules\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FUSED_ACCUM_NO_EXT="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _cuda_backends():
    assert torch.cuda.is_available(), "pytest -m gpu needs a CUDA device"
    why = backends.availability("cuda", "cuda")
    assert why == "", f"the CUDA extension must be built for the GPU run: {why}"
    return list(GPU_KERNEL_BACKENDS)  # cuda, and triton where it runs


@gpu
@pytest.mark.parametrize("algo", ["accumulate", *ALGOS])
def test_cuda_triton_and_reference_agree(algo):
    """The same inputs through every GPU backend and the reference: each matches the reference,
    and the kernel backends match each other (sizes up to 2^20 + 3, several chunks per tensor)."""
    names = _cuda_backends()
    gen = torch.Generator().manual_seed(9)
    sizes = (1, 4097, (1 << 20) + 3, 77)
    if algo == "accumulate":
        acc, offsets, grads = _accumulate_args("cuda", gen, sizes=sizes)
        inputs = dict(
            acc=acc,
            offsets=offsets,
            grads=grads,
            alpha=0.3,
            overwrite=False,
            found_inf=torch.zeros((), device="cuda"),
            sumsq=torch.zeros((), device="cuda"),
        )
        run = lambda m, x: m.accumulate(**x)  # noqa: E731
    else:
        inputs = _step_args(algo, "cuda", gen, sizes=sizes)
        run = lambda m, x: _step(m, algo, x)  # noqa: E731
    want = _clone_tree(inputs)
    run(reference, want)
    results = {}
    for name in names:
        got = _clone_tree(inputs)
        run(backends.get(name), got)
        _assert_trees_close(got, want, **STEP_TOL)
        results[name] = got
    if len(results) == 2:
        _assert_trees_close(results["cuda"], results["triton"], **STEP_TOL)


@gpu
def test_cuda_lists_longer_than_one_launch_table():
    """300 tensors of mixed dtypes and sizes: accumulate needs 3 launches (113 per table), a fused
    Adam step 6 (55 per table); every tensor must still be updated."""
    _cuda_backends()
    gen = torch.Generator().manual_seed(10)
    sizes = torch.randint(1, 5000, (300,), generator=gen).tolist()
    acc, offsets, grads = _accumulate_args("cuda", gen, sizes=sizes)
    want = acc.clone()
    ext.accumulate(acc, offsets, grads, 0.5, False, None, None)
    reference.accumulate(want, offsets, grads, 0.5, False, None, None)
    _assert_trees_close(acc, want, rtol=1e-6, atol=1e-6)
    named = _step_args("adam", "cuda", gen, sizes=sizes)
    named_ref = _clone_tree(named)
    _step(ext, "adam", named)
    _step(reference, "adam", named_ref)
    _assert_trees_close(named, named_ref, **STEP_TOL)


@gpu
def test_cuda_tensor_of_more_than_2_31_elements():
    """int64 sizes: 2^31 + 37 elements (8.6 GB fp32 acc + 4.3 GB bf16 grad)."""
    _cuda_backends()
    n = (1 << 31) + 37
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GB of free GPU memory")
    acc = torch.full((n,), 0.5, device="cuda")
    grad = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    tail = torch.randn(100, generator=torch.Generator().manual_seed(11)).to("cuda", torch.bfloat16)
    grad[-100:] = tail
    sumsq = torch.zeros((), device="cuda")
    ext.accumulate(acc, torch.zeros(1, dtype=torch.int64), [grad], 2.0, False, None, sumsq)
    torch.testing.assert_close(acc[-100:], 0.5 + 2.0 * tail.float())
    assert bool((acc[:-100] == 2.5).all())
    want = 6.25 * (n - 100) + float(((0.5 + 2.0 * tail.float()) ** 2).sum())
    # fp32 atomics over 131K block sums: ~1e-5 relative in practice, 1e-3 allowed
    assert abs(sumsq.item() - want) <= 1e-3 * want


@gpu
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32])
def test_cuda_step_captures_in_a_graph_and_reads_lr_on_device(lr_dtype):
    """No host sync: the step captures into a CUDA graph, and a replay reads the current lr. Also
    with a float32 lr, which the binding widens to float64 by a copy that the graph captures."""
    _cuda_backends()
    gen = torch.Generator().manual_seed(12)
    named = _step_args("adam", "cuda", gen, sizes=(1000, 33))
    named["lr"] = lr = named["lr"].to(lr_dtype)
    start = _clone_tree(named)
    _step(ext, "adam", named)  # warm-up (loads the kernel) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if the op synchronises with the host
        _step(ext, "adam", named)
    # Restore the inputs the warm-up changed, change lr, replay.
    for dst, src in zip(torch.utils._pytree.tree_leaves(named), torch.utils._pytree.tree_leaves(start)):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    lr.fill_(0.05)
    graph.replay()
    torch.cuda.synchronize()
    named_ref = _clone_tree(start)
    named_ref["lr"].fill_(0.05)
    _step(reference, "adam", named_ref)
    _assert_trees_close(named, named_ref, **STEP_TOL)


@gpu
def test_cuda_rejects_mixed_devices_by_name():
    _cuda_backends()
    acc, offsets, grads = _accumulate_args("cuda", torch.Generator().manual_seed(13))
    grads[1] = grads[1].cpu()
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on cpu, expected cuda:0"):
        ext.accumulate(acc, offsets, grads, 1.0, False, None, None)
    with pytest.raises(RuntimeError, match=r"offsets must be a 1-D int64 CPU tensor"):
        ext.accumulate(acc, offsets.cuda(), grads, 1.0, False, None, None)
    named = _step_args("sgd", "cuda", torch.Generator().manual_seed(14))
    named["lr"] = named["lr"].cpu()
    with pytest.raises(RuntimeError, match=r"sgd_step_: lr is on cpu, expected cuda:0"):
        _step(ext, "sgd", named)


def test_addresses_and_dtypes_reads_what_python_reads():
    # The Triton backend keys its launch plans by this (fused_accum/backends/triton/plans.py): equal
    # reads must mean equal addresses and dtypes, and a changed dtype a changed read.
    import numpy as np

    base = torch.randn(300)
    tensors = [base[5:40], torch.randn(7, dtype=torch.bfloat16), torch.randn(3, 4).t(), torch.randn(1).half()]
    pairs = np.frombuffer(ext._C.addresses_and_dtypes(tensors), dtype=np.int64).reshape(-1, 2)
    assert pairs[:, 0].tolist() == [t.data_ptr() for t in tensors]
    codes = pairs[:, 1].tolist()
    assert codes[0] == codes[2] and len({codes[0], codes[1], codes[3]}) == 3  # fp32, bf16, fp16
    with pytest.raises(TypeError):  # not a tensor: refused at the binding
        ext._C.addresses_and_dtypes([None])
