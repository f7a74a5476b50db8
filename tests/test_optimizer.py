"""FusedAccumOptimizer's contract: k micro-batches through it equal one k-times larger batch
through torch.optim, and everything a trainer touches (schedulers, clipping, GradScaler,
state_dict, pickling, errors) behaves as with a torch optimizer.

Parametrised over every backend available in the process: ``reference`` always, ``cpu`` when
the C++ extension is built, ``triton`` under ``TRITON_INTERPRET=1`` (its own process).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fused_accum
from fused_accum import FusedAccumOptimizer
from helpers import CPU_BACKENDS, GPU_BACKENDS  # tests/helpers.py
import cases  # tests/cases.py: every algorithm, its peer, its cases

# fp32 parameters and state after 3 steps: the accumulated gradient sums k micro-batch
# gradients where torch sums one batch in another order (a few ulp, ~1e-7 relative), and
# Adam/RMSprop amplify that where they divide by a small second moment (RMSprop's first
# update is ~10*sign(g): measured 4.6e-5 relative on one momentum element of 72). 1e-4
# relative / 1e-5 absolute on O(0.1) values keeps a 100x margin below a real bug (a missing
# 1/k, a wrong bias correction or decay: errors >= 1e-3).
TOL = dict(rtol=1e-4, atol=1e-5)


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)


def batches(n_steps, k, micro, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(micro, 6, generator=gen, dtype=dtype), torch.randn(micro, 3, generator=gen, dtype=dtype))
            for _ in range(k)
        ]
        for _ in range(n_steps)
    ]


def mse_mean(model, x, y):
    return ((model(x) - y) ** 2).mean()


# Every case of every algorithm (tests/cases.py: its peer, torch's class or an independent
# implementation), and the generic path.
ALGOS = {c.id: (c.algorithm, c.peer, c.kwargs) for c in cases.cases(cases.FP32, every=True)}
ALGOS["generic_rmsprop"] = (torch.optim.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5))


def run_pair(algo, backend, k, windows, partial_last=None):
    """Train twin models: ours with k micro-batches per step, torch's with one large batch."""
    ours_name, torch_cls, hyper = ALGOS[algo]
    ours, big = make_model(), make_model()
    opt = FusedAccumOptimizer(ours.parameters(), ours_name, accum_steps=k, backend=backend, **hyper)
    ref = torch_cls(big.parameters(), **hyper)
    data = batches(windows, k, micro=3)
    if partial_last is not None:
        data[-1] = data[-1][:partial_last]
    for window in data:
        n = len(window)
        for x, y in window:
            (mse_mean(ours, x, y) / n).backward()  # loop A, normalised by the window's size
        opt.step()
        opt.zero_grad()
        x = torch.cat([x for x, _ in window])
        y = torch.cat([y for _, y in window])
        mse_mean(big, x, y).backward()
        ref.step()
        ref.zero_grad()
    return ours, big, opt, ref


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_k_microbatches_equal_one_large_batch(backend, algo, k):
    ours, big, opt, ref = run_pair(algo, backend, k, windows=3)
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    saved = opt.state_dict()["state"]
    for i, q in enumerate(big.parameters()):  # optimizer state too, under torch's names
        theirs, mine = ref.state[q], saved.get(i, {})  # (SGD without momentum keeps none)
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch.testing.assert_close(mine[key], value, **TOL)
            elif key == "step":
                assert float(mine[key]) == float(value)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", ["sgd_momentum", "adamw", "generic_rmsprop"])
def test_partial_last_window(backend, algo):
    ours, big, _, _ = run_pair(algo, backend, k=4, windows=3, partial_last=3)
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", ["sgd_momentum", "adamw"])
def test_unequal_microbatches_with_num_items(backend, algo):
    """Sum-reduced loss over micro-batches of 1, 5 and 2 items; step(num_items=8) divides once."""
    ours_name, torch_cls, hyper = ALGOS[algo]
    ours, big, naive = make_model(), make_model(), make_model()
    opt = FusedAccumOptimizer(ours.parameters(), ours_name, backend=backend, **hyper)
    opt_naive = FusedAccumOptimizer(naive.parameters(), ours_name, backend=backend, **hyper)
    ref = torch_cls(big.parameters(), **hyper)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        sizes = [1, 5, 2]
        xs = [torch.randn(n, 6, generator=gen) for n in sizes]
        ys = [torch.randn(n, 3, generator=gen) for n in sizes]
        for x, y in zip(xs, ys):
            ((ours(x) - y) ** 2).mean(dim=1).sum().backward()
            ((naive(x) - y) ** 2).mean(dim=1).mean().div(len(sizes)).backward()  # mean of means
        opt.step(num_items=torch.tensor(float(sum(sizes))))
        opt_naive.step()
        opt.zero_grad()
        opt_naive.zero_grad()
        mse_mean(big, torch.cat(xs), torch.cat(ys)).backward()
        ref.step()
        ref.zero_grad()
    for p, q, r in zip(ours.parameters(), big.parameters(), naive.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    # and the mean of per-micro-batch means is measurably not the large batch
    assert any((r - q).abs().max() > 1e-4 for r, q in zip(naive.parameters(), big.parameters()))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", cases.params(cases.BF16_MASTERS))
def test_bf16_with_fp32_masters_stays_nearer_to_fp32_than_the_peer_stepping_bf16(backend, case):
    """Each algorithm's default case, 40 steps from one start with the same gradients (both
    bf16 values, so every run sees the same numbers): our bf16 parameters with fp32 masters are
    the fp32 run's parameters rounded to bf16, bit for bit (the masters step as fp32 parameters
    do), and so nearer to them than the peer (its torch.optim class, or the independent
    implementation) stepping the bf16 parameters themselves, which rounds every update into a
    bf16 weight and accumulates those roundings."""
    gen = torch.Generator().manual_seed(7)
    sizes = (64, 257)
    start = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    grads = [[torch.randn(n, generator=gen).bfloat16() for n in sizes] for _ in range(40)]

    def run(make, dtype):
        params = [nn.Parameter(p.to(dtype, copy=True)) for p in start]  # (never start itself: it is bf16)
        opt = make(params)
        for step_grads in grads:
            sum((p.float() * g.float()).sum() for p, g in zip(params, step_grads)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().float() for p in params])

    fp32 = run(lambda ps: case.make(ps, backend=backend), torch.float32)
    ours = run(lambda ps: case.make(ps, backend=backend, master_weights=True), torch.bfloat16)
    peer = run(lambda ps: case.peer(ps, **case.kwargs), torch.bfloat16)
    assert torch.equal(ours, fp32.bfloat16().float())
    assert (ours - fp32).norm() < (peer - fp32).norm(), ((ours - fp32).norm(), (peer - fp32).norm())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_accumulation_is_closer_to_fp64_than_bf16_grad_accumulation(backend):
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    opt = FusedAccumOptimizer(model.parameters(), "sgd", lr=0.1, backend=backend)
    exact = torch.zeros(64, 64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(32):
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        plain(x).float().pow(2).mean().backward()  # torch's bf16 .grad accumulation
        # the exact sum of the same bf16 micro-batch gradients, in fp64
        grad = torch.autograd.grad(plain(x).float().pow(2).mean(), plain.weight)[0]
        exact += grad.double()
    ours_err = (opt.accumulated_grad(model.weight).double() - exact).norm() / exact.norm()
    bf16_err = (plain.weight.grad.double() - exact).norm() / exact.norm()
    # fp32 sums of 32 bf16 terms are nearly exact (~1e-7); bf16 sums lose ~2^-9 per add.
    assert ours_err < 1e-5
    assert bf16_err > 30 * ours_err, (bf16_err, ours_err)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_onecycle_scheduler_drives_lr_and_betas(backend):
    ours, big = make_model(), make_model()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, backend=backend)
    ref = torch.optim.AdamW(big.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.05, total_steps=6)
    betas_seen = set()
    for window in batches(5, 2, micro=4):
        for x, y in window:
            (mse_mean(ours, x, y) / 2).backward()
        opt.step()
        opt.zero_grad()
        mse_mean(big, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])).backward()
        ref.step()
        ref.zero_grad()
        sched.step()
        ref_sched.step()
        betas_seen.add(opt.param_groups[0]["betas"][0])
    assert len(betas_seen) > 2  # OneCycleLR really cycled beta1 through our param_groups
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_shows_the_running_sum_after_every_backward(backend):
    """As native accumulation: after each backward .grad is the fp32 sum so far, whatever
    accum_steps says (it only enables fusions), so a trainer's clipping is right for any window."""
    model = make_model()
    opt = fused_accum.SGD(model.parameters(), lr=0.1, accum_steps=3, backend=backend)
    data = batches(1, 3, micro=2)[0]
    expect = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in data:
        loss = mse_mean(model, x, y)
        for e, g in zip(expect, torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)):
            e += g
        loss.backward()
        for p, e in zip(model.parameters(), expect):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.accumulated_grad(p), e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_exposed_every_backward_without_accum_steps_is_not_counted_twice(backend):
    """With accum_steps=None .grad is exposed after each backward; the next backward must not
    let autograd add into it natively (that would count the earlier micro-batches twice)."""
    model = make_model()
    opt = fused_accum.SGD(model.parameters(), lr=0.1, backend=backend)
    expect = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in batches(1, 4, micro=2)[0]:
        loss = mse_mean(model, x, y)
        for e, g in zip(expect, torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)):
            e += g
        loss.backward()
        for p, e in zip(model.parameters(), expect):
            torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
    assert opt.microbatches == 4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_clip_grad_norm_at_window_end(backend):
    ours, big = make_model(), make_model()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, backend=backend)
    ref = torch.optim.AdamW(big.parameters(), lr=1e-2)
    for window in batches(3, 2, micro=4):
        for x, y in window:
            (mse_mean(ours, x, y) / 2).backward()
        norm = nn.utils.clip_grad_norm_(ours.parameters(), max_norm=0.05)
        opt.step()
        opt.zero_grad()
        mse_mean(big, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])).backward()
        ref_norm = nn.utils.clip_grad_norm_(big.parameters(), max_norm=0.05)
        ref.step()
        ref.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        assert norm > 0.05  # the clip really scaled the gradient
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_scaler_unscales_and_skips_on_inf(backend):
    ours, big = make_model(), make_model()
    opt = fused_accum.Adam(ours.parameters(), lr=1e-2, accum_steps=2, backend=backend)
    ref = torch.optim.Adam(big.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i, window in enumerate(batches(3, 2, micro=4)):
        for j, (x, y) in enumerate(window):
            loss = mse_mean(ours, x, y) / 2
            if i == 1 and j == 1:
                loss = loss * float("inf")  # an overflow: this window's step must be skipped
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i != 1:
            x, y = torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])
            ref_scaler.scale(mse_mean(big, x, y)).backward()
            ref_scaler.step(ref)
            ref_scaler.update()
            ref.zero_grad()
    assert scaler.get_scale() < 1024.0  # the inf was seen and the scale backed off
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_fused_contract_equals_torch_with_a_planted_overflow(backend, unscale_first):
    """GradScaler hands us grad_scale and found_inf (_step_supports_amp_scaling): the unscale
    is folded into the step and the skip happens on the device. Against torch.optim.AdamW under
    the same scaler, micro-batch for micro-batch: the same skipped step, the same scale
    sequence, untouched state on the overflow; with unscale_() + clip_grad_norm_ in between too."""
    ours, big = make_model(), make_model()
    # SGD: unlike Adam, it does not forgive a missing unscale
    opt = fused_accum.SGD(ours.parameters(), lr=0.05, momentum=0.9, accum_steps=2, backend=backend)
    ref = torch.optim.SGD(big.parameters(), lr=0.05, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2) for _ in range(2)]
    scales = [[], []]
    for i, window in enumerate(batches(5, 2, micro=4)):
        for (model, optim), scaler, seen in zip(((ours, opt), (big, ref)), scalers, scales):
            for j, (x, y) in enumerate(window):
                loss = mse_mean(model, x, y) / 2
                if i == 2 and j == 1:
                    loss = loss * float("inf")  # planted overflow: this window's step is skipped
                scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(optim)
                nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            state_before = {k: v.clone() for k, v in optim.state[next(model.parameters())].items()}
            scaler.step(optim)
            if i == 2:  # skipped: state (step count included) untouched
                for key, value in optim.state[next(model.parameters())].items():
                    assert torch.equal(value, state_before[key]), key
            scaler.update()
            seen.append(scaler.get_scale())
            optim.zero_grad()
    assert scales[0] == scales[1] and scales[0][2] == scales[0][1] / 2
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_state_dict_mid_window_resumes_bit_exactly(backend, param_dtype, tmp_path):
    data = batches(3, 4, micro=3, dtype=param_dtype)
    model = make_model(dtype=param_dtype)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=4, backend=backend)

    def run(model, opt, windows, start=0):
        for window in windows:
            for x, y in window[start:]:
                (mse_mean(model, x, y) / 4).backward()
            if len(window) - start == len(window) or start:
                opt.step()
                opt.zero_grad()
            start = 0

    run(model, opt, data[:1])
    for x, y in data[1][:2]:  # half a window
        (mse_mean(model, x, y) / 4).backward()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    resumed_model = make_model(seed=99, dtype=param_dtype)
    resumed_opt = fused_accum.AdamW(resumed_model.parameters(), lr=1e-2, accum_steps=4, backend=backend)
    ckpt = torch.load(path, weights_only=True)
    resumed_model.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    assert resumed_opt.microbatches == 2
    for state in resumed_opt.state_dict()["state"].values():
        assert all(v.dtype == torch.float32 for v in state.values() if isinstance(v, torch.Tensor))
    run(model, opt, data[1:], start=2)
    run(resumed_model, resumed_opt, data[1:], start=2)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    for (_, a), (_, b) in zip(
        sorted(opt.state_dict()["state"].items()), sorted(resumed_opt.state_dict()["state"].items())
    ):
        assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_loads_a_plain_torch_adamw_state_dict(backend):
    ours, big = make_model(), make_model()
    ref = torch.optim.AdamW(big.parameters(), lr=1e-2)
    data = batches(4, 1, micro=4)
    for x, y in data[0]:
        mse_mean(big, x, y).backward()
    ref.step()
    ref.zero_grad()
    ours.load_state_dict(big.state_dict())
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, backend=backend)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for window in data[1:]:
        for model, o in ((ours, opt), (big, ref)):
            for x, y in window:
                mse_mean(model, x, y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def _branches(dtype):
    torch.manual_seed(0)
    return nn.ModuleDict(dict(a=nn.Linear(4, 3), b=nn.Linear(4, 3))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("when", ["after steps", "before the first step", "mid-window"])
def test_torch_adamw_loads_a_checkpoint_with_parameters_not_stepped_yet(when, dtype):
    """A branch not used yet (a never-routed expert; every parameter, before the first step):
    its entry holds the fp16/bf16 parameter's fp32 master (and mid-window its gradient), so it
    also holds what torch's first step starts from (step 0, zero moments): torch.optim.AdamW
    loads the checkpoint (torch reads the step of every entry: KeyError 'step' otherwise) and
    trains on, branch b included, exactly as from the torch checkpoint of that state (no
    entry for what has not stepped)."""
    model = _branches(dtype)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, backend="cpu", accum_steps=2)
    gen = torch.Generator().manual_seed(1)
    x = lambda: torch.randn(2, 4, generator=gen).to(dtype)  # noqa: E731
    for _ in range({"after steps": 2, "before the first step": 0, "mid-window": 0}[when]):
        for _ in range(2):
            model["a"](x()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if when == "mid-window":
        model["a"](x()).float().square().mean().backward()
    saved = opt.state_dict()
    b_first = len(list(model["a"].parameters()))  # (b's parameters' ids in the checkpoint)
    assert all(saved["state"][i]["step"] == 0 for i in range(b_first, b_first + 2))
    as_torch = copy.deepcopy(saved)  # what torch would have saved: no entry before a step
    as_torch["state"] = {
        i: {k: v for k, v in entry.items() if k in ("step", "exp_avg", "exp_avg_sq")}
        for i, entry in as_torch["state"].items()
        if entry["step"] > 0
    }
    runs = []
    for checkpoint in (saved, as_torch):
        twin = copy.deepcopy(model)
        torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        torch_opt.load_state_dict(copy.deepcopy(checkpoint))
        torch_opt.param_groups[0]["eps"] = 1e-3  # (torch steps fp16 moments: 1e-8 is 0 in fp16)
        gen.manual_seed(2)  # (both runs see the same batches)
        for _ in range(3):
            inputs = x()
            (twin["a"](inputs) + twin["b"](inputs)).float().square().mean().backward()
            torch_opt.step()
            torch_opt.zero_grad()
        runs.append((twin, torch_opt))
    (ours, ours_opt), (theirs, theirs_opt) = runs
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
        mine, ref = ours_opt.state[p], theirs_opt.state[q]
        assert all(torch.equal(mine[k], ref[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_deepcopy_and_pickle_continue_identically(backend):
    model = make_model()
    opt = fused_accum.Lion(model.parameters(), lr=1e-3, accum_steps=2, backend=backend)
    data = batches(3, 2, micro=2)
    for x, y in data[0]:
        mse_mean(model, x, y).backward()
    opt.step()
    model2, opt2 = copy.deepcopy((model, opt))
    pickled = pickle.loads(pickle.dumps(opt))
    assert len(pickled.state_dict()["state"]) == 4
    for m, o in ((model, opt), (model2, opt2)):
        for window in data[1:]:
            for x, y in window:
                mse_mean(m, x, y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_groups_frozen_named_empty_and_added(backend):
    torch.manual_seed(0)
    model = make_model()
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    extra = nn.Parameter(torch.randn(4))
    opt = FusedAccumOptimizer(
        [
            {"params": list(model[0].parameters()), "lr": 0.1},
            {"params": [model[2].weight, frozen], "lr": 0.0},
            {"params": []},
        ],
        "sgd",
        lr=0.01,
        backend=backend,
    )
    opt.add_param_group({"params": [extra, model[2].bias], "momentum": 0.9})
    before = {id(p): p.detach().clone() for p in [*model.parameters(), frozen, extra]}
    x, y = batches(1, 1, micro=4)[0][0]
    (mse_mean(model, x, y) + extra.sum()).backward()
    grads = {id(p): opt.accumulated_grad(p).clone() for p in [*model.parameters(), extra]}
    opt.step()
    w0 = model[0].weight
    torch.testing.assert_close(w0, before[id(w0)] - 0.1 * grads[id(w0)])
    assert torch.equal(model[2].weight, before[id(model[2].weight)])  # lr 0 group
    assert torch.equal(frozen, before[id(frozen)])  # frozen: skipped, no slot
    torch.testing.assert_close(extra, before[id(extra)] - 0.01 * grads[id(extra)])


def test_named_parameters_are_used_in_messages_and_kept():
    model = make_model()
    opt = fused_accum.SGD(model.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert opt.state_dict()["param_groups"][0]["param_names"][0] == "0.weight"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_without_gradient_is_a_no_op(backend):
    model = make_model()
    opt = fused_accum.AdamW(model.parameters(), lr=0.1, backend=backend)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(float(s["step"]) == 0 for s in opt.state_dict()["state"].values())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("master_weights", [True, False])
def test_bf16_params_train_with_and_without_master(backend, master_weights):
    model = make_model(dtype=torch.bfloat16)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, master_weights=master_weights, backend=backend)
    fp32 = make_model()
    ref = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    for window in batches(3, 2, micro=4):
        for x, y in window:
            (mse_mean(model, x.bfloat16(), y.bfloat16()) / 2).backward()
        opt.step()
        opt.zero_grad()
        mse_mean(fp32, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])).backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(model.parameters(), fp32.parameters()):
        assert p.dtype == torch.bfloat16
        # bf16 forward/backward against an fp32 model: agreement to bf16 resolution only
        torch.testing.assert_close(p.float(), q, rtol=0.05, atol=0.02)
    state = opt.state_dict()["state"][0]
    assert ("master" in state) == master_weights
    if master_weights:  # the bf16 param is the fp32 master rounded to nearest
        assert torch.equal(next(model.parameters()), state["master"].to(torch.bfloat16))


def test_lr_may_be_a_tensor():
    ours, big = make_model(), make_model()
    opt = fused_accum.SGD(ours.parameters(), lr=torch.tensor(0.05), momentum=0.9)
    ref = torch.optim.SGD(big.parameters(), lr=0.05, momentum=0.9)
    for window in batches(2, 1, micro=4):
        for m, o in ((ours, opt), (big, ref)):
            mse_mean(m, *window[0]).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_signatures_match_torch_optim():
    import inspect

    for ours, theirs in (
        (fused_accum.SGD, torch.optim.SGD),
        (fused_accum.Adam, torch.optim.Adam),
        (fused_accum.AdamW, torch.optim.AdamW),
    ):
        mine = inspect.signature(ours.__init__).parameters
        for name, param in inspect.signature(theirs.__init__).parameters.items():
            assert name in mine, (ours, name)
            if param.default is not inspect.Parameter.empty and name not in ("fused", "foreach"):
                assert mine[name].default == param.default, (ours, name)


# --- errors --------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    model = make_model()
    with pytest.raises(TypeError, match="complex64; supported: float32, bfloat16, float16"):
        FusedAccumOptimizer([nn.Parameter(torch.zeros(2, dtype=torch.complex64))], "sgd", lr=0.1)
    # an integer tensor cannot require grad: skipped like any frozen tensor, as torch.optim does
    assert "params=0" in repr(FusedAccumOptimizer([torch.zeros(2, dtype=torch.long)], "sgd", lr=0.1))
    with pytest.raises(TypeError, match=r"'w'.*float64"):
        FusedAccumOptimizer([("w", nn.Parameter(torch.zeros(2, dtype=torch.float64)))], "sgd", lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        FusedAccumOptimizer([{"params": [model[0].weight]}, {"params": [model[0].weight]}], "sgd", lr=0.1)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        FusedAccumOptimizer(model.parameters(), "adagrad_fused", lr=0.1)
    with pytest.raises(TypeError, match="unexpected keyword 'momentum' for optimizer 'adamw'"):
        FusedAccumOptimizer(model.parameters(), "adamw", lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="class"):
        FusedAccumOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="backend 'cuda' was requested but is not available"):
        FusedAccumOptimizer(model.parameters(), "sgd", lr=0.1, backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        FusedAccumOptimizer(model.parameters(), "sgd", lr=0.1, backend="metal")
    with pytest.raises(ValueError, match="accum_steps"):
        FusedAccumOptimizer(model.parameters(), "sgd", lr=0.1, accum_steps=0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0: 1.0"):
        FusedAccumOptimizer(model.parameters(), "adam", lr=0.1, betas=(1.0, 0.9))


def test_sparse_gradient_names_the_parameter():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = FusedAccumOptimizer(emb.named_parameters(), "sgd", lr=0.1)  # noqa: F841 (alive: its hooks)
    with pytest.raises(RuntimeError, match="'weight' received a sparse gradient"):
        emb(torch.tensor([1, 2])).sum().backward()


def test_step_hooks_and_schedulers_see_a_torch_optimizer():
    model = make_model()
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(type(o).__name__))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mse_mean(model, *batches(1, 1, micro=2)[0][0]).backward()
    opt.step()
    sched.step()
    assert calls == ["SGD"] and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert isinstance(opt, torch.optim.Optimizer)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", [c.id for c in cases.cases(cases.STEP_IN_BACKWARD)])
def test_step_in_backward_equals_the_separate_step(backend, algo):
    """The fused last micro-batch gives the same update as accumulate-then-step; a param that
    gets no gradient in the last micro-batch is still stepped from its accumulator."""
    name, _, hyper = ALGOS[algo]
    models = [make_model(), make_model()]
    opts = [
        FusedAccumOptimizer(
            m.parameters(), name, accum_steps=3, backend=backend, step_in_backward=fused, bucket_cap_mb=1e-4, **hyper
        )
        for m, fused in zip(models, (False, True))
    ]
    for window in batches(3, 3, micro=2):
        for m, o in zip(models, opts):
            for j, (x, y) in enumerate(window):
                out = m(x) if j < 2 else m[2](torch.tanh(m[0](x).detach()))  # last: no grad for m[0]
                (((out - y) ** 2).mean() / 3).backward()
            assert (m[0].weight.grad is None) == o.step_in_backward  # not exposed when fused
            o.step()
            o.zero_grad()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # same formulas, same order


def test_step_in_backward_needs_accum_steps():
    with pytest.raises(ValueError, match="needs accum_steps"):
        fused_accum.AdamW(make_model().parameters(), step_in_backward=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("accum_steps", [3, None])
def test_max_grad_norm_equals_clip_grad_norm(backend, accum_steps):
    """With accum_steps the norm comes out of the last accumulate pass; without, from a
    separate pass at step. Both must equal torch's clip_grad_norm_ on the large batch."""
    ours, big = make_model(), make_model()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=accum_steps, max_grad_norm=0.05, backend=backend)
    ref = torch.optim.AdamW(big.parameters(), lr=1e-2)
    for window in batches(3, 3, micro=4):
        for x, y in window:
            (mse_mean(ours, x, y) / 3).backward()
        opt.step()
        opt.zero_grad()
        mse_mean(big, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])).backward()
        ref_norm = nn.utils.clip_grad_norm_(big.parameters(), max_norm=0.05)
        ref.step()
        ref.zero_grad()
        torch.testing.assert_close(opt.last_grad_norm, ref_norm, rtol=1e-5, atol=0)
        assert ref_norm > 0.05  # the clip really scaled the gradient
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("algo", [c.id for c in cases.cases(cases.FP32)])
def test_skip_nonfinite_leaves_everything_untouched(backend, algo):
    name, _, hyper = ALGOS[algo]
    model = make_model()
    opt = FusedAccumOptimizer(model.parameters(), name, accum_steps=2, skip_nonfinite=True, backend=backend, **hyper)
    data = batches(2, 2, micro=4)
    for x, y in data[0]:
        mse_mean(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = copy.deepcopy(opt.state_dict()["state"])
    for j, (x, y) in enumerate(data[1]):
        loss = mse_mean(model, x, y)
        (loss * float("nan") if j == 1 else loss).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before_params))
    after_state = opt.state_dict()["state"]
    for i, entry in before_state.items():
        assert all(torch.equal(entry[k], after_state[i][k]) for k in entry)  # step count included
    for x, y in data[0]:  # and the next finite window steps again
        mse_mean(model, x, y).backward()
    opt.step()
    assert not torch.equal(next(model.parameters()), before_params[0])


def test_newest_optimizer_wins_and_hooks_die_with_it():
    model = make_model()
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    mse_mean(model, *batches(1, 1, micro=2)[0][0]).backward()
    with pytest.warns(UserWarning, match="discarded"):  # opt held a window
        second = fused_accum.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="newer optimizer took over"):
        opt.step()
    second.zero_grad()
    del second  # its hooks go with it: autograd fills .grad as usual again
    mse_mean(model, *batches(1, 1, micro=2)[0][0]).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(not p._backward_hooks and not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_module_zero_grad_discards_an_exposed_window_like_torch(backend):
    """HF Trainer calls model.zero_grad(), not the optimizer's: after GradScaler skipped our
    step the window must still be discarded, as clearing .grad does for torch optimizers."""
    ours, big = make_model(), make_model()
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, momentum=0.9, accum_steps=2, backend=backend)
    ref = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    data = batches(2, 2, micro=4)
    for x, y in data[0]:  # a window whose step is skipped (as GradScaler does on overflow)
        mse_mean(ours, x, y).backward()
    ours.zero_grad()
    for x, y in data[1]:
        for model in (ours, big):
            mse_mean(model, x, y).backward()
    opt.step()
    ref.step()
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


# --- regressions found in review -------------------------------------------------------------


def test_reentrant_checkpoint_counts_one_microbatch_and_sums_tied_gradients():
    """checkpoint(use_reentrant=True) runs nested backwards: they must not count as micro-
    batches, and a weight used inside and outside a segment gets two gradients in one backward."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    c, w, b = (nn.Parameter(torch.randn(*s)) for s in ((4,), (4, 4), (4,)))
    x0 = torch.randn(3, 4)

    def loss(c, w, b, reentrant):
        h = checkpoint(lambda t: torch.tanh(t @ w), x0 * c, use_reentrant=True) if reentrant else torch.tanh(x0 * c @ w)
        h = checkpoint(torch.tanh, h, use_reentrant=True) if reentrant else torch.tanh(h)
        return ((h @ w) + b).sum()

    plain = [t.detach().clone().requires_grad_() for t in (c, w, b)]
    loss(*plain, reentrant=False).backward()
    opt = FusedAccumOptimizer([c, w, b], "sgd", lr=0.1, accum_steps=2)
    loss(c, w, b, reentrant=True).backward()
    assert opt.microbatches == 1
    for p, q in zip((c, w, b), plain):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.accumulated_grad(p), q.grad, rtol=1e-6, atol=1e-7)


def test_a_backward_that_raised_does_not_break_counting():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("simulated out of memory")

    model = make_model()
    opt = fused_accum.SGD(model.parameters(), lr=0.1, accum_steps=1, bucket_cap_mb=1e-6)
    x = torch.randn(2, 6)
    with pytest.raises(RuntimeError, match="simulated"):
        model[2](Boom.apply(model[1](model[0](x)))).sum().backward()  # model[2]'s grads arrived
    opt.zero_grad()  # the trainer skips the batch
    model(x).sum().backward()
    assert opt.microbatches == 1 and all(p.grad is not None for p in model.parameters())


def test_skipped_window_then_model_zero_grad_starts_clean():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = fused_accum.SGD(model.parameters(), lr=0.1, accum_steps=2, skip_nonfinite=True, max_grad_norm=1.0)
    x = torch.randn(2, 4)
    (model(x).sum() * float("inf")).backward()
    model(x).sum().backward()
    model.zero_grad()  # the window's step was skipped (GradScaler); HF clears .grad this way
    before = model.weight.detach().clone()
    model(x).sum().backward()
    assert opt.microbatches == 1  # a fresh window, half done
    torch.testing.assert_close(model.weight.grad, x.sum(0, keepdim=True))
    model(x).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)  # the stale non-finite flag is gone
    torch.testing.assert_close(opt.last_grad_norm, 2 * torch.cat([x.sum(0), torch.tensor([2.0])]).norm())


def test_replaced_grad_is_not_counted_twice_in_the_norm():
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    opt = fused_accum.SGD(model.parameters(), lr=1.0, accum_steps=1, max_grad_norm=1e9)
    model(torch.randn(2, 4)).sum().backward()
    g = model.weight.grad.clone()
    model.weight.grad = g * 1.0  # e.g. an all-reduced copy, same values
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, g.norm())


def test_loads_torch_sgd_momentum_state_without_reinitialising_the_buffer():
    ours, big = make_model(), make_model()
    ref = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    data = batches(4, 1, micro=4)
    for x, y in data[0][:1] + data[1][:1]:
        mse_mean(big, x, y).backward()
        ref.step()
        ref.zero_grad()
    ours.load_state_dict(big.state_dict())
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's SGD saves no "step"
    for model, o in ((ours, opt), (big, ref)):
        mse_mean(model, *data[2][0]).backward()
        o.step()
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_generic_path_with_bf16_params_and_no_master():
    model = make_model(dtype=torch.bfloat16)
    opt = FusedAccumOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, master_weights=False)
    before = [p.detach().clone() for p in model.parameters()]
    mse_mean(model, *[t.bfloat16() for t in batches(1, 1, micro=4)[0][0]]).backward()
    opt.step()
    assert all(p.dtype == torch.bfloat16 and not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_frozen_params_of_any_dtype_are_skipped_and_gradual_unfreezing_trains_like_torch(backend):
    ours, big = make_model(), make_model()
    counter = nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
    for model in (ours, big):
        model[0].requires_grad_(False)
    opt = fused_accum.AdamW([*ours.parameters(), counter], lr=0.01, backend=backend)
    ref = torch.optim.AdamW(big.parameters(), lr=0.01)
    for i, window in enumerate(batches(4, 2, micro=3)):
        if i == 2:  # unfreeze the first layer without telling the optimizer
            for model in (ours, big):
                model[0].requires_grad_(True)
        for x, y in window:
            for model in (ours, big):
                mse_mean(model, x, y).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(ours.parameters(), big.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    assert not torch.equal(ours[0].weight, make_model()[0].weight)  # it did train


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_conv_weights(backend, dtype):
    """A channels_last weight is not contiguous: its gradient and its update must still land
    on the right elements (the accumulator keeps logical order)."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()).to(dtype).to(memory_format=torch.channels_last)
    ref_model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    ref_model.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    assert not ours[0].weight.is_contiguous()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, backend=backend)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        xs = [torch.randn(2, 3, 6, 6, generator=gen) for _ in range(2)]
        for x in xs:
            (ours(x.to(dtype).contiguous(memory_format=torch.channels_last)).float().pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
        ref_model(torch.cat(xs)).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
    tol = TOL if dtype == torch.float32 else dict(rtol=0.05, atol=0.02)  # bf16 forward/backward
    for p, q in zip(ours.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.float(), q, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])
@pytest.mark.parametrize("step_in_backward", [False, True])
def test_on_cuda_bf16_model_matches_fp32_large_batch(backend, step_in_backward):
    """The whole optimizer on CUDA tensors: hooks from autograd's device thread, per-device
    stats, bf16 params with fp32 masters, the fused last micro-batch."""
    ours = make_model(dtype=torch.bfloat16).cuda()
    big = make_model().cuda()
    opt = fused_accum.AdamW(
        ours.parameters(),
        lr=1e-2,
        accum_steps=4,
        backend=backend,
        step_in_backward=step_in_backward,
        max_grad_norm=None if step_in_backward else 10.0,
    )
    ref = torch.optim.AdamW(big.parameters(), lr=1e-2)
    for window in batches(3, 4, micro=8):
        for x, y in window:
            (mse_mean(ours, x.cuda().bfloat16(), y.cuda().bfloat16()) / 4).backward()
        opt.step()
        opt.zero_grad()
        mse_mean(big, torch.cat([x for x, _ in window]).cuda(), torch.cat([y for _, y in window]).cuda()).backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(ours.parameters(), big.parameters()):
        # bf16 forward/backward against an fp32 model: agreement to bf16 resolution only
        torch.testing.assert_close(p.float(), q, rtol=0.05, atol=0.02)
    master = opt.state_dict()["state"][0]["master"]
    assert master.is_cuda and torch.equal(next(ours.parameters()), master.to(torch.bfloat16))


def test_cpu_buckets_default_to_half_a_megabyte_and_an_explicit_cap_wins():
    # On the CPU a bucket is folded while its gradients are still in the core's cache: 0.5 MB
    # of fp32 by default (DDP's 25 MB otherwise). Two 512 x 512 weights (1 MB each) and biases.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    sizes = lambda opt: [b.end - b.start for f in opt._window.flat_groups for b in f.buckets]  # noqa: E731
    small = fused_accum.AdamW(model.parameters(), lr=1e-3)
    assert sizes(small) == [512 * 512 + 512] * 2  # a bucket closes once it holds 0.5 MB: a layer each
    whole = fused_accum.AdamW(model.parameters(), lr=1e-3, bucket_cap_mb=25)
    assert len(sizes(whole)) == 1
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        fused_accum.AdamW(model.parameters(), lr=1e-3, bucket_cap_mb=0)


def test_a_state_buffer_starts_at_its_records_initial_value():
    """An algorithm's record says where each state buffer starts (``State.init``: a number, or a
    param-group key holding one; Adagrad's sum at initial_accumulator_value): at construction,
    when a hyper-parameter turns the buffer on later, and when ``opt.state`` is cleared. Here
    Adam's record with its second moment starting at the group's ``v0`` and amsgrad's running
    maximum at 0.5, stepped with zero gradients: each buffer then shows its start times beta2
    (or, the maximum, the start itself)."""
    import dataclasses

    from fused_accum import ops, registry
    from fused_accum.registry import State

    adam = registry.ALGORITHMS["adam"]
    states = (State("exp_avg"), State("exp_avg_sq", init="v0"), State("max_exp_avg_sq", when="amsgrad", init=0.5))
    record = dataclasses.replace(adam, name="adam_from_v0", defaults=dict(adam.defaults, v0=0.25), states=states)
    registry.register(record)
    try:
        p = nn.Parameter(torch.ones(5))
        opt = FusedAccumOptimizer([p], "adam_from_v0", lr=1e-3, betas=(0.9, 0.999), accum_steps=1)

        def zero_step():
            (p * 0.0).sum().backward()
            opt.step()
            opt.zero_grad()

        v0 = torch.full((5,), 0.25)
        zero_step()
        assert torch.equal(opt.state[p]["exp_avg_sq"], v0 * 0.999)
        opt.param_groups[0]["amsgrad"] = True  # the running maximum, allocated now, at 0.5
        zero_step()
        assert torch.equal(opt.state[p]["max_exp_avg_sq"], torch.full((5,), 0.5))
        opt.state.clear()  # a fresh start: every buffer at its initial value, the step count at 0
        zero_step()
        assert torch.equal(opt.state[p]["exp_avg_sq"], v0 * 0.999) and float(opt.state[p]["step"]) == 1.0
    finally:
        del registry.ALGORITHMS[record.name], ops._OF_ALGORITHM[record.name]
