"""fused_accum.Muon against torch.optim.Muon: a step that is not elementwise (an elementwise
prologue, the Newton-Schulz middle over each whole matrix, an elementwise epilogue), in fp32,
bf16 with fp32 masters and the remainder mode, under process_group= and DDP, and the modes it
refuses (shard=, offload=, FSDP2's DTensors) and the parameters torch refuses."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_accum
from fused_accum import ops
from helpers import CPU_BACKENDS, one_rank_world, spawn_ranks  # tests/helpers.py

SHAPES = [(8, 5), (3, 7), (6, 6), (1, 9)]  # tall, wide, square, one row
CASES = {
    "defaults_lr": dict(lr=0.02),
    "no_nesterov_match_rms_adamw": dict(lr=0.01, nesterov=False, adjust_lr_fn="match_rms_adamw", weight_decay=0.05),
    "original_no_decay": dict(lr=0.03, momentum=0.9, weight_decay=0.0, adjust_lr_fn="original", ns_steps=3),
}


def gradients(windows: int, k: int, dtype=torch.float32, seed: int = 0) -> list:
    """Per window, k micro-batches' gradients of each matrix of SHAPES (fresh random, not zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(k)] for _ in range(windows)]


def matrices(dtype=torch.float32, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in SHAPES]


def backward(params, grads) -> None:
    """A backward whose gradient of each parameter is exactly ``grads``' (sum(p * g))."""
    sum((p * g).sum() for p, g in zip(params, grads)).backward()


def window_sum(micro: list) -> list:
    """The window's gradient as the fp32 accumulator sums it: the first micro-batch, then each
    next one added in order, in fp32."""
    total = [g.float().clone() for g in micro[0]]
    for grads in micro[1:]:
        total = [t + g.float() for t, g in zip(total, grads)]
    return total


# --- fp32: torch.optim.Muon's step -------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_steps_as_torch_muon_over_ten_windows(backend, case):
    """Ten windows of four micro-batches: each window's fp32 sum handed to torch.optim.Muon as
    .grad. The brief asks within 1e-6; it is bit for bit, as the prologue, middle and epilogue
    run torch's ops in torch's order on the same fp32 values (the middle's bf16 matmuls would
    turn any last-bit difference in the momentum into a bf16 ulp of the update: 1e-4 here)."""
    hyper = CASES[case]
    ours, theirs = matrices(), matrices()
    opt = fused_accum.Muon(ours, accum_steps=4, backend=backend, **hyper)
    ref = torch.optim.Muon(theirs, **hyper)
    for micro in gradients(windows=10, k=4):
        for grads in micro:
            backward(ours, grads)
        opt.step()
        opt.zero_grad()
        for q, g in zip(theirs, window_sum(micro)):
            q.grad = g
        ref.step()
        ref.zero_grad()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"].view_as(p), ref.state[q]["momentum_buffer"])
    assert set(opt.state[ours[0]]) == set(ref.state[theirs[0]]) == {"momentum_buffer"}  # no step, as torch


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_in_backward_and_clipping_step_as_torch_muon_does_after_them(backend):
    """The window's last micro-batch fused into the prologue (step_in_backward) gives the
    separate step's bits; max_grad_norm's coefficient is applied in the prologue's one read, as
    torch.optim.Muon after clip_grad_norm_ on the same sum (within 1e-6: the norm's sum is
    taken in another order, a last-bit difference of the coefficient)."""
    runs = {}
    for name, keywords in {
        "separate": dict(accum_steps=3),
        "in_backward": dict(accum_steps=3, step_in_backward=True),
        "clipped": dict(accum_steps=3, max_grad_norm=1.0),
    }.items():
        params = matrices()
        opt = fused_accum.Muon(params, lr=0.02, backend=backend, **keywords)
        for micro in gradients(windows=3, k=3):
            for grads in micro:
                backward(params, grads)
            opt.step()
            opt.zero_grad()
        runs[name] = params
    assert all(torch.equal(p, q) for p, q in zip(runs["separate"], runs["in_backward"]))
    theirs = matrices()
    ref = torch.optim.Muon(theirs, lr=0.02)
    for micro in gradients(windows=3, k=3):
        for q, g in zip(theirs, window_sum(micro)):
            q.grad = g
        assert nn.utils.clip_grad_norm_(theirs, 1.0) > 1.0  # (the clip really scales)
        ref.step()
    for p, q in zip(runs["clipped"], theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_nonfinite_window_is_skipped_and_the_next_steps(backend):
    """skip_nonfinite: the prologue keeps the momentum, the epilogue the weights."""
    params = matrices()
    opt = fused_accum.Muon(params, lr=0.02, skip_nonfinite=True, backend=backend)
    good, bad = gradients(windows=2, k=1)
    backward(params, good[0])
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in params], [opt.state[p]["momentum_buffer"].clone() for p in params]
    backward(params, [g * float("nan") for g in bad[0]])
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(params, before[1]))
    backward(params, bad[0])
    opt.step()
    assert not torch.equal(params[0], before[0][0])


def test_a_checkpoint_moves_between_it_and_torch_muon_both_ways():
    """opt.state_dict() holds torch's state (momentum_buffer, no step): torch.optim.Muon loads
    ours and we load its, and each then steps as the run that saved it."""
    ours = matrices()
    opt = fused_accum.Muon(ours, lr=0.02)
    data = gradients(windows=6, k=1)
    for micro in data[:3]:
        backward(ours, micro[0])
        opt.step()
        opt.zero_grad()
    theirs, again = ([nn.Parameter(p.detach().clone()) for p in ours] for _ in range(2))
    ref = torch.optim.Muon(theirs, lr=0.02)
    ref.load_state_dict(opt.state_dict())
    reloaded = fused_accum.Muon(again, lr=0.02)
    reloaded.load_state_dict(ref.state_dict())
    for micro in data[3:]:
        for params, o in ((ours, opt), (again, reloaded)):
            backward(params, micro[0])
            o.step()
            o.zero_grad()
        for q, g in zip(theirs, micro[0]):
            q.grad = g.clone()
        ref.step()
    assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(ours, theirs, again))


# --- bf16 weights: fp32 masters, remainders ----------------------------------------------------


def _error(params, fp32_run) -> float:
    return max(((p.float() - q) / q.abs().max()).abs().max().item() for p, q in zip(params, fp32_run))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_bf16_with_masters_stays_nearer_to_the_fp32_run_than_torch_muon_on_bf16(backend, master_weights):
    """Same bf16 gradients for three runs: torch.optim.Muon on fp32 parameters (the fp32 run),
    ours on bf16 parameters with fp32 masters (or remainders), torch.optim.Muon stepping the bf16
    parameters. A small lr makes many updates smaller than half a bf16 ulp of the weight, which
    the bf16 run loses and the masters keep. Measured over these 40 windows (largest difference
    over the largest weight): ours 1.7e-3, the bf16 rounding of the fp32 run itself (half a bf16
    ulp is up to 2**-8 = 3.9e-3 of a value); torch.optim.Muon on bf16 5.1e-3. The bound, half of
    torch's, leaves ours 1.5x room."""
    hyper = dict(lr=2e-4, weight_decay=0.1)
    windows = gradients(windows=40, k=1, dtype=torch.bfloat16)
    ours, bf16 = matrices(torch.bfloat16), matrices(torch.bfloat16)
    fp32 = [nn.Parameter(p.detach().float()) for p in ours]  # (all three from the same values)
    runs = [
        (fp32, torch.optim.Muon(fp32, **hyper)),
        (ours, fused_accum.Muon(ours, master_weights=master_weights, backend=backend, **hyper)),
        (bf16, torch.optim.Muon(bf16, **hyper)),
    ]
    for micro in windows:
        for params, opt in runs:
            if isinstance(opt, fused_accum.FusedAccumOptimizer):
                backward(params, micro[0])
            else:
                for p, g in zip(params, micro[0]):
                    p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad()
    ours_error, torch_error = _error(ours, fp32), _error(bf16, fp32)
    assert ours_error < torch_error / 2, (ours_error, torch_error)
    window = runs[1][1]._window
    masters = [window.flat_groups[s.flat_index].master_of(s).view_as(q) for s, q in zip(window.slots, fp32)]
    # the masters are the fp32 run: the same fp32 values through the same ops
    assert all(torch.equal(m, q) for m, q in zip(masters, fp32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_remainder_mode_keeps_the_fp32_master_modes_masters_bit_for_bit(backend):
    """The epilogue writes the remainder mode's master exactly (split and rebuilt): from the same
    gradients it is the fp32-master mode's master, bit for bit (the weights differ at ties)."""
    runs = []
    for master_weights in (True, "remainder"):
        params = matrices(torch.bfloat16)
        opt = fused_accum.Muon(params, lr=0.01, master_weights=master_weights, backend=backend)
        for micro in gradients(windows=6, k=2, dtype=torch.bfloat16):
            for grads in micro:
                backward(params, grads)
            opt.step()
            opt.zero_grad()
        window = opt._window
        runs.append([window.flat_groups[s.flat_index].master_of(s).clone() for s in window.slots])
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# --- the record: prologue, middle, epilogue ------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_step_is_a_prologue_a_middle_and_an_epilogue_on_the_optimizers_backend(monkeypatch, backend):
    """The elementwise ops run on the optimizer's backend (kernels in each), and the step calls
    the prologue, the middle, then the epilogue, once each per flat group."""
    from fused_accum.registry import ALGORITHMS

    split = ops.step_op("muon")
    assert isinstance(split, ops.SplitStep) and split.middle is ALGORITHMS["muon"].middle
    assert (split.prologue.name, split.epilogue.name) == ("muon_prologue", "muon_epilogue")
    calls = []
    step_op_call = ops.StepOp.__call__

    def traced(op, t, s, h, backend, plan=None):
        calls.append((op.name, backend))
        return step_op_call(op, t, s, h, backend, plan)

    def middle(updates, h):
        calls.append(("middle", len(updates)))
        return run(updates, h)

    run = split.middle.run
    monkeypatch.setattr(ops.StepOp, "__call__", traced)
    monkeypatch.setattr(split, "middle", dataclasses.replace(split.middle, run=middle))
    params = matrices()
    opt = fused_accum.Muon(params, lr=0.02, backend=backend)
    backward(params, gradients(1, 1)[0][0])
    opt.step()
    assert calls == [("muon_prologue", backend), ("middle", len(SHAPES)), ("muon_epilogue", backend)]


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the triton backend runs in the TRITON_INTERPRET=1 process")
@pytest.mark.parametrize("master_weights", [None, True])
def test_triton_launches_the_prologue_and_the_epilogue_once_each_per_step(monkeypatch, master_weights):
    """The triton backend steps the elementwise ops of all the matrices in one launch each (per
    dtype group: one here), however many matrices (tests/test_host_cost.py counts the cpu
    backend's operator calls)."""
    from fused_accum import backends

    kernels = backends.get("triton").kernels
    real, launched = kernels.step_kernel, []

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append("prologue" if not kwargs["WRITES_PARAM"] else "epilogue")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(kernels, "step_kernel", Counted())
    dtype = torch.bfloat16 if master_weights else torch.float32
    params = matrices(dtype) + matrices(dtype, seed=2)
    opt = fused_accum.Muon(params, lr=0.02, backend="triton", master_weights=master_weights)
    backward(params, [g.to(dtype) for g in gradients(1, 1)[0][0] * 2])
    opt.step()
    assert launched == ["prologue", "epilogue"]


def test_a_steady_state_step_does_not_sync(one_thread):
    """A steady-state step reads no tensor on the host (lr stays a device tensor; the adjusted
    lr is formed from it on the device)."""
    params = matrices()
    opt = fused_accum.Muon(params, lr=0.02)
    for _ in range(2):
        backward(params, gradients(1, 1)[0][0])
        with torch.profiler.profile() as prof:
            opt.step()
        opt.zero_grad()
    names = {e.name for e in prof.events()}
    assert not names & {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}, names


def test_a_compiled_step_is_the_eager_step_bit_for_bit(one_thread):
    """torch.compile(opt.step, fullgraph=True) traces the prologue and epilogue (custom ops) and
    the middle's matmuls: under aot_eager the eager step's bits, over an lr change."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, eager = matrices(), matrices()
    opts = [fused_accum.Muon(ps, lr=0.02) for ps in (compiled, eager)]
    steps = [torch.compile(opts[0].step, fullgraph=True, backend="aot_eager"), opts[1].step]
    for w, micro in enumerate(gradients(windows=4, k=1)):
        for params, opt, step in zip((compiled, eager), opts, steps):
            opt.param_groups[0]["lr"] = 0.02 if w < 2 else 0.01  # (a schedule)
            backward(params, micro[0])
            step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(compiled, eager))
    assert counters["stats"]["unique_graphs"] == 1  # one graph, the lr change included
    torch._dynamo.reset()


# --- what it refuses --------------------------------------------------------------------------


def _torch_error(cls, *args, **kwargs):
    with pytest.raises(Exception) as info:
        cls(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        dict(lr=-1.0),
        dict(momentum=-0.1),
        dict(weight_decay=-0.1),
        dict(adjust_lr_fn="cosine"),
        dict(lr=torch.tensor([0.1, 0.2])),
    ],
    ids=["lr", "momentum", "weight_decay", "adjust_lr_fn", "tensor_lr"],
)
def test_bad_hyperparameters_are_refused_with_torchs_errors(bad):
    want = _torch_error(torch.optim.Muon, matrices(), **bad)
    assert _torch_error(fused_accum.Muon, matrices(), **bad) == want
    assert _torch_error(fused_accum.FusedAccumOptimizer, matrices(), "muon", **bad) == want


@pytest.mark.parametrize(
    "bad", [dict(ns_coefficients=(3.4, -4.7)), dict(ns_coefficients=(3.4, -4.7, 2.0, 1.0)), dict(ns_steps=100)]
)
def test_bad_iteration_settings_are_refused_at_the_step_as_torch_refuses_them_and_nothing_changes(bad):
    """torch.optim.Muon takes ns_coefficients and ns_steps unchecked and refuses them at the
    step (ValueError, its message); so do we, before any state or weight moves (a tuple of two
    once raised an IndexError, one of four stepped with three)."""

    def step_error(cls):
        params = matrices()
        before = [p.detach().clone() for p in params]
        opt = cls(params, **bad)
        backward(params, gradients(1, 1)[0][0])
        with pytest.raises(Exception) as info:
            opt.step()
        return type(info.value), str(info.value), all(torch.equal(p, q) for p, q in zip(params, before))

    want = step_error(torch.optim.Muon)
    assert step_error(fused_accum.Muon) == want


def test_a_parameter_that_is_not_a_matrix_is_refused_as_torch_refuses_it_and_nothing_changes():
    bias = nn.Parameter(torch.randn(5))
    want = _torch_error(torch.optim.Muon, [*matrices(), bias])
    assert _torch_error(fused_accum.Muon, [*matrices(), bias]) == want
    opt = fused_accum.Muon(matrices())
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 1 and not bias._post_accumulate_grad_hooks


def test_the_modes_that_split_a_matrix_are_refused_naming_the_alternative(tmp_path):
    """shard=, offload= and DTensor parameters (FSDP2) would hand the middle pieces of a
    matrix: each is refused with an error naming the alternative (in a one-rank gloo world)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    with one_rank_world(tmp_path):
        alternative = "use process_group= without shard=, or DDP"
        group = dist.group.WORLD
        with pytest.raises(ValueError, match="shard='state' steps a slice of each parameter on each rank") as info:
            fused_accum.Muon(matrices(), process_group=group, shard="state")
        assert alternative in str(info.value)
        with pytest.raises(ValueError, match="offload='cpu' steps on the host bucket by bucket") as info:
            fused_accum.Muon(matrices(), offload="cpu")
        assert "leave offload=None" in str(info.value)
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match=r"DTensor parameters \(FSDP2's fully_shard") as info:
            fused_accum.Muon([sharded])
        assert alternative in str(info.value)
        fused_accum.AdamW([sharded])  # (an elementwise algorithm takes them)


# --- data parallel: process_group= and DDP -------------------------------------------------------

WORLD, WINDOWS, K = 2, 4, 2


class _Matrices(nn.Module):
    """A module whose loss gives each matrix a chosen gradient (DDP needs a forward)."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList(matrices())

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.weights, grads))


def _worker(rank, path, how):
    dist.init_process_group("gloo", init_method=f"file://{path}.init", rank=rank, world_size=WORLD)
    try:
        model = _Matrices()
        if how == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
            opt = fused_accum.Muon(model.parameters(), lr=0.02)
        else:
            wrapped = model
            opt = fused_accum.Muon(model.parameters(), lr=0.02, process_group=dist.group.WORLD, accum_steps=K)
        seen = []
        for micro in gradients(WINDOWS, K, seed=10 + rank):  # each rank its own gradients
            for grads in micro:
                (wrapped(grads) / K).backward()
            seen.append([p.grad.clone() for p in model.parameters()])  # the group's mean, at the step
            opt.step()
            opt.zero_grad()
        torch.save({"params": [p.detach() for p in model.parameters()], "grads": seen}, f"{path}.rank{rank}")
        if how == "ddp":
            dist.barrier()  # (DDP over gloo can deadlock in its teardown: see test_distributed)
            os._exit(0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["process_group", "ddp"])
def test_data_parallel_ranks_step_whole_matrices_from_the_averaged_gradient(tmp_path, how):
    """Each rank orthogonalizes every whole matrix from the group's mean gradient: the ranks
    agree bit for bit, and equal torch.optim.Muon stepped with the mean gradient each window
    (the .grad a rank shows at its step) in one process."""
    ranks = spawn_ranks(_worker, str(tmp_path / "run"), WORLD, how, weights_only=True)
    theirs = matrices()
    ref = torch.optim.Muon(theirs, lr=0.02)
    for window in ranks[0]["grads"]:
        for q, g in zip(theirs, window):
            q.grad = g.clone()
        ref.step()
    assert not torch.equal(ranks[0]["grads"][0][0], gradients(1, 1, seed=10)[0][0][0] / K)  # really averaged
    for rank in ranks:
        for p, q in zip(rank["params"], theirs):
            assert torch.equal(p, q)
