"""Training loops users write, each against torch.optim running the same loop (issue 26).

Each test runs one loop twice, once on a fused_accum optimizer and once on torch.optim's, from
equal models fed the same data, and compares what a user sees: parameters, state and ``.grad``.
Where fused_accum deliberately differs from torch, the test pins the documented difference
(docs/differences.md).

Tolerances: fp32 parameters within helpers.RTOL = 1e-6 relative (the sums are formed in torch's
order, so a correct step is a few ulp off torch's fused kernels; the bugs pinned here, a step
lost or taken twice, state restarted, an edit ignored, are >= 1e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_accum
from fused_accum.flat import ACTIVE_SETS_KEPT
from helpers import RTOL, assert_rel, data, mse, twins  # tests/helpers.py

TORCH = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
OURS = {"SGD": fused_accum.SGD, "Adam": fused_accum.Adam, "AdamW": fused_accum.AdamW}
HYPER = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "Adam": dict(lr=1e-2, weight_decay=0.1),
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
}


def assert_models_match(ours, ref, rtol=RTOL):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert_rel(p, q, rtol, f"parameter {name}")


# --- torch.compile(opt.step) ------------------------------------------------------------------


# aot_eager for every algorithm, inductor once (its C++ compile takes seconds)
@pytest.mark.parametrize(
    "name, backend", [(n, "aot_eager") for n in ("SGD", "Adam", "AdamW", "Lion")] + [("AdamW", "inductor")]
)
def test_a_compiled_step_trains_as_the_eager_one(name, backend, one_thread):
    """PyTorch's "compile the optimizer step" recipe: the compiled step equals the eager one."""
    ours, eager = twins()
    cls = fused_accum.Lion if name == "Lion" else OURS[name]
    hyper = dict(lr=1e-3) if name == "Lion" else HYPER[name]
    opt, eager_opt = cls(ours.parameters(), **hyper), cls(eager.parameters(), **hyper)
    compiled_step = torch.compile(opt.step, backend=backend)
    before = [p.detach().clone() for p in ours.parameters()]
    for x, y in data(4):
        mse(ours, x, y).backward()
        compiled_step()
        opt.zero_grad()
        mse(eager, x, y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    for (name_, p), q, p0 in zip(ours.named_parameters(), eager.parameters(), before):
        assert not torch.equal(p, p0), f"{name_} did not move"
        assert torch.equal(p, q), f"{name_}: the compiled step differs from the eager one"


# --- resume after gradual unfreezing ---------------------------------------------------------


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _unfreezing_run(cls, hyper, batches, checkpoint_at=None, unfreeze_before_load=True):
    """head frozen for 2 steps, then trained; with ``checkpoint_at``, the run is saved after that
    many steps and resumed into a new model and optimizer built as at the start (head frozen)."""
    model = Two()
    model.head.requires_grad_(False)
    opt = cls(model.parameters(), **hyper)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            model.head.requires_grad_(True)  # gradual unfreezing: no add_param_group
        if i == checkpoint_at:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            model = Two()
            model.head.requires_grad_(False)
            opt = cls(model.parameters(), **hyper)
            model.load_state_dict(saved[0])
            if unfreeze_before_load:
                model.head.requires_grad_(True)
            opt.load_state_dict(saved[1])
            model.head.requires_grad_(True)
        mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("unfreeze_before_load", [True, False], ids=["unfrozen-at-load", "frozen-at-load"])
@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_a_resume_after_gradual_unfreezing_keeps_the_unfrozen_layers_state(name, unfreeze_before_load):
    batches = data(8)
    ref, ref_opt = _unfreezing_run(TORCH[name], HYPER[name], batches)
    ours, opt = _unfreezing_run(
        OURS[name], HYPER[name], batches, checkpoint_at=5, unfreeze_before_load=unfreeze_before_load
    )
    assert_models_match(ours, ref)
    if name == "AdamW":
        assert float(opt.state[ours.head.weight]["step"]) == float(ref_opt.state[ref.head.weight]["step"]) == 6


# --- step_in_backward and a backward meant for another model ---------------------------------


class Gen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, z):
        return self.net(z)


class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def _dcgan(opt_d_cls, opt_g_cls, d_kwargs, iters=5, zero_with="model", d_backwards=2):
    """The DCGAN loop: D steps on real and fake (one backward each, or one of their sum), then
    G's loss, which flows through D, steps G. D's gradients from G's loss are discarded by D's
    zero_grad at the next iteration."""
    netG, netD = Gen(), Disc()
    optD = opt_d_cls(netD.parameters(), lr=1e-2, **d_kwargs)
    optG = opt_g_cls(netG.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    bce = nn.BCEWithLogitsLoss()
    steps_d = 0
    for _ in range(iters):
        real, z = torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)
        (netD if zero_with == "model" else optD).zero_grad()
        fake = netG(z)
        err_real = bce(netD(real), torch.ones(5, 1))
        err_fake = bce(netD(fake.detach()), torch.zeros(5, 1))
        if d_backwards == 2:
            err_real.backward()
            err_fake.backward()
        else:
            (err_real + err_fake).backward()
        optD.step()
        steps_d += 1
        netG.zero_grad()
        bce(netD(fake), torch.ones(5, 1)).backward()  # reaches D's parameters too
        optG.step()
    return netD, netG


@pytest.mark.parametrize("d_backwards", [1, 2])
@pytest.mark.parametrize("zero_with", ["model", "optimizer"])
def test_step_in_backward_does_not_step_on_a_backward_meant_for_another_model(zero_with, d_backwards):
    ref_d, ref_g = _dcgan(torch.optim.AdamW, torch.optim.AdamW, {}, zero_with=zero_with, d_backwards=d_backwards)
    ours_d, ours_g = _dcgan(
        fused_accum.AdamW,
        fused_accum.AdamW,
        dict(accum_steps=d_backwards, step_in_backward=True),
        zero_with=zero_with,
        d_backwards=d_backwards,
    )
    assert_models_match(ours_d, ref_d)
    assert_models_match(ours_g, ref_g)


def test_step_in_backward_steps_at_step_and_says_so_when_no_zero_grad_started_the_window():
    """A window not started by zero_grad() after the last step() is not stepped in backward (it
    may be another model's); it steps at step(), exactly, with one warning."""
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, step_in_backward=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = data(6)
    with pytest.warns(UserWarning, match="began without zero_grad"):
        for i in range(0, 6, 2):
            for model in (ours, ref):
                for x, y in batches[i : i + 2]:
                    (mse(model, x, y) / 2).backward()
            opt.step()
            ref_opt.step()
            ours.zero_grad()  # the model's: nothing shows after a step in backward, so unseen
            ref.zero_grad()
    assert_models_match(ours, ref)


# --- optimizers that wrap ours --------------------------------------------------------------


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation (Foret et al. 2021), as its widely copied implementation
    writes it: a torch.optim.Optimizer over the base optimizer's param groups, whose step(closure)
    perturbs the weights, re-evaluates, restores them through ``p.data`` and steps the base."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm(2) for g in self.param_groups for p in g["params"]]), 2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure):
        self.first_step()
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_sam_over_ours_steps_as_sam_over_torch(name):
    ours, ref = twins()
    opts = [SAM(m.parameters(), base, **HYPER[name]) for m, base in ((ours, OURS[name]), (ref, TORCH[name]))]
    for x, y in data(4):
        for model, opt in zip((ours, ref), opts):

            def closure(model=model):
                mse(model, x, y).backward()

            closure()
            opt.step(closure)
            opt.zero_grad()
    assert_models_match(ours, ref)


class Delegating(torch.optim.Optimizer):
    """A trainer's wrapper: a torch.optim.Optimizer that keeps ours in ``.optimizer`` and
    delegates step() and zero_grad() to it (its param_groups are ours)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, {})
        self.param_groups = optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


def test_a_wrapper_that_keeps_ours_in_optimizer_steps_as_torch_sgd():
    ours, ref = twins()
    opt = Delegating(fused_accum.SGD(ours.parameters(), **HYPER["SGD"]))
    ref_opt = torch.optim.SGD(ref.parameters(), **HYPER["SGD"])
    batches = data(6)
    for i in range(0, 6, 3):
        for model, o in ((ours, opt), (ref, ref_opt)):
            for x, y in batches[i : i + 3]:
                (mse(model, x, y) / 3).backward()
            o.step()
            o.zero_grad()
    assert_models_match(ours, ref)


class OwnGroupsWrapper(torch.optim.Optimizer):
    """A wrapper optimizer: keeps the inner one in ``.optimizer``, builds its own param groups
    over the same parameters (not the inner one's dicts) and delegates step() and zero_grad()."""

    def __init__(self, optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


# guards: fused_accum.owners.is_ours searching only one optimizer deep (`depth=1`), or not
# following an attribute holding an optimizer: the outer wrapper's step would be taken for a
# foreign optimizer's, which takes the parameters over (docs/differences.md: an optimizer that
# holds ours and steps through it is not another owner), and the fused SGD would stand aside.
def test_two_nested_wrappers_with_their_own_param_groups_train_as_torch_sgd(one_thread):
    ours, ref = twins()
    inner = fused_accum.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    outer = OwnGroupsWrapper(OwnGroupsWrapper(inner))
    assert outer.param_groups[0] is not inner.param_groups[0]  # (not SAM's shared groups)
    assert outer.optimizer.param_groups[0] is not inner.param_groups[0]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    batches = data(6, seed=2)
    for i in range(0, 6, 2):  # three steps of 2 micro-batches
        for model, o in ((ours, outer), (ref, ref_opt)):
            for x, y in batches[i : i + 2]:
                (mse(model, x, y) / 2).backward()
            o.step()
            o.zero_grad()
        assert_models_match(ours, ref)  # fp32, within RTOL = 1e-6
    assert all(float(inner.state[p]["momentum_buffer"].abs().sum()) > 0 for p in ours.parameters())


# --- routing that changes the active set every step -------------------------------------------


def test_a_new_set_of_active_parameters_every_step_keeps_memory_bounded(one_thread):
    """Mixture-of-experts routing: 64 experts, 4 used per step. torch keeps no per-set state;
    the optimizer's device index of each partial active set is cached, a bounded number."""
    experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(64))
    ref = copy.deepcopy(experts)
    opt = fused_accum.AdamW(experts.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        chosen = torch.randperm(64, generator=gen)[:4].tolist()
        x = torch.randn(3, 4, generator=gen)
        for model, o in ((experts, opt), (ref, ref_opt)):
            sum(model[i](x).square().mean() for i in chosen).backward()
            o.step()
            o.zero_grad()
    assert_models_match(experts, ref)
    assert all(len(flat._index_cache) <= ACTIVE_SETS_KEPT for flat in opt._window.flat_groups)


# guards: FlatGroup.active_index evicting in insertion order (a FIFO: `cache.get(indices)` in
# place of `cache.pop(indices, None)`, so a hit is not moved to the most recent end): the hot set
# would be evicted by the 16th new set and get a new index tensor (a host-to-device copy) after.
def test_a_hot_active_set_keeps_its_index_tensor_while_17_new_sets_pass(one_thread):
    """The active-set index cache is least recently used: a set used every other step keeps its
    one index tensor while ACTIVE_SETS_KEPT + 1 = 17 new sets, each used once, go through."""
    experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(20))
    ref = copy.deepcopy(experts)
    opt = fused_accum.AdamW(experts.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    (flat,) = opt._window.flat_groups
    given = []  # (active slot indices, the index tensor returned), each call of a step
    original = flat.active_index

    def recording(indices):
        index = original(indices)
        given.append((indices, index))
        return index

    flat.active_index = recording
    hot = [0, 1]
    new_sets = [[2 + i] for i in range(ACTIVE_SETS_KEPT + 1)]  # 17 distinct sets, each used once
    schedule = [hot]
    for chosen in new_sets:
        schedule += [chosen, hot]
    gen = torch.Generator().manual_seed(0)
    for chosen in schedule:
        x = torch.randn(3, 4, generator=gen)
        for model, o in ((experts, opt), (ref, ref_opt)):
            sum(model[i](x).square().mean() for i in chosen).backward()
            o.step()
            o.zero_grad()
    hot_key = tuple(hot)
    hot_indices = [index for indices, index in given if indices == hot_key]
    assert len(hot_indices) == len(schedule) - len(new_sets)  # (each hot step asked for it)
    assert all(index is hot_indices[0] for index in hot_indices), "the hot set's index tensor was made again"
    assert hot_indices[0].tolist() == hot
    new_indices = {id(index) for indices, index in given if indices != hot_key}
    assert len(new_indices) == len(new_sets)  # (each new set made its own)
    assert len(flat._index_cache) == ACTIVE_SETS_KEPT  # (bounded: the cache did evict)
    assert flat._index_cache[hot_key] is hot_indices[0]
    assert_models_match(experts, ref)  # the steps of each set, against torch's: within RTOL


# --- .grad as a user sees it ------------------------------------------------------------------


def test_assigning_grad_data_replaces_the_gradient_as_in_torch():
    """``p.grad.data = t``: the step uses t, and later backwards show in ``.grad`` again."""

    def run(model, opt):
        seen = []
        batches = data(6)
        for w in range(3):
            x, y = batches[2 * w]
            (mse(model, x, y) / 2).backward()
            model.body.weight.grad.data = model.body.weight.grad.data * 3.0  # a new tensor
            x, y = batches[2 * w + 1]
            (mse(model, x, y) / 2).backward()
            seen.append(model.body.weight.grad.clone())
            model.head.weight.grad.data = torch.full_like(model.head.weight.grad, 0.5)  # after the last
            opt.step()
            opt.zero_grad()
        return seen

    ours, ref = twins()
    seen = run(ours, fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2))
    ref_seen = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    for w, (got, want) in enumerate(zip(seen, ref_seen)):
        assert_rel(got, want, RTOL, f"window {w}: .grad after the edit and a backward")
    assert_models_match(ours, ref)


def test_a_grad_kept_by_reference_is_the_live_sum_a_documented_difference():
    """torch allocates a new ``.grad`` after ``zero_grad()``; here ``.grad`` is a view of the
    persistent fp32 accumulator (no allocation per window), so a ``.grad`` kept across
    ``zero_grad()`` is overwritten by the next window's gradient: ``.clone()`` it to keep it
    (docs/differences.md)."""
    model, _ = twins()
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    (x0, y0), (x1, y1) = data(2)
    mse(model, x0, y0).backward()
    kept, copied = model.body.weight.grad.detach(), model.body.weight.grad.clone()
    opt.step()
    opt.zero_grad()
    mse(model, x1, y1).backward()
    assert torch.equal(kept, model.body.weight.grad)  # the live sum, as documented
    assert not torch.equal(copied, model.body.weight.grad)  # a clone keeps the old window's


def test_a_user_owned_grad_buffer_is_taken_once_a_documented_difference():
    """The contiguous-grad-buffer idiom (``p.grad = buffer[view]`` once, then
    ``zero_grad(set_to_none=False)`` each window): the assigned tensor is taken as the
    parameter's gradient and ``.grad`` then shows the optimizer's fp32 buffer; backward adds
    there, not into the user's buffer (docs/differences.md). Writes through
    ``p.grad`` reach the step, as in torch."""
    model, ref = twins()
    opt = fused_accum.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m in (model, ref):
        total = sum(p.numel() for p in m.parameters())
        buf, start = torch.zeros(total), 0
        for p in m.parameters():
            p.grad = buf[start : start + p.numel()].view_as(p)
            start += p.numel()
        m.buf = buf
    for x, y in data(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            mse(m, x, y).backward()
            for p in m.parameters():
                p.grad.mul_(0.5)  # an in-place edit through p.grad (an all-reduce's average)
            o.step()
    assert_models_match(model, ref)
    assert model.body.weight.grad.data_ptr() != model.buf.data_ptr()  # not the user's buffer
    assert not torch.equal(model.buf, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))


def test_grad_of_a_channels_last_parameter_is_contiguous_a_documented_difference():
    """torch's ``.grad`` keeps a channels_last parameter's strides; ours is a contiguous view of
    the flat buffer (equal values; docs/differences.md)."""
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    opt = fused_accum.AdamW(conv.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    conv(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert ref.weight.grad.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight.grad.is_contiguous() and torch.equal(conv.weight.grad, ref.weight.grad)
    opt.step()


# --- param groups edited in place -------------------------------------------------------------


@pytest.mark.parametrize("edit", ["append", "remove"])
def test_editing_a_groups_params_list_raises_at_the_next_step(edit):
    model = Two()
    opt = fused_accum.AdamW([model.body.weight], lr=1e-2)
    group = opt.param_groups[0]
    if edit == "append":
        group["params"].append(model.head.weight)
    else:
        group["params"].pop()
    mse(model, *data(1)[0]).backward()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.step()


# --- where the optimizer is built ---------------------------------------------------------------


@pytest.mark.parametrize("hooks_impl", ["cpp", "python"])
def test_an_optimizer_built_under_inference_mode_trains(hooks_impl, monkeypatch):
    if hooks_impl == "python":
        monkeypatch.setenv("FUSED_ACCUM_PYTHON_HOOKS", "1")
    ours, ref = twins()
    with torch.inference_mode():
        opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data(3):
        for m, o in ((ours, opt), (ref, ref_opt)):
            mse(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_models_match(ours, ref)


def test_an_optimizer_over_parameters_left_on_the_meta_device_says_to_build_it_after_to_empty():
    with torch.device("meta"):
        model = Two()
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
    model.to_empty(device="cpu")  # new Parameter objects: the optimizer's stay on meta
    for p in model.parameters():
        nn.init.normal_(p)
    mse(model, *data(1)[0]).backward()
    with pytest.raises(RuntimeError, match="after to_empty"):
        opt.step()


# --- smaller -------------------------------------------------------------------------------


def test_a_shallow_copy_is_another_handle_on_the_same_optimizer():
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    twin_opt, ref_twin = copy.copy(opt), copy.copy(ref_opt)
    assert twin_opt.param_groups is opt.param_groups and twin_opt.state is opt.state
    for i, (x, y) in enumerate(data(4)):
        for m, o in ((ours, (opt, twin_opt)[i % 2]), (ref, (ref_opt, ref_twin)[i % 2])):
            mse(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_models_match(ours, ref)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_fused_and_foreach_together_raise_as_torch(name):
    params = [nn.Parameter(torch.randn(3))]
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        TORCH[name](params, lr=0.1, fused=True, foreach=True)
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        OURS[name](params, lr=0.1, fused=True, foreach=True)
    OURS[name](params, lr=0.1, fused=True)  # (then it builds; the newest owner wins)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("what", ["lr", "betas"])
def test_tensor_hyperparameters_with_foreach_raise_as_torch(name, what):
    params = [nn.Parameter(torch.randn(3))]
    kwargs = dict(lr=torch.tensor(0.01)) if what == "lr" else dict(betas=(torch.tensor(0.9), torch.tensor(0.99)))
    with pytest.raises(ValueError) as torch_error:
        TORCH[name](params, foreach=True, **kwargs)
    with pytest.raises(ValueError) as our_error:
        OURS[name](params, foreach=True, **kwargs)
    assert str(our_error.value) == str(torch_error.value)
    OURS[name](params, foreach=True, capturable=True, **kwargs)  # capturable: accepted, as torch


def test_sgd_accepts_a_nan_lr_as_torch():
    params = [nn.Parameter(torch.randn(3))]
    torch.optim.SGD(params, lr=float("nan"))
    fused_accum.SGD(params, lr=float("nan"))
    for cls in (torch.optim.Adam, fused_accum.Adam):
        with pytest.raises(ValueError, match="Invalid learning rate"):
            cls(params, lr=float("nan"))
