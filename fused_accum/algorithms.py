"""The fused algorithms: each one's record (torch.optim's defaults and checks, its state, the
hyper-parameter record its step op takes) and its drop-in class (torch's signature).

Registering a record (:func:`fused_accum.registry.register`) is all the layers need: the
optimizer, the window, the topologies and placements ask :mod:`fused_accum.registry` about it
by name, and never name an algorithm (``tests/test_structure.py`` holds that). Its math is one
function per backend.

Adding an algorithm (say an elementwise ``"foo"`` with one state buffer ``bar``) touches five
source files:

1. Here: its hyper-parameter record ``FooHyper(NamedTuple)`` (``float``/``bool`` fields, the
   step op's scalar arguments in the order the kernels take them, and ``of =
   classmethod(read_hyper)``); its check function (torch's checks in torch's order, from the
   pieces in :mod:`fused_accum.registry`); ``register(Algorithm("foo", defaults,
   (State("bar"),), FooHyper, _check_foo, has_step, op="foo_step", reads=...))``; and the
   drop-in class ``Foo(FusedAccumOptimizer)`` with torch's (or the published peer's) exact
   signature. A buffer that a hyper-parameter turns on is ``State("bar", when="key")``; one that
   does not start at zero, ``State("bar", init=...)``. The registration declares the step op
   (``ops.foo_step``, both custom-op schemas, ``fused_accum::foo_step_`` and
   ``fused_accum_ext::foo_step_``) and everything the layers ask (state keys and their initial
   values, checks, defaults).
2. ``backends/reference.py``: ``foo_step(t, s, h)``, the specification (the function named for
   the op: the reference backend's ``step`` calls it).
3. ``backends/triton/kernels.py``: its update rule for the generic step kernel, ``_foo_prepare``
   (per tensor) and ``_foo_update`` (per element block), and its row in ``UPDATES``.
4. ``csrc/math.h``: its trait struct and the line that instantiates the C++ and CUDA kernels of
   it (the C++ half's own notes there say what the struct holds).
5. ``fused_accum/__init__.py``: export ``Foo``.

Then its row in ``tests/cases.py`` (its torch class or peer, hyper-parameter cases, the modes it
runs in) puts it through the kernel, optimizer and mode tests. An algorithm whose step is not
elementwise (Muon's orthogonalization) also gives its record a ``middle``: see
:class:`fused_accum.registry.Algorithm`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import optimizer
from .optimizer import FusedAccumOptimizer
from .registry import (
    Algorithm,
    Middle,
    State,
    check_at_least_zero,
    check_beta_ranges,
    check_beta_types,
    check_not_differentiable,
    check_tensor_lr,
    read_hyper,
    register,
)

# torch.optim keywords that choose torch's implementation (kept in the param groups, as torch
# keeps them, and otherwise ignored: the implementation here is always ours).
_TORCH_IMPL = dict(foreach=None, differentiable=False, fused=None)

_ACCUMULATION_DOC = """
    Accumulation keywords (keyword-only), as for :class:`FusedAccumOptimizer`: ``accum_steps``,
    ``master_weights``, ``backend``, ``bucket_cap_mb``, ``step_in_backward``, ``max_grad_norm``,
    ``skip_nonfinite``, ``process_group``. ``foreach``, ``fused`` and ``capturable`` choose
    torch's implementation: kept in the param groups and otherwise ignored.
"""


# --- SGD -------------------------------------------------------------------------------------


class SgdHyper(NamedTuple):
    """torch.optim.SGD's hyper-parameters, as sgd_step takes them."""

    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    of = classmethod(read_hyper)


def _check_sgd(group: dict, constructor: bool) -> None:
    check_tensor_lr(group, constructor)
    if group["lr"] < 0.0:  # (torch's SGD test: a NaN lr passes it, as there)
        raise ValueError(f"Invalid learning rate: {group['lr']}")
    if group["momentum"] < 0.0:
        raise ValueError(f"Invalid momentum value: {group['momentum']}")
    if group["weight_decay"] < 0.0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


register(
    Algorithm(
        "sgd",
        dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, **_TORCH_IMPL),
        # no buffer without momentum (torch keeps none then; allocated if momentum is turned on
        # later), and torch's buffer starts as a copy of the gradient at its first step with one
        (State("momentum_buffer", when="momentum", from_first_gradient=True),),
        SgdHyper,
        _check_sgd,
        has_step=False,
        op="sgd_step",
    )
)


class SGD(FusedAccumOptimizer):
    __doc__ = "torch.optim.SGD's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        **accumulation,
    ):
        super().__init__(
            params,
            "sgd",
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
            **accumulation,
        )


# --- Adam and AdamW --------------------------------------------------------------------------


class AdamHyper(NamedTuple):
    """torch.optim.Adam's and AdamW's hyper-parameters, as adam_step takes them (amsgrad is not
    one: it is whether the op is given ``max_exp_avg_sqs``)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW's weight decay (decoupled_weight_decay), else Adam's
    maximize: bool

    of = classmethod(read_hyper)


def _check_adam(group: dict, constructor: bool) -> None:
    check_tensor_lr(group, constructor, foreach_refuses_tensors=True)
    check_at_least_zero(group, "lr", "learning rate")
    check_at_least_zero(group, "eps", "epsilon value")
    check_beta_ranges(group)
    check_at_least_zero(group, "weight_decay", "weight_decay value")
    check_beta_types(group, constructor, foreach_refuses_tensors=True)
    check_not_differentiable(group)


_ADAM_DEFAULTS = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    amsgrad=False,
    maximize=False,
    capturable=False,
    decoupled_weight_decay=False,
    **_TORCH_IMPL,
)
_ADAM = register(
    Algorithm(
        "adam",
        _ADAM_DEFAULTS,
        (State("exp_avg"), State("exp_avg_sq"), State("max_exp_avg_sq", when="amsgrad")),
        AdamHyper,
        _check_adam,
        has_step=True,
        op="adam_step",
        reads=dict(beta1=("betas", 0), beta2=("betas", 1), decoupled="decoupled_weight_decay"),
    )
)
# AdamW is Adam with decoupled weight decay (its groups' decoupled_weight_decay), other defaults
register(
    dataclasses.replace(
        _ADAM, name="adamw", defaults=dict(_ADAM_DEFAULTS, weight_decay=1e-2, decoupled_weight_decay=True)
    )
)


class Adam(FusedAccumOptimizer):
    __doc__ = "torch.optim.Adam's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adam"

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        **accumulation,
    ):
        name = "adamw" if decoupled_weight_decay or self._name == "adamw" else "adam"
        super().__init__(
            params,
            name,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            **accumulation,
        )


class AdamW(Adam):
    __doc__ = "torch.optim.AdamW's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adamw"

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        **accumulation,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            **accumulation,
        )


# --- Lion ------------------------------------------------------------------------------------


class LionHyper(NamedTuple):
    """Lion's hyper-parameters, as lion_step takes them."""

    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool

    of = classmethod(read_hyper)


def _check_lion(group: dict, constructor: bool) -> None:
    """Adam's checks, in torch's style, of the hyper-parameters Lion has."""
    check_tensor_lr(group, constructor)
    check_at_least_zero(group, "lr", "learning rate")
    check_beta_ranges(group)
    check_at_least_zero(group, "weight_decay", "weight_decay value")
    check_beta_types(group, constructor)


register(
    Algorithm(
        "lion",
        dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False),
        (State("exp_avg"),),
        LionHyper,
        _check_lion,
        has_step=False,
        op="lion_step",
        reads=dict(beta1=("betas", 0), beta2=("betas", 1)),
    )
)


class Lion(FusedAccumOptimizer):
    __doc__ = "Lion (Chen et al. 2023), fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **accumulation):
        super().__init__(
            params, "lion", lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, **accumulation
        )


# --- Muon ------------------------------------------------------------------------------------


class MuonHyper(NamedTuple):
    """torch.optim.Muon's hyper-parameters, as its prologue, middle and epilogue take them."""

    momentum: float
    nesterov: bool
    weight_decay: float
    ns_a: float  # ns_coefficients, the quintic's three
    ns_b: float
    ns_c: float
    eps: float
    ns_steps: float  # (an int: every field is a float or a bool)
    match_rms_adamw: bool  # adjust_lr_fn == "match_rms_adamw", else "original" (None)

    of = classmethod(read_hyper)


def _check_muon(group: dict, constructor: bool) -> None:
    """torch.optim.Muon's constructor checks, its messages (it checks no group added later)."""
    if not constructor:
        return
    check_tensor_lr(group, constructor)
    if not 0.0 <= group["lr"]:
        raise ValueError(f"Learning rate should be >= 0 but is: {group['lr']}")
    if not 0.0 <= group["momentum"]:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")


def _check_matrix(p) -> None:
    if p.ndim != 2:
        raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")


def _newton_schulz(update, h: MuonHyper):
    """torch.optim.Muon's orthogonalization of one matrix, in its ops and their order (bf16
    matmuls, as there): the quintic Newton-Schulz iteration, ``ns_steps`` times, on the wide
    orientation, after scaling the spectral norm to at most 1 by the Frobenius norm."""
    if h.ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    tall = update.size(0) > update.size(1)
    x = update.bfloat16()
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=h.eps))
    for _ in range(int(h.ns_steps)):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=h.ns_b, alpha=h.ns_c), x, beta=h.ns_a)
    return x.T if tall else x


def _orthogonalize(updates: list, h: MuonHyper) -> list:
    return [_newton_schulz(u, h) for u in updates]


_MUON_DEFAULTS = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.7750, 2.0315),
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
)
register(
    Algorithm(
        "muon",
        _MUON_DEFAULTS,
        (State("momentum_buffer"),),
        MuonHyper,
        _check_muon,
        has_step=False,
        op="muon_step",
        reads=dict(
            ns_a=("ns_coefficients", 0),
            ns_b=("ns_coefficients", 1),
            ns_c=("ns_coefficients", 2),
            match_rms_adamw=lambda group: group["adjust_lr_fn"] == "match_rms_adamw",
        ),
        # the prologue (momentum) and epilogue (decay, the adjusted-lr update, the weights'
        # formats) on the reference backend, torch ops on the parameters' device: no kernel yet
        middle=Middle(_orthogonalize, _check_matrix, elementwise_backend="reference"),
    )
)


class Muon(FusedAccumOptimizer):
    __doc__ = (
        "torch.optim.Muon's signature (2-D parameters only), fused with fp32 gradient accumulation. Its step "
        "is the momentum (an elementwise prologue), the Newton-Schulz orthogonalization of each matrix (torch "
        "matmuls, as torch.optim.Muon's) and the update (an elementwise epilogue); ``shard=``, FSDP2 and "
        "``offload=`` are refused (each rank must hold whole matrices: ``process_group=`` or DDP)." + _ACCUMULATION_DOC
    )

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=(3.4445, -4.775, 2.0315),
        eps=1e-7,
        ns_steps=5,
        adjust_lr_fn=None,
        **accumulation,
    ):
        super().__init__(
            params,
            "muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            **accumulation,
        )


# These four lived in fused_accum.optimizer until the records moved here: an optimizer pickled
# before names its class there.
optimizer.SGD, optimizer.Adam, optimizer.AdamW, optimizer.Lion = SGD, Adam, AdamW, Lion
