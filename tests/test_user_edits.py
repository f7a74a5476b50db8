"""What users do to a model between steps, against torch.optim doing the same (issue 22).

Every cache the optimizer keeps (the fp32 master of a bf16 parameter, the window's norm and
non-finite flag, ``opt.state``'s views, the window's start) is edited here from outside, the way
a user or a trainer edits it, and the result is compared with torch.optim on a twin model fed
the same data with native ``.grad`` accumulation.

Tolerances: fp32 parameters within RTOL = 1e-6 relative (the sums are formed in torch's order,
so a correct step is a few ulp off; a stale master, a stale norm or a lost gradient is >= 1e-3).
bf16 parameters are compared with torch's optimizer stepping an fp32 copy of them (what our
master is) from the same bf16 gradients summed in fp32, then rounded to bf16: within one bf16
ulp of the largest element (at most 2**-7 of it), since a one-ulp fp32 difference in the
master can round either way. A stale master is off by the whole edit (>= 1e-1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_accum

from helpers import RTOL, assert_rel, one_rank_world, rel_err  # noqa: E402 (tests/helpers.py)

BF16_RTOL = 2.0**-7


def assert_close(ours: nn.Module, ref: nn.Module, rtol=RTOL):
    """Parameter by parameter; bf16 ones against the reference rounded to bf16 alike."""
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert_rel(p, q.to(p.dtype) if p.dtype != q.dtype else q, rtol, f"parameter {name}")


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def batches(n, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=gen).to(dtype), torch.randn(4, 3, generator=gen).to(dtype)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return (model(x) - y).float().square().mean()


class Bf16Reference:
    """torch.optim over an fp32 copy of a bf16 model (the master), fed that bf16 model's own
    gradients (native bf16 backward on a twin) summed in fp32: what fused_accum's bf16 params with
    fp32 masters must equal after rounding."""

    def __init__(self, model_bf16: nn.Module, opt_cls, **hyper):
        self.twin = copy.deepcopy(model_bf16)  # computes the bf16 gradients
        self.master = copy.deepcopy(model_bf16).float()
        self.opt = opt_cls(self.master.parameters(), **hyper)

    def backward(self, batch):
        for p in self.twin.parameters():
            p.grad = None
        loss_of(self.twin, batch).backward()
        for p, m in zip(self.twin.parameters(), self.master.parameters()):
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad + g

    def step(self):
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.twin.parameters(), self.master.parameters()):
                p.copy_(m)

    def edit(self, fn):
        """Apply an in-place edit to the model's weights, as the user does to ours."""
        with torch.no_grad():
            for p, m in zip(self.twin.parameters(), self.master.parameters()):
                fn(p)
                m.copy_(p)


# --- the fp32 master of a bf16 parameter (item 1) -----------------------------------------


@pytest.mark.parametrize("edit", ["load_state_dict", "clamp_", "nn.init", "ema_swap"])
def test_in_place_edits_of_bf16_params_are_kept_by_the_next_step(edit):
    model = mlp(0, torch.bfloat16)
    other = mlp(7, torch.bfloat16)  # "pretrained" weights
    opt = fused_accum.AdamW(model.parameters(), lr=1e-3, accum_steps=2)
    ref = Bf16Reference(model, torch.optim.AdamW, lr=1e-3, fused=True)  # (our kernels follow fused=True)
    data = iter(batches(8, dtype=torch.bfloat16))

    def window():
        for _ in range(2):
            batch = next(data)
            loss_of(model, batch).backward()
            ref.backward(batch)
        opt.step()
        opt.zero_grad()
        ref.step()

    window()
    if edit == "load_state_dict":
        model.load_state_dict(other.state_dict())
        ref.twin.load_state_dict(other.state_dict())
        with torch.no_grad():
            for m, p in zip(ref.master.parameters(), ref.twin.parameters()):
                m.copy_(p)
    elif edit == "clamp_":
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.01, 0.01)
        ref.edit(lambda p: p.clamp_(-0.01, 0.01))
    elif edit == "nn.init":
        torch.manual_seed(3)
        nn.init.normal_(model[0].weight)
        torch.manual_seed(3)
        ref.edit(lambda p: nn.init.normal_(p) if p.shape == model[0].weight.shape else None)
    else:  # evaluate with other weights, then swap back: the master keeps its fp32 precision
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
    window()
    window()
    assert_close(model, ref.master, BF16_RTOL)
    if edit == "clamp_":  # torch: at most 0.01 + two steps of about lr
        assert max(p.abs().max().item() for p in model.parameters()) <= 0.0125


def test_optimizer_checkpoint_then_model_checkpoint_keeps_the_exact_master():
    """Resuming in either order: the model's bf16 weights are the checkpoint's, which the saved
    fp32 master rounds to, so the master stays the saved one, bit for bit."""
    model = mlp(0, torch.bfloat16)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
    for batch in batches(3, dtype=torch.bfloat16):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    fresh = mlp(5, torch.bfloat16)
    fresh_opt = fused_accum.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(saved_opt)
    fresh.load_state_dict(saved_model)  # after the optimizer's: bumps every param's version
    state = fresh_opt.state_dict()["state"]
    for i in range(len(list(fresh.parameters()))):
        assert torch.equal(state[i]["master"], saved_opt["state"][i]["master"])


# --- the window's norm and non-finite flag (item 3) ---------------------------------------


def _sgd_pair(**ours_kwargs):
    model, ref = mlp(0), mlp(0)
    opt = fused_accum.SGD(model.parameters(), lr=0.1, momentum=0.9, **ours_kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    return model, opt, ref, ref_opt


def test_grad_scaler_unscale_then_step_clips_the_unscaled_gradient():
    """scaler.unscale_(opt) after the last backward, then scaler.step(opt): max_grad_norm must
    see the unscaled .grad, not the scaled sums its last accumulate pass saw (256x off)."""
    k = 3
    model, opt, ref, ref_opt = _sgd_pair(accum_steps=k, max_grad_norm=0.05)
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
    data = batches(2 * k)
    for w in range(2):
        for batch in data[w * k : (w + 1) * k]:
            scalers[0].scale(loss_of(model, batch)).backward()
            scalers[1].scale(loss_of(ref, batch)).backward()
        scalers[0].unscale_(opt)
        scalers[1].unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        for scaler, o in zip(scalers, (opt, ref_opt)):
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert_close(model, ref)


@pytest.mark.parametrize("edit", ["clip_grad_value_", "mul_"])
def test_grad_edits_after_the_last_backward_reach_the_clip(edit):
    k = 2
    model, opt, ref, ref_opt = _sgd_pair(accum_steps=k, max_grad_norm=0.05)
    for w, batch in enumerate(batches(2 * k)):
        loss_of(model, batch).backward()
        loss_of(ref, batch).backward()
        if w % k == k - 1:
            for m in (model, ref):
                if edit == "clip_grad_value_":
                    torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
                else:
                    for p in m.parameters():
                        p.grad.mul_(0.25)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    assert_close(model, ref)


def test_a_repaired_nonfinite_gradient_is_not_skipped():
    """skip_nonfinite=True, a NaN in one element of the last micro-batch's gradient, repaired by
    the user with nan_to_num_ before step(): the step is taken, as torch takes it on the repaired
    .grad (the non-finite flag of the last accumulate pass describes values that are gone)."""
    k = 2
    model, opt, ref, ref_opt = _sgd_pair(accum_steps=k, skip_nonfinite=True)
    poison = torch.zeros(16)
    poison[3] = float("nan")  # d/d bias of (bias * poison).sum(): NaN in element 3 only
    data = batches(2)
    for m in (model, ref):
        loss_of(m, data[0]).backward()
        (loss_of(m, data[1]) + (m[0].bias * poison).sum()).backward()
        assert m[0].bias.grad.isnan().sum() == 1
        for p in m.parameters():
            p.grad.nan_to_num_(nan=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    ref_opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert_close(model, ref)


# --- opt.state as the user edits it (items 8 and 10) ----------------------------------------


@pytest.mark.parametrize("reset", ["del", "empty", "clear", "new_dict", "assign_tensor"])
def test_resetting_optimizer_state_restarts_it_as_torch_does(reset):
    model, ref = mlp(0), mlp(0)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(5)
    for i, batch in enumerate(data):
        if i == 2:
            for o, m in ((opt, model), (ref_opt, ref)):
                p = m[0].weight
                if reset == "del":
                    del o.state[p]
                elif reset == "empty":
                    o.state[p] = {}
                elif reset == "clear":
                    o.state.clear()
                elif reset == "new_dict":
                    o.state = type(ref_opt.state)(dict)
                else:
                    o.state[p]["exp_avg"] = torch.full_like(p, 0.5, dtype=torch.float32)
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    assert_close(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])
        assert rel_err(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]) <= RTOL


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_sgd_momentum_switched_on_later_starts_its_buffer_from_the_gradient(dampening):
    model, ref = mlp(0), mlp(0)
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, batch in enumerate(batches(4)):
        if i == 2:
            for o in (opt, ref_opt):
                o.param_groups[0].update(momentum=0.9, dampening=dampening)
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    assert_close(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]) <= RTOL


# --- the window's start (item 9) ----------------------------------------------------------


@pytest.mark.parametrize("when", ["at_start", "after_zero_grad"])
def test_a_grad_assigned_before_the_first_backward_is_added_to(when):
    model, opt, ref, ref_opt = _sgd_pair()
    data = batches(3)
    if when == "after_zero_grad":
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, data[0]).backward()
            o.step()
            o.zero_grad()
    gen = torch.Generator().manual_seed(9)
    assigned = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    for m in (model, ref):
        m[2].bias.grad = assigned[3].clone()
    for m, o in ((model, opt), (ref, ref_opt)):
        loss_of(m, data[1]).backward()
        loss_of(m, data[2]).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= RTOL
    opt.step()
    ref_opt.step()
    assert_close(model, ref)


# --- a model moved or cast after the optimizer was built (item 2) ---------------------------


def test_a_model_cast_to_bf16_after_the_optimizer_keeps_fused_fp32_accumulation():
    """model.to(torch.bfloat16) after building the optimizer replaces every AccumulateGrad node:
    the next zero_grad() hooks the new ones, the flat groups gain fp32 masters, and training
    equals torch's AdamW over fp32 masters of the bf16 weights."""
    model = mlp(0)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-3, accum_steps=2)
    params = list(model.parameters())
    model.to(torch.bfloat16)
    assert all(p is q for p, q in zip(params, model.parameters()))  # (what the optimizer holds)
    opt.zero_grad()
    ref = Bf16Reference(model, torch.optim.AdamW, lr=1e-3, fused=True)
    data = iter(batches(6, dtype=torch.bfloat16))
    for _ in range(3):
        for j in range(2):
            batch = next(data)
            loss_of(model, batch).backward()
            ref.backward(batch)
            assert opt.microbatches == j + 1  # the hooks took the gradient
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref.step()
    assert_close(model, ref.master, BF16_RTOL)


def test_a_model_cast_after_a_step_on_the_generic_path_keeps_the_inner_optimizers_state():
    """optimizer=torch.optim.RMSprop, a step, then model.to(torch.bfloat16): the inner optimizer
    steps the new fp32 masters, its state carried over (before, the move raised KeyError: None).
    The reference: RMSprop over an fp32 copy, cast's rounding applied to it alike."""
    model, twin = mlp(0), mlp(0)
    opt = fused_accum.FusedAccumOptimizer(model.parameters(), torch.optim.RMSprop, lr=1e-3)
    ref_opt = torch.optim.RMSprop(twin.parameters(), lr=1e-3)
    data = batches(4)
    for batch in data[:2]:
        for m, o in ((model, opt), (twin, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    model.to(torch.bfloat16)
    with torch.no_grad():
        for q in twin.parameters():
            q.copy_(q.bfloat16().float())  # (what the cast leaves as the new masters)
    ref = Bf16Reference(model, torch.optim.RMSprop, lr=1e-3)
    ref.master.load_state_dict(twin.state_dict())
    ref.opt = ref_opt  # its state carries on, over the twin's parameters as masters
    ref.master = twin
    for batch in data[2:]:
        batch = tuple(t.bfloat16() for t in batch)
        loss_of(model, batch).backward()
        ref.backward(batch)
        opt.step()
        opt.zero_grad()
        ref.step()
    assert set(opt.state[model[0].weight]) == {"step", "square_avg"}
    assert_close(model, ref.master, BF16_RTOL)


def test_a_model_moved_without_zero_grad_is_fused_again_from_its_next_window():
    model = mlp(0)
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    model.to(torch.bfloat16)  # (no device but the CPU here: a cast replaces the nodes as a move does)
    data = batches(4, dtype=torch.bfloat16)
    loss_of(model, data[0]).backward()  # the stale nodes: autograd accumulates natively
    assert model[0].weight.grad.dtype == torch.bfloat16 and opt.microbatches == 0
    opt.step()  # takes the native .grad, hooks the new nodes
    opt.zero_grad()
    loss_of(model, data[1]).backward()
    assert model[0].weight.grad.dtype == torch.float32 and opt.microbatches == 1


# --- step_in_backward and gradual unfreezing (item 6) ---------------------------------------


def test_step_in_backward_trains_a_parameter_unfrozen_later():
    model, ref = mlp(0), mlp(0)
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
    opt = fused_accum.SGD(model.parameters(), lr=0.1, momentum=0.9, accum_steps=2, step_in_backward=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    data = batches(6)
    for w in range(3):
        if w == 1:
            for m in (model, ref):
                m[0].weight.requires_grad_(True)
        for m, o in ((model, opt), (ref, ref_opt)):
            for batch in data[2 * w : 2 * w + 2]:
                loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    assert_close(model, ref)


# --- another optimizer over the same parameters (item 13) -----------------------------------


def test_a_torch_optimizer_over_hooked_bf16_params_takes_them_over():
    model = mlp(0, torch.bfloat16)
    fused = fused_accum.AdamW(model.parameters(), lr=1e-2)
    data = batches(3, dtype=torch.bfloat16)
    loss_of(model, data[0]).backward()
    loss_of(model, data[1]).backward()
    sums = [fused.accumulated_grad(p).clone() for p in model.parameters()]
    twin = copy.deepcopy(model)
    for q, g in zip(twin.parameters(), sums):
        q.grad = g.to(torch.bfloat16)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_opt.step()  # was: "expected dtype BFloat16 for end"
    torch.optim.AdamW(twin.parameters(), lr=1e-2).step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    torch_opt.zero_grad()
    loss_of(model, data[2]).backward()  # autograd's own accumulation again
    assert model[0].weight.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="can no longer step"):
        fused.step()


# --- GradScaler stays fused, and nothing else is told the optimizer cannot be clipped (item 11)


def test_only_grad_scaler_is_told_that_the_step_unscales():
    opt = fused_accum.AdamW(mlp(0).parameters())
    assert getattr(opt, "_step_supports_amp_scaling", False) is False  # e.g. Lightning's check

    class Spy(torch.amp.GradScaler):
        unscaled = 0

        def unscale_(self, optimizer):
            Spy.unscaled += 1
            return super().unscale_(optimizer)

    model, ref = mlp(0), mlp(0)
    opt = fused_accum.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scalers = [Spy("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]
    for batch in batches(3):
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            scaler.scale(loss_of(m, batch)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert Spy.unscaled == 0  # the fused path: GradScaler never unscaled .grad itself
    assert_close(model, ref)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_with_one_process_owns_grad_and_we_stand_aside(tmp_path, bucket_view):
    """``torchrun --nproc_per_node=1`` with a script that always wraps in DDP: DDP's reducer
    fills ``.grad``, so the hooks must stand aside as with more ranks (else both write it:
    0.097 off, and with ``gradient_as_bucket_view`` DDP raises)."""

    with one_rank_world(tmp_path):
        ours, ref = mlp(), mlp()
        ddp = nn.parallel.DistributedDataParallel(ours, gradient_as_bucket_view=bucket_view)
        opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
        torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        data = batches(6)
        for window in (data[:3], data[3:]):
            for batch in window:
                loss_of(ddp, batch).backward()
                loss_of(ref, batch).backward()
            opt.step()
            torch_opt.step()
            opt.zero_grad()
            torch_opt.zero_grad()
        assert_close(ours, ref)


def test_create_graph_grad_carries_no_graph_and_says_so_as_documented():
    """docs/differences.md: after ``backward(create_graph=True)`` ``.grad`` is the
    fp32 running sum without a graph; differentiating it raises torch's own error, and the
    documented route (``torch.autograd.grad(..., create_graph=True)``) gives torch's numbers."""
    ours, ref = mlp(), mlp()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    batch = batches(1)[0]
    loss_of(ours, batch).backward(create_graph=True)
    weight = ours[0].weight
    assert weight.grad.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        torch.autograd.grad(weight.grad.square().sum(), weight)
    (g_ours,) = torch.autograd.grad(loss_of(ours, batch), weight, create_graph=True)
    (g_ref,) = torch.autograd.grad(loss_of(ref, batch), ref[0].weight, create_graph=True)
    (hvp_ours,) = torch.autograd.grad(g_ours.square().sum(), weight)
    (hvp_ref,) = torch.autograd.grad(g_ref.square().sum(), ref[0].weight)
    assert rel_err(hvp_ours, hvp_ref) == 0  # the same graph on the same values: torch's numbers
    assert opt.microbatches == 1  # (autograd.grad leaves the window alone)


# --- behaviours the suite did not pin (issue 26, "Tests the suite is missing") ------------------


def test_a_grad_cleared_after_the_last_backward_drops_out_of_max_grad_norm():
    """``p.grad = None`` after the window's last backward: the clip's norm is torch's
    clip_grad_norm_ over the gradients left (the last pass had already added it in)."""
    model, ref = mlp(0), mlp(0)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=2, max_grad_norm=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(6)
    for w in range(3):
        for m in (model, ref):
            for batch in data[2 * w : 2 * w + 2]:
                (loss_of(m, batch) / 2).backward()
            m[2].weight.grad = None
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        ref_opt.step()
        assert_rel(opt.last_grad_norm, ref_norm, RTOL, f"window {w}: the norm")
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_close(model, ref)


def test_step_in_backward_rereads_bf16_params_edited_between_windows():
    """An in-place edit of bf16 parameters between windows (``p.mul_(0.5)``) reaches the masters
    before the backward that steps: bit-equal to the same run stepping at step()."""
    runs = []
    for step_in_backward in (True, False):
        model = mlp(0, torch.bfloat16)
        opt = fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=2, step_in_backward=step_in_backward)
        for w, window in enumerate(batches(6, dtype=torch.bfloat16)[i : i + 2] for i in range(0, 6, 2)):
            if w == 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
            for batch in window:
                (loss_of(model, batch) / 2).backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


def test_a_state_dict_after_an_in_place_edit_of_bf16_params_holds_the_edited_master():
    """state_dict() after ``p.mul_(0.5)`` and before any step: the saved master is the edited
    weight's, so the run resumed from it is bit-equal to the uninterrupted one."""

    def run(resume: bool):
        model = mlp(0, torch.bfloat16)
        opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
        data = batches(4, dtype=torch.bfloat16)
        for i, batch in enumerate(data):
            if i == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
                if resume:
                    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
                    model = mlp(1, torch.bfloat16)
                    model.load_state_dict(saved[0])
                    opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
                    opt.load_state_dict(saved[1])
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
        return model

    for p, q in zip(run(False).parameters(), run(True).parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_mid_window_replaces_the_window_a_documented_difference():
    """``load_state_dict`` in a live window replaces it by the checkpoint's (a checkpoint holds
    its window: ``accum`` mid-window), where torch's leaves ``.grad`` alone (docs/differences.md): loaded from a window boundary, ``.grad`` is None and the next step starts
    from the gradients after the load, as the checkpointed run would."""
    model, twin = mlp(0), mlp(0)
    opt, twin_opt = (fused_accum.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    data = batches(3)
    saved = opt.state_dict()  # at a window boundary: no accum
    loss_of(model, data[0]).backward()
    opt.load_state_dict(saved)
    assert all(p.grad is None for p in model.parameters()) and opt.microbatches == 0
    loss_of(model, data[1]).backward()
    loss_of(twin, data[1]).backward()
    mid = twin_opt.state_dict()  # mid-window: its accum is data[1]'s gradient
    loss_of(model, data[2]).backward()
    opt.load_state_dict(mid)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert opt.microbatches == 1


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_called_by_a_tensor_hook_mid_backward_starts_the_window_there(set_to_none, hooks):
    """A hook that calls ``opt.zero_grad()`` during a backward: what arrived before is
    discarded and what arrives after is the new window, as torch's ``.grad`` shows it; the
    count includes that backward."""
    seen, counts = [], []
    for impl in ("ours", "torch"):
        model = mlp(0)
        opt = (fused_accum.SGD if impl == "ours" else torch.optim.SGD)(model.parameters(), lr=0.1)
        calls = []

        def hook(grad, opt=opt, calls=calls):
            calls.append(1)
            if len(calls) == 2:
                opt.zero_grad(set_to_none=set_to_none)
            return grad

        model[2].weight.register_hook(hook)  # (the head: reached first, so body arrives after)
        grads = []
        for batch in batches(4):
            loss_of(model, batch).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            if impl == "ours":
                counts.append(opt.microbatches)
        opt.step()
        seen.append((grads, [p.detach().clone() for p in model.parameters()]))
    (ours, ours_params), (ref, ref_params) = seen
    for i, (got, want) in enumerate(zip(ours, ref)):
        for g, w in zip(got, want):
            assert (g is None) == (w is None), f"backward {i}"
            if w is not None:
                assert_rel(g, w, RTOL, f"backward {i}: .grad")
    for p, q in zip(ours_params, ref_params):
        assert_rel(p, q)
    assert counts == [1, 1, 2, 3]


def test_a_post_accumulate_grad_hook_under_create_graph_sees_the_backwards_gradient_a_documented_difference(
    hooks,
):
    """With ``backward(create_graph=True)`` torch's post-accumulate-grad hook sees ``.grad`` as
    the running sum with its graph (g1 + g2 at the second backward). Here the gradient with a
    graph goes through AccumulateGrad alone, so the hook sees that backward's gradient (g2,
    with its graph); after the backward ``.grad`` is the fp32 running sum, without a graph
    (docs/differences.md)."""

    def run(ours: bool):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(3))
        opt = fused_accum.SGD([w], lr=0.1) if ours else None  # (kept: deleted, it unhooks)
        seen = []
        w.register_post_accumulate_grad_hook(lambda p: seen.append((p.grad.detach().clone(), p.grad.grad_fn)))
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            ((w * torch.randn(3, generator=gen)).sum() ** 2).backward(create_graph=True)
        assert opt is None or opt.microbatches == 2
        return seen, w.grad.detach().clone(), w.grad.grad_fn

    ours, ours_grad, ours_fn = run(True)
    ref, ref_grad, ref_fn = run(False)
    assert torch.equal(ours[0][0], ref[0][0]) and ours[0][1] is not None  # g1, with its graph
    g2 = ref[1][0] - ref[0][0]
    assert_rel(ours[1][0], g2, RTOL, "the second hook: g2")
    assert ours[1][1] is not None
    assert_rel(ours_grad, ref_grad, RTOL, ".grad after: the running sum")
    assert ref_fn is not None and ours_fn is None


def test_under_ddp_a_branch_left_unused_after_model_zero_grad_is_not_stepped_again(tmp_path):
    """One process, gloo, ``find_unused_parameters=True``: after ``model.zero_grad()`` a window
    that does not use a branch gives it no gradient, so the step leaves it (and its state) alone,
    as torch's does."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.branch = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x, use_branch=True):
            out = self.trunk(x)
            return out + self.branch(x) if use_branch else out

    with one_rank_world(tmp_path):
        ours, ref = Branchy(), Branchy()
        ddp = nn.parallel.DistributedDataParallel(ours, find_unused_parameters=True)
        opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        data = batches(4)
        for i, (x, y) in enumerate(data):
            use = i < 2
            for model, o in ((ddp, opt), (ref, ref_opt)):
                o.zero_grad() if i == 0 else (ours if model is ddp else ref).zero_grad()
                (model(x, use) - y).square().mean().backward()
                o.step()
        assert_close(ours, ref)
        assert float(opt.state[ours.branch.weight]["step"]) == float(ref_opt.state[ref.branch.weight]["step"]) == 2


def test_a_float64_grad_assigned_to_a_bf16_parameter_steps_as_its_float32_value():
    # torch accepts any float .grad on a bf16 parameter whose grad_dtype is None (ours are); the
    # step takes every assigned .grad of a flat group in one accumulate call, whose kernels read
    # fp32, bf16 and fp16: a float64 one is widened first (it raised "must be float32...").
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16))
    ref = torch.nn.Parameter(p.detach().float().clone())
    opt = fused_accum.SGD([p], lr=0.1, master_weights=True)
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    grad = torch.randn(6, 4, dtype=torch.float64).t()  # (not contiguous either)
    p.grad = grad
    ref.grad = grad.float()
    opt.step()
    ref_opt.step()
    assert torch.equal(p, ref.detach().to(torch.bfloat16))
