"""The fused algorithms: each one's record (torch.optim's defaults and checks, its state, the
hyper-parameter record its step op takes) and its drop-in class (torch's signature).

Registering a record (:func:`fused_accum.registry.register`) is all the layers need: the
optimizer, the window, the topologies and placements ask :mod:`fused_accum.registry` about it
by name, and never name an algorithm (``tests/test_structure.py`` holds that). Its math is one
function per backend.

Adding an algorithm (say an elementwise ``"foo"`` with one state buffer ``bar``) touches five
source files:

1. Here: its hyper-parameter record ``FooHyper(NamedTuple)`` (``float``, ``bool`` and
   ``Optional[float]`` fields, the last for one that may be None, the step op's scalar arguments
   in the order the kernels take them, and ``of = classmethod(read_hyper)``); its check function
   (torch's checks in torch's order, from the pieces in :mod:`fused_accum.registry`);
   ``register(Algorithm("foo", defaults, (State("bar"),), FooHyper, _check_foo, has_step,
   op="foo_step", reads=...))``; and the drop-in class ``Foo(FusedAccumOptimizer)`` with
   torch's (or the published peer's) exact signature. A buffer that a hyper-parameter turns on
   is ``State("bar", when="key")``; one that does not start at zero, ``State("bar", init=...)``.
   The registration declares the step op (``ops.foo_step``, both custom-op schemas,
   ``fused_accum::foo_step_`` and ``fused_accum_ext::foo_step_``) and everything the layers ask
   (state keys and their initial values, checks, defaults).
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
:class:`fused_accum.registry.Algorithm`, and :mod:`fused_accum.muon`, the one registered.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from . import optimizer
from .optimizer import FusedAccumOptimizer
from .registry import (
    Algorithm,
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


# --- Adagrad ---------------------------------------------------------------------------------


class AdagradHyper(NamedTuple):
    """torch.optim.Adagrad's hyper-parameters, as adagrad_step takes them
    (initial_accumulator_value is not one: it is where the ``sum`` state starts)."""

    lr_decay: float
    weight_decay: float
    eps: float
    maximize: bool

    of = classmethod(read_hyper)


def _check_adagrad(group: dict, constructor: bool) -> None:
    check_tensor_lr(group, constructor)
    check_at_least_zero(group, "lr", "learning rate")
    check_at_least_zero(group, "lr_decay", "lr_decay value")
    check_at_least_zero(group, "weight_decay", "weight_decay value")
    check_at_least_zero(group, "initial_accumulator_value", "initial_accumulator_value value")
    check_at_least_zero(group, "eps", "epsilon value")
    check_not_differentiable(group)


register(
    Algorithm(
        "adagrad",
        dict(
            lr=1e-2,
            lr_decay=0,
            eps=1e-10,
            weight_decay=0,
            initial_accumulator_value=0,
            foreach=None,
            maximize=False,
            differentiable=False,
            fused=None,
        ),
        # torch's sum starts at initial_accumulator_value
        (State("sum", init="initial_accumulator_value"),),
        AdagradHyper,
        _check_adagrad,
        has_step=True,
        op="adagrad_step",
    )
)


class Adagrad(FusedAccumOptimizer):
    __doc__ = "torch.optim.Adagrad's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(
        self,
        params,
        lr=1e-2,
        lr_decay=0,
        weight_decay=0,
        initial_accumulator_value=0,
        eps=1e-10,
        foreach=None,
        *,
        maximize=False,
        differentiable=False,
        fused=None,
        **accumulation,
    ):
        super().__init__(
            params,
            "adagrad",
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
            **accumulation,
        )


# --- AdEMAMix --------------------------------------------------------------------------------


class AdEMAMixHyper(NamedTuple):
    """AdEMAMix's hyper-parameters, as ademamix_step takes them."""

    beta1: float
    beta2: float
    beta3: float
    alpha: float
    t_alpha_beta3: Optional[float]  # the warm-up of alpha and beta3, in steps; None: none
    eps: float
    weight_decay: float
    maximize: bool

    of = classmethod(read_hyper)


def _check_ademamix(group: dict, constructor: bool) -> None:
    """pytorch-optimizer's checks of AdEMAMix (beta1 and beta2 in [0, 1), beta3 in [0, 1], the
    others at least 0), in torch's words, and what its warm-up needs to step (pytorch-optimizer
    fails then, at the first step: a math domain error or a division by zero)."""
    check_tensor_lr(group, constructor)
    check_at_least_zero(group, "lr", "learning rate")
    betas = group["betas"]
    if len(betas) != 3:
        raise ValueError(f"AdEMAMix takes three betas (beta1, beta2, beta3), got {len(betas)}: {betas}")
    for i, b in enumerate(betas):
        if not (0.0 <= b < 1.0 or (i == 2 and b == 1.0)):
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    check_beta_types(group, constructor)
    check_at_least_zero(group, "alpha", "alpha value")
    t = group["t_alpha_beta3"]
    if t is not None:
        if not t > 0:
            raise ValueError(f"Invalid t_alpha_beta3 value: {t} (a number of steps, or None for no warm-up)")
        if not (betas[0] > 0 and betas[2] > 0):
            raise ValueError(
                f"AdEMAMix's beta3 warm-up (t_alpha_beta3={t}) interpolates log(beta1) and log(beta3): "
                f"betas[0] and betas[2] must be > 0, got {betas[0]} and {betas[2]} (or pass t_alpha_beta3=None)"
            )
    check_at_least_zero(group, "eps", "epsilon value")
    check_at_least_zero(group, "weight_decay", "weight_decay value")


register(
    Algorithm(
        "ademamix",
        dict(
            lr=1e-3,
            betas=(0.9, 0.999, 0.9999),
            alpha=5.0,
            t_alpha_beta3=None,
            eps=1e-8,
            weight_decay=0.0,
            maximize=False,
        ),
        # pytorch-optimizer's names: the fast EMA, the second moment, the slow EMA
        (State("exp_avg"), State("exp_avg_sq"), State("exp_avg_slow")),
        AdEMAMixHyper,
        _check_ademamix,
        has_step=True,  # (the bias corrections and the warm-up count it; pytorch-optimizer keeps it per group)
        op="ademamix_step",
        reads=dict(beta1=("betas", 0), beta2=("betas", 1), beta3=("betas", 2)),
    )
)


class AdEMAMix(FusedAccumOptimizer):
    __doc__ = (
        'AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"): Adam '
        "with a second, slow EMA of the gradient weighted by ``alpha``, both warmed up over "
        "``t_alpha_beta3`` steps, decoupled weight decay as AdamW's; "
        "pytorch-optimizer's ``AdEMAMix(weight_decouple=True)``, fused with fp32 gradient accumulation."
        + _ACCUMULATION_DOC
    )

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha_beta3=None,
        eps=1e-8,
        weight_decay=0.0,
        *,
        maximize=False,
        **accumulation,
    ):
        super().__init__(
            params,
            "ademamix",
            lr=lr,
            betas=betas,
            alpha=alpha,
            t_alpha_beta3=t_alpha_beta3,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            **accumulation,
        )


# These four lived in fused_accum.optimizer until the records moved here: an optimizer pickled
# before names its class there.
optimizer.SGD, optimizer.Adam, optimizer.AdamW, optimizer.Lion = SGD, Adam, AdamW, Lion
