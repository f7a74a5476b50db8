"""GPU-only checks of issue 10's kernel items, for benchmarks/device_check.sh (``pytest -m gpu``).

Nothing here runs without CUDA (every test is marked ``gpu`` and skips without a device): these
are the checks that need real kernels, streams and graphs.

- item 1: Triton tables stay alive for a captured graph: capture (one table hit from a warm-up,
  one built during capture), evict the LRU and churn memory, replay on new data, compare;
- item 3: the CUDA sum of squares is bit-identical across runs (no float atomics), and close to
  the reference;
- items 6, 7: CUDA lists longer than one 32 KB table (2,050 tensors), odd sizes, gradients at odd
  offsets next to aligned operands, against the reference;
- item 8: one compiled Triton variant per constexpr configuration, whatever the alignment of the
  scalars and tables and the tensor count;
- amsgrad on CUDA; the CUDA ops captured in a graph and replayed on new data.

Data: fresh random values (never zeros), outputs poisoned with NaN before the call; tolerances
are stated where used.
"""

from __future__ import annotations

import functools

import pytest
import torch

import cases  # tests/cases.py: every algorithm and its step-op cases
from fused_accum import backends, ops
from fused_accum.backends import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = "cuda"
PAD = 64
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
# fp32 step results: the kernels place the reference's FMAs (tl.fma / fmaf, no contraction), so
# differences come from beta**step (fp64 pow vs squaring, ~1e-16 before rounding) and from the
# CUDA build's -fmad setting: 1e-5 relative is test_kernels.py's STEP_TOL, ~80 ulp of room.
STEP_TOL = dict(rtol=1e-5, atol=1e-6)
# a sum of squares summed in another order than the reference's per-slice dot: ~n*eps relative
NORM_TOL = dict(rtol=2e-5, atol=0.0)
# accumulate = grad * alpha, then + acc: Triton rounds twice like the reference (contraction off:
# bit-identical); nvcc contracts the two into one FMA unless the build passes -fmad=false, which
# moves a result by at most 1 ulp (2**-23 relative; 1.2e-7) - and by nothing once it does.
ACC_TOL = {"triton": dict(rtol=0.0, atol=0.0), "cuda": dict(rtol=1.2e-7, atol=1e-30)}


def _adam(module, params, m, v, accs, steps, lr, coef, **named):
    """module's adam_step on these lists; the other arguments by name (HYPER's too)."""
    records = ops.adam_step.records(
        params=params, exp_avgs=m, exp_avg_sqs=v, accs=accs, steps=steps, lr=lr, coef=coef, **named
    )
    module.step(ops.adam_step, *records)


def _backend(name):
    why = backends.availability(name, "cuda")
    if why:
        pytest.skip(f"{name} backend unavailable on cuda: {why}")
    return backends.get(name)


def _flat(sizes, gen):
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + PAD - 1) // PAD * PAD
    flat = torch.randn(total, generator=gen).to(DEV)
    return flat, torch.tensor(offsets, dtype=torch.int64), [flat[o : o + n] for o, n in zip(offsets, sizes)]


def _odd_views(sizes, gen, dtype=torch.bfloat16):
    """Gradients, every third one a view at an odd element offset (not 16-byte aligned)."""
    out = []
    for i, n in enumerate(sizes):
        if i % 3 == 1:
            out.append(torch.randn(n + 1, generator=gen).to(DEV, dtype)[1:])
        else:
            out.append(torch.randn(n, generator=gen).to(DEV, dtype))
    return out


# --- item 1: Triton under CUDA-graph capture -------------------------------------------------


def test_triton_graph_replays_after_the_table_cache_is_evicted():
    tb = _backend("triton")
    gen = torch.Generator().manual_seed(1)
    sizes = [1, 127, 4099, 1 << 16, 3]
    flat, offsets, accs = _flat(sizes, gen)
    grads = _odd_views(sizes, gen)
    params = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    m = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    v = [torch.rand(n, generator=gen).to(DEV) for n in sizes]
    lp = [p.to(torch.bfloat16) for p in params]  # (their masters' rounding, as the optimizer keeps them)
    steps = torch.full((len(sizes),), 4.0, device=DEV)
    lr, coef = torch.tensor(1e-3, device=DEV), torch.tensor(0.5, device=DEV)
    found_inf, sumsq = torch.zeros((), device=DEV), torch.zeros((), device=DEV)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, and builds the accumulate table (a hit later)
        tb.accumulate(flat, offsets, grads, 0.5, False, found_inf, sumsq)
        # Every kernel variant the capture launches is launched eagerly first: Triton loads a
        # variant's module on its first launch, which the driver refuses inside a capture. The
        # step's variant (its dtypes and flags) runs here on copies at other addresses, so its
        # table is still a miss in the capture below, as the test intends.
        _adam(
            tb,
            [p.clone() for p in params],
            [x.clone() for x in m],
            [x.clone() for x in v],
            accs,
            steps,
            lr,
            coef,
            lp_params=[x.clone() for x in lp],
            found_inf=found_inf.clone(),
            **HYPER,
        )
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tb.accumulate(flat, offsets, grads, 0.5, False, found_inf, sumsq)  # table: a cache hit
        # the step's table is built during capture (a miss on this stream): copy recorded
        _adam(tb, params, m, v, accs, steps, lr, coef, lp_params=lp, found_inf=found_inf, **HYPER)
    assert len(tb._captured) >= 2

    # evict: 70 other tables through the 64-entry LRU, then reuse freed memory with junk
    other_flat, other_offsets, _ = _flat([33] * 3, gen)
    for i in range(70):
        tb.accumulate(other_flat, other_offsets, [torch.randn(33 - i % 30, device=DEV) for _ in range(3)], 1.0, False)
    tb.clear_table_cache()
    junk = [torch.full((1 << 18,), 12345.0, device=DEV) for _ in range(64)]
    del junk

    # new inputs in the graph's static tensors, then replay against the reference on copies
    for t in [flat, *grads, *params, *m]:
        t.copy_(torch.randn(t.shape, generator=gen).to(DEV, t.dtype))
    for t in v:
        t.copy_(torch.rand(t.shape, generator=gen).to(DEV))
    for t in lp:
        t.fill_(float("nan"))
    sumsq.fill_(0.25)
    found_inf.zero_()
    want = dict(
        flat=flat.clone(),
        params=[p.clone() for p in params],
        m=[x.clone() for x in m],
        v=[x.clone() for x in v],
        lp=[x.clone() for x in lp],
        sumsq=sumsq.clone(),
        found_inf=found_inf.clone(),
    )
    want_accs = [want["flat"][o : o + n] for o, n in zip(offsets.tolist(), sizes)]
    reference.accumulate(want["flat"], offsets, grads, 0.5, False, want["found_inf"], want["sumsq"])
    _adam(
        reference,
        want["params"],
        want["m"],
        want["v"],
        want_accs,
        steps,
        lr,
        coef,
        lp_params=want["lp"],
        found_inf=want["found_inf"],
        **HYPER,
    )
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(flat, want["flat"], **ACC_TOL["triton"])
    torch.testing.assert_close(sumsq, want["sumsq"], **NORM_TOL)
    for got, exp in zip(params + m + v, want["params"] + want["m"] + want["v"]):
        torch.testing.assert_close(got, exp, **STEP_TOL)
    for got, exp in zip(lp, want["lp"]):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.float(), exp.float(), rtol=8e-3, atol=1e-6)  # 1 bf16 ulp
    assert tb.release_captured_tables() >= 2
    del graph


# --- item 8: one Triton variant per configuration --------------------------------------------


def _variants(kernel):
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # triton >= 3.2: {device: (kernel cache, target, backend, binder)}
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def _forget_variants(kernel):
    """Drop the compiled variants (other tests in this process compiled their own)."""
    caches = getattr(kernel, "device_caches", None)
    (caches if caches is not None else kernel.cache).clear()


def test_triton_compiles_one_accumulate_variant_whatever_the_alignment():
    tb = _backend("triton")
    k = tb.kernels
    _forget_variants(k.accumulate_kernel)
    _forget_variants(k.reduce_stats_kernel)
    gen = torch.Generator().manual_seed(2)
    stats = torch.zeros(8, device=DEV)
    calls = 0
    for count in (1, 2, 3, 16, 17):
        for shift in (0, 1, 2, 3):
            sizes = [5 + 3 * i for i in range(count)]
            flat, offsets, _ = _flat(sizes, gen)
            grads = [torch.randn(n, generator=gen).to(DEV, torch.bfloat16) for n in sizes]
            # found_inf and sumsq as views at 4-byte offsets: alignments 4, 8, 12, 16
            tb.accumulate(
                flat,
                offsets,
                grads,
                1.0,
                False,
                stats[shift : shift + 1].view(()),
                stats[4 + shift : 5 + shift].view(()),
            )
            calls += 1
    torch.cuda.synchronize()
    assert calls == 20
    assert _variants(k.accumulate_kernel) == 1  # bf16, add, stats: one configuration
    assert _variants(k.reduce_stats_kernel) == 1


# --- item 3: deterministic norm ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_sum_of_squares_is_bit_identical_across_runs(name):
    """4M elements in ~1,000 blocks: a float atomicAdd order changes between runs and moves the
    last bits; per-block partials reduced in a fixed order do not."""
    be = _backend(name)
    gen = torch.Generator().manual_seed(3)
    sizes = [1 << 22, 4099, 1]
    flat, offsets, _ = _flat(sizes, gen)
    grads = [torch.randn(n, generator=gen).to(DEV, torch.bfloat16) for n in sizes]
    results = []
    for _ in range(10):
        sumsq = torch.zeros((), device=DEV)
        be.accumulate(flat, offsets, grads, 0.75, True, None, sumsq)  # overwrite: same acc each run
        results.append(sumsq.item())
    assert len(set(results)) == 1, results
    want = torch.zeros((), device=DEV)
    reference.accumulate(flat.clone(), offsets, grads, 0.75, True, None, want)
    torch.testing.assert_close(torch.tensor(results[0]), want.cpu(), **NORM_TOL)


# --- items 6, 7 and amsgrad on CUDA ----------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_accumulate_2050_tensors_odd_sizes_and_offsets(name):
    """More tensors than one 32 KB CUDA table holds (932), sizes 1 to primes past a chunk,
    every third gradient misaligned: per-operand vector decisions, scalar tails."""
    be = _backend(name)
    gen = torch.Generator().manual_seed(4)
    sizes = [1 + (i * 7919) % 5003 for i in range(2050)]
    flat, offsets, _ = _flat(sizes, gen)
    want = flat.clone()
    grads = _odd_views(sizes, gen)
    found_inf, sumsq = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    ref_inf, ref_sumsq = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    be.accumulate(flat, offsets, grads, -0.5, False, found_inf, sumsq)
    reference.accumulate(want, offsets, grads, -0.5, False, ref_inf, ref_sumsq)
    torch.testing.assert_close(flat, want, **ACC_TOL[name])
    assert found_inf.item() == 0.0
    torch.testing.assert_close(sumsq, ref_sumsq, **NORM_TOL)


@pytest.mark.parametrize("name", ["cuda", "triton"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_500_tensors_fused_with_misaligned_grads(name, amsgrad):
    """More tensors than one CUDA step table (459; 407 with amsgrad), the fused last
    micro-batch with misaligned bf16 gradients, odd sizes, amsgrad on and off."""
    be = _backend(name)
    gen = torch.Generator().manual_seed(5)
    sizes = [1 + (i * 613) % 2053 for i in range(500)]
    params = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    m = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    v = [torch.rand(n, generator=gen).to(DEV) for n in sizes]
    vmax = [x + torch.rand(x.shape, generator=gen).to(DEV) * (i % 2) for i, x in enumerate(v)] if amsgrad else []
    # the bf16 copies are their masters' rounding, as the optimizer keeps them (the step reads
    # them and restarts a master whose copy is not: a weight written from outside)
    lp = [p.to(torch.bfloat16) for p in params]
    _, _, accs = _flat(sizes, gen)
    grads = _odd_views(sizes, gen)
    steps = torch.arange(1, len(sizes) + 1, dtype=torch.float32, device=DEV)
    lr, coef = torch.tensor(2e-3, device=DEV), torch.tensor(0.5, device=DEV)
    want = [[t.clone() for t in ts] for ts in (params, m, v, vmax, lp)]
    extra = dict(max_exp_avg_sqs=vmax) if amsgrad else {}
    _adam(be, params, m, v, accs, steps, lr, coef, lp_params=lp, grads=grads, grad_alpha=0.25, **extra, **HYPER)
    _adam(
        reference,
        want[0],
        want[1],
        want[2],
        accs,
        steps,
        lr,
        coef,
        lp_params=want[4],
        grads=grads,
        grad_alpha=0.25,
        **(dict(max_exp_avg_sqs=want[3]) if amsgrad else {}),
        **HYPER,
    )
    for got_list, want_list in zip((params, m, v, vmax), want[:4]):
        for got, exp in zip(got_list, want_list):
            torch.testing.assert_close(got, exp, **STEP_TOL)
    for got, exp in zip(lp, want[4]):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.float(), exp.float(), rtol=8e-3, atol=1e-6)  # 1 bf16 ulp


def test_cuda_ops_replay_in_a_graph_on_new_data():
    """The CUDA ext's ops in a graph: tables are kernel parameters (captured by value), the norm
    workspace comes from the graph's pool, lr/steps/found_inf are read on the device."""
    be = _backend("cuda")
    gen = torch.Generator().manual_seed(6)
    sizes = [7, 4096, 1 << 15, 1]
    flat, offsets, accs = _flat(sizes, gen)
    grads = _odd_views(sizes, gen)
    params = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    m = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    v = [torch.rand(n, generator=gen).to(DEV) for n in sizes]
    steps = torch.full((len(sizes),), 2.0, device=DEV)
    lr, coef = torch.tensor(1e-3, device=DEV), torch.tensor(1.0, device=DEV)
    found_inf, sumsq = torch.zeros((), device=DEV), torch.zeros((), device=DEV)

    def window():
        be.accumulate(flat, offsets, grads, 1.0, False, found_inf, sumsq)
        _adam(be, params, m, v, accs, steps, lr, coef, found_inf=found_inf, **HYPER)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        window()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        window()
    for t in [flat, *grads, *params, *m]:
        t.copy_(torch.randn(t.shape, generator=gen).to(DEV, t.dtype))
    for t in v:
        t.copy_(torch.rand(t.shape, generator=gen).to(DEV))
    lr.fill_(3e-3)  # a new lr reaches the replay: it is read on the device
    steps.fill_(9.0)
    sumsq.zero_()
    want_flat, want_p, want_m, want_v = (
        flat.clone(),
        [p.clone() for p in params],
        [x.clone() for x in m],
        [x.clone() for x in v],
    )
    want_sumsq, want_inf = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    want_accs = [want_flat[o : o + n] for o, n in zip(offsets.tolist(), sizes)]
    reference.accumulate(want_flat, offsets, grads, 1.0, False, want_inf, want_sumsq)
    _adam(reference, want_p, want_m, want_v, want_accs, steps, lr, coef, found_inf=want_inf, **HYPER)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(flat, want_flat, **ACC_TOL["cuda"])
    torch.testing.assert_close(sumsq, want_sumsq, **NORM_TOL)
    for got, exp in zip(params + m + v, want_p + want_m + want_v):
        torch.testing.assert_close(got, exp, **STEP_TOL)


# --- issue 28: exact 2-byte masters on the GPU ------------------------------------------------


def _bits32(x):
    return x.contiguous().view(torch.int32)


def _bits16(x):
    return x.reshape(-1).contiguous().view(torch.int16)


def _first_difference(got, want, sizes, what):
    """Where two concatenations of ``len(sizes)``-tensor lists (repeated) first differ: the
    failure message's "tensor i, element j" (only run once a check has failed)."""
    at = int((got != want).nonzero()[0])
    cumulative = 0
    for part in range(len(got) // sum(sizes)):
        for i, n in enumerate(sizes):
            if at < cumulative + n:
                names = what[part] if part < len(what) else f"list {part}"
                return f"{names} of tensor {i}, element {at - cumulative}: {int(got[at]):#x} != {int(want[at]):#x}"
            cumulative += n
    return f"element {at}"


@pytest.mark.parametrize("name", ["cuda", "triton"])
@pytest.mark.parametrize("algo", list(cases.per_update_rule()))
def test_remainder_steps_500_tensors_bit_for_bit_with_fp32_masters(name, algo):
    """The remainder mode (bf16 params + int16 remainders) against the same backend's
    fp32-master mode: 500 tensors (more than a CUDA step table), odd sizes, every fourth param
    and every fifth remainder a view at an odd element offset (their packs go element by
    element, the others as 16-byte loads: 8 bf16 / 8 int16 on CUDA, 8 bytes per 4 on Triton),
    misaligned fused gradients, 20 steps with a skipped one: the rebuilt masters and the states
    are bit for bit the fp32 mode's after every step, the weights and remainders split_master's.
    (tests/test_kernels.py runs the 1,000-step awkward-data matrix on CUDA too, under -m gpu.)

    Checked on concatenations, a few ops and two host syncs per step (per-tensor checks were
    ~975k aten ops and 50k syncs a case, 40-65 s on a GPU for the eight: issue 34): the rebuild
    and the split are elementwise, so one of each over every tensor's elements at once is the
    per-tensor check, and a failure still names the tensor and element that differ."""
    be = _backend(name)
    gen = torch.Generator().manual_seed(28)
    sizes = [1 + (i * 613) % 2053 for i in range(500)]
    masters = [(torch.randn(n, generator=gen) * 10.0 ** float(i % 7 - 3)).to(DEV) for i, n in enumerate(sizes)]

    def at_offset(t, odd):  # a copy of t, at an odd element offset of its storage when asked
        if not odd:
            return t.clone()
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEV)
        base[1:].copy_(t)
        return base[1:]

    weights, remainders = [], []
    for i, master in enumerate(masters):
        w, r = reference.split_master(master)
        weights.append(at_offset(w, i % 4 == 1))
        remainders.append(at_offset(r, i % 5 == 2))
    op, hyper, keys = cases.op_records(cases.kernel_cases()[algo])  # (each update rule once: tests/cases.py)
    n_states = len(keys)
    states = [[torch.rand(n, generator=gen).to(DEV) for n in sizes] for _ in range(n_states)]
    states_r = [[x.clone() for x in s] for s in states]
    lp = [m.to(torch.bfloat16) for m in masters]  # (their masters' rounding, as the optimizer keeps them)
    acc_flat, _, accs = _flat(sizes, gen)
    # the fused gradients: views of one buffer refilled per step, every third at an odd element
    # offset (not 16-byte aligned), the others at 64-element (128-byte) boundaries
    grad_offsets, total = [], 0
    for i, n in enumerate(sizes):
        grad_offsets.append(total + (i % 3 == 1))
        total += (n + 1 + PAD - 1) // PAD * PAD
    grad_flat = torch.empty(total, device=DEV, dtype=torch.bfloat16)
    grad_views = [grad_flat[o : o + n] for o, n in zip(grad_offsets, sizes)]
    fp32_lists = ["master"] + [f"state {j}" for j in range(n_states)]
    for k in range(20):
        acc_flat.copy_(torch.randn(acc_flat.numel(), generator=gen))
        grads = []
        if k % 2:
            grad_flat.copy_(torch.randn(total, generator=gen))
            grads = grad_views
        steps = torch.full((len(sizes),), float(k + 1), device=DEV)
        lr = torch.tensor(1e-3, dtype=torch.float64, device=DEV)
        coef = torch.tensor(0.5, device=DEV)
        found_inf = torch.tensor(float(k == 13), device=DEV)
        common = dict(accs=accs, steps=steps, lr=lr, coef=coef, grads=grads, grad_alpha=0.25, found_inf=found_inf)
        before = torch.cat(weights) if k == 13 else None
        be_call = functools.partial(be.step, op)
        be_call(ops.StepTensors(params=masters, lp_params=lp, **common), op.states(*states), hyper)
        be_call(ops.StepTensors(params=weights, remainders=remainders, **common), op.states(*states_r), hyper)
        # every tensor's bits at once: the fp32 mode's masters and states against the rebuilt
        # masters and the remainder mode's states; the weights and remainders against the split
        # of the fp32 masters (bf16 and int16 bits side by side, as int16)
        weight_cat, remainder_cat, master_cat = torch.cat(weights), torch.cat(remainders), torch.cat(masters)
        want = torch.cat([master_cat] + [x for s in states for x in s]).view(torch.int32)
        got = torch.cat([reference.rebuild_master(weight_cat, remainder_cat)] + [x for s in states_r for x in s])
        got = got.view(torch.int32)
        assert torch.equal(got, want), f"step {k}: " + _first_difference(got, want, sizes, fp32_lists)
        split_w, split_r = reference.split_master(master_cat)
        want16 = torch.cat([split_w.view(torch.int16), split_r])
        got16 = torch.cat([weight_cat.view(torch.int16), remainder_cat])
        assert torch.equal(got16, want16), f"step {k}: " + _first_difference(
            got16, want16, sizes, ["weight", "remainder"]
        )
        if k == 13:  # the skipped step wrote no weight
            assert torch.equal(weight_cat.view(torch.int16), before.view(torch.int16)), "step 13 (skipped)"
