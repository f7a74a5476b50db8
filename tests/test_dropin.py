"""fused_accum.SGD/Adam/AdamW/Lion as drop-in replacements for torch.optim (issue 14).

One regression test per numbered item of issue 14, named after the behaviour it pins (a
comment above each names its item; items 5 and 16 need several processes and live elsewhere),
one per optimizer bullet of its "Tests the suite is missing" (clipping with ``num_items``, the
generic path, a window after a raised backward or an unused branch), and the contract of its
"Newest optimizer wins" and "torch.optim's surface" sections (test_newest_*,
test_surface_*). Wherever torch.optim has an equivalent, the expected value is what torch.optim
does on a twin model fed the same data, with native ``.grad`` accumulation.

Public API only. Tolerances: fp32 values within RTOL = 1e-6 relative (helpers.RTOL: max abs
difference over the tensor's max abs value), unless a test states otherwise. The accumulated
sums are formed in the same order as torch's native ``.grad`` accumulation (fp32, one backward
after another), so a correct implementation is at a few ulp; a missing division, a wrong clip
factor or a skipped micro-batch is >= 1e-3.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fused_accum
from fused_accum import FusedAccumOptimizer
from helpers import Net, assert_params_match, assert_rel, data, mse, rel_err, twins  # tests/helpers.py
from lion_reference import LionReference  # tests/lion_reference.py

OURS = {"SGD": fused_accum.SGD, "Adam": fused_accum.Adam, "AdamW": fused_accum.AdamW, "Adagrad": fused_accum.Adagrad}
HYPER = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "Adam": dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "Adagrad": dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
}


# --- helpers ------------------------------------------------------------------------------


def hook_count(p) -> int:
    """Tensor hooks plus post-accumulate-grad hooks registered on ``p``."""
    return len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})


class _Boom(torch.autograd.Function):
    """Identity whose backward raises while ``owner.armed`` is set."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.owner.armed:
            ctx.owner.armed = False
            raise RuntimeError("boom: backward failed half-way")
        return grad, None


class BoomNet(Net):
    """Net whose backward can be made to fail between head (already accumulated) and body."""

    armed = False

    def forward(self, x):
        return self.head(_Boom.apply(torch.tanh(self.body(x)), self))


class AlbertNet(nn.Module):
    """One layer reused three times, each under checkpoint(use_reentrant=True): its gradient
    arrives in three pieces within one backward (ALBERT-style parameter sharing)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = checkpoint(self._block, h, use_reentrant=True)
        return self.out(h)


class InsideAndOutside(nn.Module):
    """``shared`` used inside a ``checkpoint(use_reentrant=True)`` call and again outside it
    (``pieces=True``): its gradient arrives in two pieces within one backward (the outer
    use's, then the nested backward's). ``pieces=False``: the same function without the
    checkpoint, one gradient per backward."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x, pieces=False):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self._block, h, use_reentrant=True) if pieces else self._block(h)
        return self.out(self._block(h))


# --- issue 14, numbered items ---------------------------------------------------------------


# issue 14, item 1
@pytest.mark.parametrize("name", list(OURS))
def test_group_params_given_as_generator_are_trained(name):
    """{"params": model.head.parameters(), "lr": ...}: the usual per-group form."""
    ours, ref = twins()
    hyper = dict(HYPER[name])
    opt = OURS[name](
        [{"params": ours.body.parameters()}, {"params": ours.head.parameters(), "lr": hyper["lr"] * 3}], **hyper
    )
    ropt = getattr(torch.optim, name)(
        [{"params": ref.body.parameters()}, {"params": ref.head.parameters(), "lr": hyper["lr"] * 3}], **hyper
    )
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    before = [p.detach().clone() for p in ours.parameters()]
    for x, y in data(3):
        mse(ours, x, y).backward()
        opt.step()
        opt.zero_grad()
        mse(ref, x, y).backward()
        ropt.step()
        ropt.zero_grad()
    for b, p in zip(before, ours.parameters()):
        assert not torch.equal(b, p), "a parameter of a generator group was not trained"
    assert_params_match(ours, ref)


# issue 14, item 2
def test_short_window_grad_visible_to_clipping_and_step_matches_torch():
    """accum_steps=4 with windows of 4, 2, 3 and 1 backwards (an epoch that is not a multiple of
    4: every trainer steps there): the trainer's clip_grad_norm_ must see the window's sum."""
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=4)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = data(10)
    start = 0
    for n in (4, 2, 3, 1):
        window, start = batches[start : start + n], start + n
        for x, y in window:
            (mse(ours, x, y) / n).backward()
            (mse(ref, x, y) / n).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
        assert_rel(norm, ref_norm, what=f"clip_grad_norm_ after a window of {n}")
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


# issue 14, item 3
@pytest.mark.parametrize("accum_steps", [None, 2])
def test_autograd_grad_after_window_end_keeps_exposed_grad(accum_steps):
    """torch.autograd.grad does not touch .grad; a following clip_grad_norm_ and step see the
    window's gradient."""
    ours, ref = twins()
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, momentum=0.9, accum_steps=accum_steps)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    (x0, y0), (x1, y1), (xa, ya) = data(3)
    for model in (ours, ref):
        for x, y in ((x0, y0), (x1, y1)):
            (mse(model, x, y) / 2).backward()
    for model in (ours, ref):  # e.g. a gradient penalty or a probe, after the window
        torch.autograd.grad(mse(model, xa, ya), list(model.parameters()))
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}.grad cleared by torch.autograd.grad"
        assert_rel(p.grad, q.grad, what=f"{name}.grad")
    norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert_rel(norm, ref_norm, what="clip_grad_norm_")
    opt.step()
    ropt.step()
    assert_params_match(ours, ref)


def _clipped_reference_run(ref, ropt, windows, max_norm, loss_fn):
    """torch: native accumulation over each window, clip_grad_norm_, step, zero_grad."""
    norms = []
    for window in windows:
        for x, y in window:
            loss_fn(ref, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        ropt.step()
        ropt.zero_grad()
    return norms


# issue 14, item 4 (a)
def test_max_grad_norm_clips_as_torch_with_gradient_in_pieces_under_reentrant_checkpoint():
    ours, ref = twins(cls=AlbertNet)
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, max_grad_norm=0.05)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    windows = [data(2, seed=s) for s in range(3)]
    loss = lambda m, x, y: mse(m, x, y) / 2  # noqa: E731
    ref_norms = _clipped_reference_run(ref, ropt, windows, 0.05, loss)
    for window, ref_norm in zip(windows, ref_norms):
        for x, y in window:
            loss(ours, x, y).backward()
        opt.step()
        assert_rel(opt.last_grad_norm, ref_norm, what="last_grad_norm")
        opt.zero_grad()
    assert_params_match(ours, ref)


# issue 14, item 4 (b)
def test_max_grad_norm_clips_as_torch_when_more_backwards_than_accum_steps_run():
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, max_grad_norm=0.05)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    windows = [data(3, seed=s) for s in range(3)]  # 3 backwards per step, accum_steps=2
    ref_norms = _clipped_reference_run(ref, ropt, windows, 0.05, mse)
    for window, ref_norm in zip(windows, ref_norms):
        for x, y in window:
            mse(ours, x, y).backward()
        opt.step()
        assert_rel(opt.last_grad_norm, ref_norm, what="last_grad_norm")
        opt.zero_grad()
    assert_params_match(ours, ref)


# issue 14, item 4 (c)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-6], ids=["default_bucket", "bucket_per_param"])
def test_max_grad_norm_clips_as_torch_when_the_last_backward_raises_and_is_retried(bucket_cap_mb):
    """The head's gradient of the failed backward was accumulated before the error (as torch's
    .grad keeps it); the retry adds a full gradient. Same sequence on both sides. With one
    bucket per parameter the head's bucket is folded (and its stats taken) before the error."""
    ours, ref = twins(cls=BoomNet)
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2, max_grad_norm=0.05, bucket_cap_mb=bucket_cap_mb)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(2):
        (x0, y0), (x1, y1) = data(2, seed=s)
        norms = []
        for model, o in ((ours, opt), (ref, ropt)):
            (mse(model, x0, y0) / 2).backward()
            model.armed = True
            with pytest.raises(RuntimeError, match="boom"):
                (mse(model, x1, y1) / 2).backward()
            (mse(model, x1, y1) / 2).backward()  # the retry
            if o is ropt:
                norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            o.step()
            if o is opt:
                norms.append(opt.last_grad_norm)
            o.zero_grad()
        assert_rel(norms[0], norms[1], what="last_grad_norm")
    assert_params_match(ours, ref)


# issue 14, item 4 (d)
def test_step_in_backward_steps_adam_once_per_window_when_gradient_arrives_in_pieces():
    ours, ref = twins(cls=AlbertNet)
    opt = fused_accum.Adam(ours.parameters(), lr=1e-2, accum_steps=2, step_in_backward=True)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for s in range(3):
        window = data(2, seed=s)
        for x, y in window:
            (mse(ours, x, y) / 2).backward()
            (mse(ref, x, y) / 2).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


# guards: Ledger._restart not clearing ``pieces_seen`` (its `self.pieces_seen = False` dropped):
# one window with a gradient in pieces would silently turn step_in_backward off for good (every
# later window stepping at step(), its fusion lost). Also that the window with pieces still trains
# as torch: a piece lost, or a step taken in backward before the second piece arrived, would not.
# With a bucket per parameter the shared weight's bucket completes at each piece, so the window
# folds it twice and sees the pieces (then steps at step()); in one bucket the hooks sum the
# second piece into the first before the bucket completes (fused_accum/arrivals.py), so the
# window sees one gradient and steps in backward.
@pytest.mark.parametrize("bucket_cap_mb", [None, 1e-6], ids=["one-bucket", "bucket-per-param"])
def test_step_in_backward_resumes_after_a_window_with_a_gradient_in_pieces(bucket_cap_mb, hooks, one_thread):
    """Windows whose first backward gives ``shared`` two pieces alternate with plain ones: each
    trains as torch.optim.AdamW, and each plain window after one with pieces steps in its last
    backward again."""
    ours, ref = twins(cls=InsideAndOutside)
    extra = {} if bucket_cap_mb is None else dict(bucket_cap_mb=bucket_cap_mb)
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, accum_steps=2, step_in_backward=True, **extra)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    pieces_seen = bucket_cap_mb is not None
    # windows: pieces in the first backward of windows 0 and 2, none in 1 and 3
    for w in range(4):
        pieces = w % 2 == 0
        batches = data(2, seed=20 + w)
        before = [p.detach().clone() for p in ours.parameters()]
        for j, (x, y) in enumerate(batches):
            (mse(ref, x, y) / 2).backward()
            (((ours(x, pieces=pieces and j == 0) - y) ** 2).mean() / 2).backward()
            if pieces and j == 0:
                assert opt._window.ledger.pieces_seen == pieces_seen, f"window {w}"
        ref_opt.step()
        ref_opt.zero_grad()
        moved = [not torch.equal(p, b) for p, b in zip(ours.parameters(), before)]  # before step()
        if pieces and pieces_seen:
            # (the precondition: the pieces were seen, so this window steps at step())
            assert not opt._window.ledger.stepped_in_backward and not any(moved), f"window {w}"
        else:
            # the window after one with pieces steps in its last backward again
            assert opt._window.ledger.stepped_in_backward, f"window {w} did not step in backward"
            assert all(moved), f"window {w}: parameters not updated before step()"
        opt.step()
        opt.zero_grad()
        assert_params_match(ours, ref)  # fp32, within RTOL = 1e-6 (torch's rounding, not its order)


# issue 14, item 6
@pytest.mark.parametrize("bad", [0.0, -8.0, math.nan, math.inf], ids=["zero", "negative", "nan", "inf"])
def test_invalid_tensor_num_items_skips_the_step(bad):
    """A tensor num_items of 0, < 0 or non-finite: the step is skipped (a ValueError is also
    accepted, since the host could know), never applied: params and state stay as they were,
    and the next valid window trains exactly as if the bad one had never been stepped."""
    ours, ref = twins()
    opt = fused_accum.Adam(ours.parameters(), lr=1e-2)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in ours.parameters()]
    for x, y in data(2, seed=7):
        ((ours(x) - y) ** 2).sum().backward()
    try:
        opt.step(num_items=torch.tensor(bad))
    except ValueError:
        pass
    for b, (name, p) in zip(before, ours.named_parameters()):
        assert torch.equal(b, p.detach()), f"{name} changed by step(num_items=tensor({bad}))"
    opt.zero_grad()
    window = data(2, seed=8)
    n = sum(x.shape[0] for x, _ in window)
    for x, y in window:
        ((ours(x) - y) ** 2).sum().backward()
        ((ref(x) - y) ** 2).sum().backward()
    opt.step(num_items=torch.tensor(float(n)))
    for q in ref.parameters():
        q.grad /= n
    ropt.step()
    assert_params_match(ours, ref)


# issue 14, item 7
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_matches_torch_fused_after_100_steps(name):
    """fp32, 100 steps, against torch.optim.X(fused=True). Issue 14 asks for <= 1e-7 relative,
    but on this model torch's own for-loop is 1.8e-7 (AdamW) to 7.4e-7 (SGD) away from its fused
    path after 100 steps (max |diff| / max |param|), so the bound is max(1e-7, twice torch's own
    for-loop-vs-fused distance, measured here). fp32 bias corrections (issue item 7) put Adam at
    2.8x and AdamW at 25x that distance. (Adagrad steps as torch's fused kernel, bit for bit:
    tests/test_kernels.py.)"""
    ours, ref, loop = Net(0), Net(0), Net(0)
    hyper = dict(HYPER[name])
    opt = OURS[name](ours.parameters(), **hyper)
    ropt = getattr(torch.optim, name)(ref.parameters(), fused=True, **hyper)
    lopt = getattr(torch.optim, name)(loop.parameters(), foreach=False, **hyper)
    for x, y in data(100, seed=3):
        for model, o in ((ours, opt), (ref, ropt), (loop, lopt)):
            mse(model, x, y).backward()
            o.step()
            o.zero_grad()
    torch_spread = max(rel_err(q, p) for p, q in zip(ref.parameters(), loop.parameters()))
    assert_params_match(ours, ref, rtol=max(1e-7, 2 * torch_spread))


# issue 14, item 7
def test_lion_matches_an_independent_implementation_after_100_steps():
    ours, ref = twins()
    opt = fused_accum.Lion(ours.parameters(), lr=1e-3, weight_decay=0.1)
    ropt = LionReference(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for x, y in data(100, seed=3):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref, rtol=1e-7)


# issue 14, item 8
def test_an_optimizer_recreated_on_the_same_parameters_trains_as_torch():
    """opt = AdamW(m.parameters()); opt = AdamW(m.parameters(), lr=1e-2): Python builds the new
    one while the old one is alive. Also a checkpoint loaded into a fresh optimizer in a loop."""
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters())
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)  # the notebook cell, run again
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(data(4)):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
        sd = opt.state_dict()
        opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)  # resume from the checkpoint
        opt.load_state_dict(sd)
    assert_params_match(ours, ref)


# issue 14, item 9
def test_failed_constructor_leaves_no_hooks_and_no_owner():
    """A constructor that fails on its second group (a parameter already in the first: torch
    raises ValueError there too) must not leave hooks on the first group's parameters."""
    model, ref = twins()
    counts = [hook_count(p) for p in model.parameters()]
    with pytest.raises(ValueError):  # "some parameters appear in more than one parameter group"
        torch.optim.AdamW([{"params": list(ref.body.parameters())}, {"params": [ref.head.weight, ref.body.weight]}])
    with pytest.raises(ValueError):
        fused_accum.AdamW(
            [{"params": list(model.body.parameters())}, {"params": [model.head.weight, model.body.weight]}]
        )
    assert [hook_count(p) for p in model.parameters()] == counts, "hooks left by a failed constructor"
    # autograd fills .grad as usual, and a later optimizer takes the parameters without complaint
    x, y = data(1)[0]
    mse(model, x, y).backward()
    mse(ref, x, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert_rel(p.grad, q.grad, what=f"{name}.grad")
    model.zero_grad()
    ref.zero_grad()
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data(2, seed=4):
        mse(model, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(model, ref)


def _events_for(cls, model, **kwargs):
    """Register all four state-dict hook kinds; return the events and the saved/loaded dicts."""
    events = []
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    x, y = data(1)[0]
    mse(model, x, y).backward()
    opt.step()
    opt.zero_grad()

    def sd_pre(o):
        events.append("state_dict_pre")

    def sd_post(o, sd):
        events.append("state_dict_post")
        sd["extra"] = "added by post hook"
        return sd

    def load_pre(o, sd):
        events.append("load_pre")
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.123
        return sd

    def load_post(o):
        events.append("load_post:lr=%g" % o.param_groups[0]["lr"])

    opt.register_state_dict_pre_hook(sd_pre)
    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(load_post)
    sd = opt.state_dict()
    saved_extra = sd.get("extra")
    sd.pop("extra", None)
    opt.load_state_dict(sd)
    return events, saved_extra, opt.param_groups[0]["lr"]


# issue 14, item 10
def test_all_four_state_dict_hook_kinds_run_as_in_torch():
    ours, ref = twins()
    got = _events_for(fused_accum.AdamW, ours)
    want = _events_for(torch.optim.AdamW, ref)
    assert want == (
        ["state_dict_pre", "state_dict_post", "load_pre", "load_post:lr=0.123"],
        "added by post hook",
        0.123,
    )
    assert got == want


# issue 14, item 10
def test_param_names_are_kept_on_load():
    model = Net()
    opt = fused_accum.AdamW(model.named_parameters(), lr=1e-2)
    x, y = data(1)[0]
    mse(model, x, y).backward()
    opt.step()
    sd = opt.state_dict()
    names = ["body.weight", "body.bias", "head.weight", "head.bias"]
    assert sd["param_groups"][0]["param_names"] == names
    fresh = Net()
    opt2 = fused_accum.AdamW(fresh.parameters(), lr=1e-2)  # unnamed: torch takes the saved names
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0].get("param_names") == names
    assert opt2.state_dict()["param_groups"][0].get("param_names") == names


# issue 14, item 11
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_state_holds_torch_names_and_values(name):
    ours, ref = twins()
    opt = OURS[name](ours.parameters(), **HYPER[name])
    ropt = getattr(torch.optim, name)(ref.parameters(), **HYPER[name])
    for x, y in data(3):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    for (pname, p), q in zip(ours.named_parameters(), ref.parameters()):
        mine, theirs = opt.state[p], ropt.state[q]
        assert set(mine) == set(theirs), f"{pname}: state keys {sorted(mine)} != torch's {sorted(theirs)}"
        for key, value in theirs.items():
            assert isinstance(mine[key], torch.Tensor) and mine[key].dtype == torch.float32, (pname, key)
            if key == "step":
                assert float(mine[key]) == float(value), (pname, key)
            else:
                assert mine[key].shape == value.shape, (pname, key)
                assert_rel(mine[key], value, what=f"state[{pname}][{key!r}]")


# issue 14, item 11
@pytest.mark.parametrize("name,key", [("SGD", "momentum_buffer"), ("Adam", "exp_avg"), ("AdamW", "exp_avg_sq")])
def test_state_tensors_are_live_views_in_place_edits_go_through(name, key):
    ours, ref = twins()
    opt = OURS[name](ours.parameters(), **HYPER[name])
    ropt = getattr(torch.optim, name)(ref.parameters(), **HYPER[name])
    batches = data(3)
    for model, o in ((ours, opt), (ref, ropt)):
        for i, (x, y) in enumerate(batches):
            mse(model, x, y).backward()
            o.step()
            o.zero_grad()
            if i == 0:  # e.g. a tool that resets or rescales a moment in place
                for p in model.parameters():
                    o.state[p][key].mul_(0.25)
    assert_params_match(ours, ref)


# issue 14, item 12
def test_duplicate_parameter_in_a_group_warns_as_torch():
    p = nn.Parameter(torch.randn(3, 2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.AdamW([p, p])
    q = nn.Parameter(torch.randn(3, 2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        fused_accum.AdamW([q, q])


def _p():
    return nn.Parameter(torch.randn(3, 2))


ERROR_CASES = {
    # (optimizer name, params factory, kwargs): torch's exception type (and order) is the expectation
    "params_None": ("AdamW", lambda: None, {}),
    "params_None_bad_lr": ("AdamW", lambda: None, dict(lr=-1.0)),
    "params_None_bad_betas": ("Adam", lambda: None, dict(betas=(1.0, 0.0))),
    "params_None_bad_weight_decay": ("Adam", lambda: None, dict(weight_decay=-1)),
    "params_None_tensor_lr_2_elements": ("AdamW", lambda: None, dict(lr=torch.tensor([1e-3, 1e-3]))),
    "params_None_bad_momentum": ("SGD", lambda: None, dict(lr=0.1, momentum=-0.5)),
    "mixed_betas_float_tensor": ("Adam", lambda: [_p()], dict(betas=(0.9, torch.tensor(0.99)))),
    "mixed_betas_tensor_float": ("AdamW", lambda: [_p()], dict(betas=(torch.tensor(0.9), 0.99))),
    "bad_eps": ("Adam", lambda: [_p()], dict(eps=-1.0)),
    "bad_lr": ("SGD", lambda: [_p()], dict(lr=-0.1)),
    "nesterov_without_momentum": ("SGD", lambda: [_p()], dict(lr=0.1, nesterov=True)),
    "a_tensor_as_params": ("AdamW", lambda: _p(), {}),
    "param_in_two_groups": ("AdamW", lambda: (lambda p: [{"params": [p]}, {"params": [p]}])(_p()), {}),
}


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type is the point
        return type(err)
    return None


# issue 14, item 12
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_constructor_errors_are_torchs(case):
    name, params, kwargs = ERROR_CASES[case]
    want = _raised(lambda: getattr(torch.optim, name)(params(), **kwargs))
    got = _raised(lambda: OURS[name](params(), **kwargs))
    assert want is not None
    assert got is want, f"torch raises {want.__name__}, fused_accum.{name} raised {got and got.__name__}"


# issue 14, item 13
def test_parameter_frozen_at_construction_is_trained_once_unfrozen():
    """Gradual unfreezing: body frozen when the optimizer is built, unfrozen after 2 steps."""
    ours, ref = twins()
    for m in (ours, ref):
        m.body.requires_grad_(False)
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    body_before = ours.body.weight.detach().clone()
    for i, (x, y) in enumerate(data(5)):
        if i == 2:
            for m in (ours, ref):
                m.body.requires_grad_(True)
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert not torch.equal(body_before, ours.body.weight.detach()), "unfrozen body was never trained"
    assert_params_match(ours, ref)


# issue 14, item 14
def test_del_frees_buffers_and_parameters_without_the_cycle_collector():
    # Warm-up: the first torch.optim.Optimizer of a process imports torch._dynamo lazily inside
    # add_param_group, and an exception stored during that import keeps the frames (and so the
    # optimizer) alive; torch.optim.SGD leaks the same way. Build and drop one first.
    warm = Net()
    fused_accum.AdamW(warm.parameters(), lr=1e-2)
    del warm
    gc.collect()
    gc.disable()
    try:
        model = Net()
        opt = fused_accum.AdamW(model.parameters(), lr=1e-2)
        x, y = data(1)[0]
        mse(model, x, y).backward()
        opt.step()
        mse(model, x, y).backward()
        p = model.body.weight
        buf = p.grad._base if p.grad._base is not None else p.grad  # the accumulator .grad views
        refs = {"optimizer": weakref.ref(opt), "accumulator": weakref.ref(buf), "parameter": weakref.ref(p)}
        exp_avg = opt.state.get(p, {}).get("exp_avg")
        if exp_avg is not None:
            refs["exp_avg buffer"] = weakref.ref(exp_avg._base if exp_avg._base is not None else exp_avg)
        del buf, exp_avg, p
        opt.zero_grad()  # drops the .grad views
        del opt, model
        alive = [k for k, r in refs.items() if r() is not None]
        assert not alive, f"still alive after del with gc disabled: {alive}"
    finally:
        gc.enable()


# issue 14, item 14
def test_no_hooks_accumulate_over_200_recreations():
    """200 optimizers, each deleted (and collected) before the next; then 200 rebindings of one
    name (newest wins). gc.freeze() keeps the 200 collections cheap (only new objects scanned)."""
    model = Net()
    x, y = data(1)[0]
    gc.collect()
    gc.freeze()
    try:
        for _ in range(200):
            opt = fused_accum.AdamW(model.parameters(), lr=1e-3)
            mse(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            del opt
            gc.collect()
        counts = {n: hook_count(p) for n, p in model.named_parameters()}
        assert all(c == 0 for c in counts.values()), f"hooks left by dead optimizers: {counts}"
        opt = fused_accum.AdamW(model.parameters(), lr=1e-3)
        one = {n: hook_count(p) for n, p in model.named_parameters()}
        for _ in range(200):
            opt = fused_accum.AdamW(model.parameters(), lr=1e-3)
            mse(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        assert {n: hook_count(p) for n, p in model.named_parameters()} == one, "rebinding left hooks"
        del opt
        gc.collect()
        assert all(hook_count(p) == 0 for p in model.parameters())
    finally:
        gc.unfreeze()


# issue 14, item 15
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_amsgrad_matches_torch(name):
    ours, ref = twins()
    opt = OURS[name](ours.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1)
    ropt = getattr(torch.optim, name)(ref.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1)
    for x, y in data(20):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert_rel(opt.state[p]["max_exp_avg_sq"], ropt.state[q]["max_exp_avg_sq"], what="max_exp_avg_sq")


# issue 14, item 17
def test_grad_still_exposed_after_load_state_dict():
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)  # accum_steps=None
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    (x0, y0), (x1, y1) = data(2)
    for model, o in ((ours, opt), (ref, ropt)):
        mse(model, x0, y0).backward()
        o.step()
        o.zero_grad()
        mse(model, x1, y1).backward()
        o.load_state_dict(o.state_dict())
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}.grad is None after load_state_dict"
        assert_rel(p.grad, q.grad, what=f"{name}.grad")
    opt.step()
    ropt.step()
    assert_params_match(ours, ref)


# --- clipping with num_items, the generic path, windows after a raise or an unused branch -----


def test_max_grad_norm_clips_the_gradient_divided_by_num_items():
    """The clip norm is the norm of the gradient after dividing by num_items."""
    ours, ref = twins()
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, momentum=0.9, accum_steps=3, max_grad_norm=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        window = data(3, seed=10 + s)
        n = sum(x.shape[0] for x, _ in window)
        for x, y in window:
            ((ours(x) - y) ** 2).sum().backward()
            ((ref(x) - y) ** 2).sum().backward()
        for q in ref.parameters():
            q.grad /= n
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step(num_items=torch.tensor(float(n)))
        assert_rel(opt.last_grad_norm, ref_norm, what="last_grad_norm")
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


def test_clip_factor_is_capped_at_one():
    """max_grad_norm far above the norm: exactly no clipping (SGD shows any scale factor)."""
    ours, ref = twins()
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, accum_steps=2, max_grad_norm=1e6)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(2):
        for x, y in data(2, seed=s):
            (mse(ours, x, y) / 2).backward()
            (mse(ref, x, y) / 2).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


def test_generic_path_with_num_items_and_clipping():
    ours, ref = twins()
    opt = FusedAccumOptimizer(
        ours.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, accum_steps=2, max_grad_norm=0.05
    )
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        window = data(2, micro=3 + s, seed=20 + s)
        n = sum(x.shape[0] for x, _ in window)
        for x, y in window:
            ((ours(x) - y) ** 2).sum().backward()
            ((ref(x) - y) ** 2).sum().backward()
        for q in ref.parameters():
            q.grad /= n
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step(num_items=torch.tensor(float(n)))
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


def test_generic_path_skips_a_nonfinite_window_whole():
    """A window with an inf gradient is skipped whole (params and momentum untouched); the
    next windows train as torch does when that step is skipped."""
    ours, ref = twins()
    opt = FusedAccumOptimizer(
        ours.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, accum_steps=2, skip_nonfinite=True
    )
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        window = data(2, seed=30 + s)
        poisoned = s == 1
        for i, (x, y) in enumerate(window):
            if poisoned and i == 1:
                x = x.clone()
                x[0, 0] = math.inf
            (mse(ours, x, y) / 2).backward()
            if not poisoned:
                (mse(ref, x, y) / 2).backward()
        before = [p.detach().clone() for p in ours.parameters()]
        opt.step()
        opt.zero_grad()
        if poisoned:
            for b, (name, p) in zip(before, ours.named_parameters()):
                assert torch.equal(b, p.detach()), f"{name} changed by a non-finite window"
        else:
            ropt.step()
            ropt.zero_grad()
    assert_params_match(ours, ref)


def test_zero_grad_after_a_backward_that_raised_discards_its_partly_filled_bucket():
    """Default bucket size: the failed backward leaves a partly filled bucket; zero_grad()
    discards it and the next window is clean."""
    ours, ref = twins(cls=BoomNet)
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = data(1, seed=40)[0]
    for model, o in ((ours, opt), (ref, ropt)):
        model.armed = True
        with pytest.raises(RuntimeError, match="boom"):
            mse(model, x, y).backward()
        o.zero_grad()
    for s in range(2):
        for x, y in data(2, seed=41 + s):
            (mse(ours, x, y) / 2).backward()
            (mse(ref, x, y) / 2).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


@pytest.mark.parametrize("zero_grad", [False, True], ids=["step_without_zero_grad", "with_zero_grad"])
def test_step_then_a_window_that_leaves_a_branch_unused(zero_grad):
    """Issue 14 words this as 'step() without zero_grad(), then a window that leaves a branch
    unused: its .grad must be None and the norm must not include it'. That was the old design
    (step() ended the window). Under the contract now chosen (.grad shows what native
    accumulation shows) torch is the oracle: without zero_grad() the unused branch keeps its
    previous .grad and clip_grad_norm_ counts it; after zero_grad() it is None and not counted.
    Both are checked: .grad of every param, the max_grad_norm norm, and the step."""
    ours, ref = twins(cls=TwoBranch)
    opt = fused_accum.SGD(ours.parameters(), lr=0.1, accum_steps=2, max_grad_norm=1e6)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for model, o in ((ours, opt), (ref, ropt)):
        for x, y in data(2, seed=50):
            (((model(x) - y) ** 2).mean() / 2).backward()
        o.step()
        if zero_grad:
            o.zero_grad()
        for x, y in data(2, seed=51):
            (((model(x, use_b=False) - y) ** 2).mean() / 2).backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}.grad is {p.grad!r}, torch's is {q.grad!r}"
        if q.grad is not None:
            assert_rel(p.grad, q.grad, what=f"{name}.grad")
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
    opt.step()
    ropt.step()
    assert_rel(opt.last_grad_norm, ref_norm, what="last_grad_norm")
    assert_params_match(ours, ref)


class TwoBranch(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


# --- Newest optimizer wins ---------------------------------------------------------------------


def test_newest_optimizer_takes_over_and_the_old_one_refuses_to_step():
    ours, ref = twins()
    old = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    new = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data(3):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        new.step()
        new.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)
    with pytest.raises(RuntimeError):
        old.step()


def test_newest_optimizer_warns_when_it_discards_a_non_empty_window():
    model = Net()
    old = fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=4)
    x, y = data(1)[0]
    mse(model, x, y).backward()  # 1 of 4: the window holds a gradient
    with pytest.warns(UserWarning):
        fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=4)
    del old


def test_newest_optimizer_is_silent_when_the_old_window_is_empty():
    model = Net()
    old = fused_accum.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused_accum.AdamW(model.parameters(), lr=1e-2)
    del old


def test_newest_optimizer_constructor_is_all_or_nothing():
    """A constructor that fails (its 2nd group repeats a parameter of the 1st: torch's
    ValueError) takes nothing over: the live optimizer keeps its parameters and hooks, and
    trains as before."""
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    counts = [hook_count(p) for p in ours.parameters()]
    with pytest.raises(ValueError):
        fused_accum.AdamW([{"params": list(ours.body.parameters())}, {"params": [ours.head.weight, ours.body.weight]}])
    assert [hook_count(p) for p in ours.parameters()] == counts
    for x, y in data(3):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


# --- torch.optim's surface: maximize, .grad after every backward ---------------------------------


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_surface_maximize_matches_torch(name):
    ours, ref = twins()
    hyper = dict(HYPER[name], maximize=True)
    opt = OURS[name](ours.parameters(), **hyper)
    ropt = getattr(torch.optim, name)(ref.parameters(), **hyper)
    for x, y in data(5):
        mse(ours, x, y).backward()
        mse(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert_params_match(ours, ref)


@pytest.mark.parametrize("accum_steps", [None, 4])
def test_surface_grad_is_the_fp32_running_sum_after_every_backward(accum_steps):
    """The lead's contract: wherever native accumulation shows a .grad, ours shows the fp32
    running sum: after every backward, for a full window of 4 and a short one of 2. The twin is
    re-synchronised after each step, so only the accumulation is compared."""
    ours, ref = twins()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, accum_steps=accum_steps)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = data(6)
    for window in (batches[:4], batches[4:]):
        for i, (x, y) in enumerate(window):
            (mse(ours, x, y) / len(window)).backward()
            (mse(ref, x, y) / len(window)).backward()
            for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
                assert p.grad is not None, f"{name}.grad is None after backward {i + 1} of {len(window)}"
                assert p.grad.dtype == torch.float32
                assert_rel(p.grad, q.grad, what=f"{name}.grad after backward {i + 1}")
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
        with torch.no_grad():
            for p, q in zip(ours.parameters(), ref.parameters()):
                q.copy_(p)
