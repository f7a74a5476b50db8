"""Property test (hypothesis): fused_accum's optimizers against torch.optim with native .grad
accumulation, on random small models and training loops (issue 14, "Tests and CI").

Drawn per example: the algorithm (SGD with momentum/nesterov, Adam, AdamW, Lion against an
independent Lion) and its hyper-parameters; a model with tied weights, a frozen parameter, an
unused parameter and a layer used twice (each on or off); param groups given as lists or as
generators; the lengths of 1-3 windows (1-4 backwards each) and an ``accum_steps`` that need not
match them; the bucket size; clipping (none, ``max_grad_norm=``, or the trainer's
``clip_grad_norm_`` on the exposed ``.grad``); a sum-reduced loss with ``step(num_items=N)``
or a pre-scaled one; and a checkpoint taken mid-window and resumed into a fresh model and
optimizer. The oracle is the same loop on a twin model with torch.optim (native ``.grad``,
``clip_grad_norm_``, ``.grad /= N``), never interrupted.

Bounded: ``max_examples`` examples, derandomized (the same examples on every run), < 60 s on a
CPU. Tolerance: parameters within RTOL relative (max |diff| / max |param|) after the loop.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hypothesis import HealthCheck, given, note, settings  # a test dependency: requirements-dev.txt
from hypothesis import strategies as st

import fused_accum  # noqa: E402
from helpers import RaiseWhenArmed  # tests/helpers.py
from lion_reference import LionReference  # tests/lion_reference.py

RTOL = 1e-6
D = 5


class PropNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(cfg["seed"])
        self.cfg = cfg
        self.emb = nn.Linear(D, D, bias=False)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, D, bias=False)
        if cfg["tied"]:
            self.out.weight = self.emb.weight  # one Parameter used at both ends
        if cfg["unused"]:
            self.spare = nn.Linear(D, 2)  # never in the graph: its .grad stays None
        if cfg["frozen"]:
            self.mid.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.mid(h))
        if self.cfg["twice"]:
            h = torch.tanh(self.mid(h))  # the same layer again: two gradient pieces per backward
        return self.out(h)


ALGOS = {
    "sgd": (fused_accum.SGD, torch.optim.SGD),
    "adam": (fused_accum.Adam, torch.optim.Adam),
    "adamw": (fused_accum.AdamW, torch.optim.AdamW),
    "lion": (fused_accum.Lion, LionReference),
}


@st.composite
def configs(draw):
    algo = draw(st.sampled_from(sorted(ALGOS)))
    if algo == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        hyper = dict(
            lr=draw(st.sampled_from([0.05, 0.2])),
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=draw(st.sampled_from([0.0, 0.01])),
        )
    elif algo == "lion":
        hyper = dict(lr=1e-3, weight_decay=draw(st.sampled_from([0.0, 0.1])))
    else:
        hyper = dict(
            lr=draw(st.sampled_from([1e-3, 1e-2])),
            weight_decay=draw(st.sampled_from([0.0, 0.1])),
            amsgrad=draw(st.booleans()),
        )
    windows = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    resume_at = None
    if draw(st.booleans()):  # a checkpoint inside some window: (window index, after j backwards)
        w = draw(st.integers(0, len(windows) - 1))
        resume_at = (w, draw(st.integers(0, windows[w])))
    return dict(
        seed=draw(st.integers(0, 3)),
        algo=algo,
        hyper=hyper,
        tied=draw(st.booleans()),
        frozen=draw(st.booleans()),
        unused=draw(st.booleans()),
        twice=draw(st.booleans()),
        groups=draw(st.sampled_from(["one", "lists", "generators"])),
        windows=windows,
        accum_steps=draw(st.sampled_from([None, 1, 2, 3, 4])),
        bucket_cap_mb=draw(st.sampled_from([25.0, 1e-4, 1e-6])),
        clip=draw(st.sampled_from([None, "max_grad_norm", "clip_grad_norm_"])),
        max_norm=draw(st.sampled_from([0.05, 1e3])),
        num_items=draw(st.booleans()),
        resume_at=resume_at,
        data_seed=draw(st.integers(0, 10_000)),
    )


def param_groups(model, how, lr):
    if how == "one":
        return model.parameters()
    first = [model.emb.weight]
    rest = lambda: (p for n, p in model.named_parameters() if n != "emb.weight")  # noqa: E731
    if how == "lists":
        return [{"params": first, "lr": lr * 2}, {"params": list(rest())}]
    return [{"params": (p for p in first), "lr": lr * 2}, {"params": rest()}]


def build(cfg, model, ours):
    fa_cls, torch_cls = ALGOS[cfg["algo"]]
    hyper = dict(cfg["hyper"])
    groups = param_groups(model, cfg["groups"], hyper["lr"])
    if not ours:
        return torch_cls(groups, **hyper)
    extra = dict(accum_steps=cfg["accum_steps"], bucket_cap_mb=cfg["bucket_cap_mb"])
    if cfg["clip"] == "max_grad_norm":
        extra["max_grad_norm"] = cfg["max_norm"]
    return fa_cls(groups, **hyper, **extra)


def micro_batches(cfg):
    gen = torch.Generator().manual_seed(cfg["data_seed"])
    out = []
    for n in cfg["windows"]:
        sizes = [int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(n)]
        out.append([(torch.randn(s, D, generator=gen), torch.randn(s, D, generator=gen)) for s in sizes])
    return out


def loss_fn(model, x, y, cfg, window):
    err = ((model(x) - y) ** 2).sum(dim=1)
    if cfg["num_items"]:
        return err.sum()  # sum-reduced: the window's item count divides, at the step
    return err.mean() / len(window)  # pre-scaled mean


def run_torch(cfg, data):
    model = PropNet(cfg)
    opt = build(cfg, model, ours=False)
    for window in data:
        for x, y in window:
            loss_fn(model, x, y, cfg, window).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        n = sum(x.shape[0] for x, _ in window)
        if cfg["num_items"] and cfg["clip"] != "clip_grad_norm_":
            for p in params:
                p.grad /= n
        if cfg["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        if cfg["num_items"] and cfg["clip"] == "clip_grad_norm_":
            for p in params:  # the trainer clips the exposed sum; step(num_items) divides after
                p.grad /= n
        opt.step()
        opt.zero_grad()
    return model


def run_ours(cfg, data):
    model = PropNet(cfg)
    opt = build(cfg, model, ours=True)
    for w, window in enumerate(data):
        for j, (x, y) in enumerate(window + [(None, None)]):
            if cfg["resume_at"] == (w, j):  # checkpoint, then a fresh model and optimizer resume
                model_sd, opt_sd = model.state_dict(), opt.state_dict()
                model = PropNet(cfg)
                model.load_state_dict(model_sd)
                opt = build(cfg, model, ours=True)
                opt.load_state_dict(opt_sd)
            if x is None:
                break
            loss_fn(model, x, y, cfg, window).backward()
        if cfg["clip"] == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        n = sum(x.shape[0] for x, _ in window)
        opt.step(num_items=torch.tensor(float(n))) if cfg["num_items"] else opt.step()
        opt.zero_grad()
    return model


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_matches_torch_optim_with_native_grad_accumulation(cfg):
    note(repr(cfg))
    data = micro_batches(cfg)
    ref = run_torch(cfg, data)
    ours = run_ours(cfg, data)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        scale = q.detach().abs().max().item()
        assert math.isfinite(diff) and diff <= RTOL * scale, (
            f"{name}: relative error {diff / scale if scale else math.inf:.3g} > {RTOL:g}"
        )


# --- what users do to the model between micro-batches and steps (issue 22) --------------------
#
# The same loop, with one user event drawn per window at a drawn point (before backward j, or
# after the window's last backward, before the step), done alike to both sides: the oracle is
# torch.optim doing the same with native .grad. Events that edit .grad after the last backward
# must reach max_grad_norm's clip (torch clips at the step, after them).


class EventNet(PropNet):
    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = RaiseWhenArmed.apply(torch.tanh(self.mid(h)))
        return self.out(h)


def _raised_backward(model, opt, x, y):
    RaiseWhenArmed.armed = True
    try:
        ((model(x) - y) ** 2).mean().backward()
    except RuntimeError as error:
        assert "planted error" in str(error)
    else:
        raise AssertionError("the planted error did not raise")
    finally:
        RaiseWhenArmed.armed = False


def _scaled_state_dict(model, opt, x, y):
    model.load_state_dict({k: v * 0.9 for k, v in model.state_dict().items()})


def _edit_params(model, opt, x, y):
    with torch.no_grad():
        model.mid.weight.mul_(0.5)
        model.emb.weight.clamp_(-0.2, 0.2)


def _edit_grads(model, opt, x, y):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def _clip_value(model, opt, x, y):
    if any(p.grad is not None for p in model.parameters()):  # (torch raises on no gradient at all)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)


def _clear_one_grad(model, opt, x, y):
    model.mid.weight.grad = None


def _raised_then_zero_grad(model, opt, x, y):
    _raised_backward(model, opt, x, y)
    model.zero_grad()


def _reset_state(model, opt, x, y):
    opt.state.clear()


def _cast_round_trip(model, opt, x, y):
    model.double()  # (.data replaced: autograd builds new AccumulateGrad nodes)
    model.float()


EVENTS = {
    "edit_params": _edit_params,
    "load_model_state": _scaled_state_dict,
    "edit_grads": _edit_grads,
    "clip_grad_value": _clip_value,
    "clear_one_grad": _clear_one_grad,
    "raised_backward": _raised_backward,
    "raised_then_zero_grad": _raised_then_zero_grad,
    "reset_state": _reset_state,
    "cast_round_trip": _cast_round_trip,
}
# Only between windows (after zero_grad): a cast mid-window makes torch's module.to cast .grad
# through .data, which docs/differences.md lists among the deliberate differences.
AT_WINDOW_START_ONLY = {"cast_round_trip"}


@st.composite
def event_configs(draw):
    cfg = draw(configs())
    cfg.update(
        tied=False, twice=False, resume_at=None, num_items=False, clip=draw(st.sampled_from([None, "max_grad_norm"]))
    )
    events = []
    for n in cfg["windows"]:
        name = draw(st.sampled_from(sorted(EVENTS)))
        at = 0 if name in AT_WINDOW_START_ONLY else draw(st.integers(0, n))
        events.append((name, at))
    cfg["events"] = events
    cfg["post_hook"] = draw(st.booleans())  # a clamping post-accumulate-grad hook on out.weight
    return cfg


def _clamp_hook(p):
    p.grad.clamp_(-0.05, 0.05)


def run_with_events(cfg, data, ours):
    model = EventNet(cfg)
    if cfg["post_hook"]:
        model.out.weight.register_post_accumulate_grad_hook(_clamp_hook)
    opt = build(cfg, model, ours=ours)
    for window, (name, at) in zip(data, cfg["events"]):
        for j in range(len(window) + 1):
            if j == at:
                x, y = window[min(j, len(window) - 1)]
                EVENTS[name](model, opt, x, y)
            if j < len(window):
                x, y = window[j]
                loss_fn(model, x, y, cfg, window).backward()
        if cfg["clip"] is not None and not ours:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        opt.step()
        opt.zero_grad()
    return model


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=event_configs())
def test_matches_torch_optim_when_the_user_touches_the_model(cfg):
    note(repr(cfg))
    data = micro_batches(cfg)
    ref = run_with_events(cfg, data, ours=False)
    ours = run_with_events(cfg, data, ours=True)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        scale = q.detach().abs().max().item()
        assert math.isfinite(diff) and diff <= RTOL * scale, (
            f"{name}: relative error {diff / scale if scale else math.inf:.3g} > {RTOL:g}"
        )
