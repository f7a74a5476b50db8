"""The fused algorithms as data: torch.optim's defaults and checks, the state each keeps, and the
hyper-parameter record its step op takes, built from a param group.

Pure: no buffers, no kernels. :mod:`fused_accum.step` reads this table to take a step and
:mod:`fused_accum.optimizer` to accept param groups; :mod:`fused_accum.ops` declares the step ops
from the records here.

Adding an algorithm (say ``"foo"``, with one state buffer ``bar`` and hyper-parameters ``beta``
and ``maximize``), in this order:

1. Here: a frozen record ``FooHyper(NamedTuple)`` whose fields (``float``/``bool``, in the order
   the kernels take them) are the op's scalar arguments, with ``of(algorithm, group)``; an entry
   ``ALGORITHMS["foo"] = Algorithm(defaults, ("bar",), has_step, op="foo_step")``; its checks in
   :func:`validate_hyperparameters` and, if a hyper-parameter adds or removes a buffer, in
   :func:`state_keys`. The public class in :mod:`fused_accum.optimizer` (torch's signature).
2. :mod:`fused_accum.ops`: a record ``FooStates(NamedTuple)`` of its state lists, each named
   for its torch state key plus "s" (``bars: WrittenLists``; an optional one defaults to
   ``()``), and ``foo_step = StepOp("foo_step", FooStates, FooHyper)`` in ``STEP_OPS``. That
   is the whole declaration: the Python call, the backend contract ``foo_step(t, s, h)`` and
   both custom-op schemas (``fused_accum::foo_step_``, ``fused_accum_ext::foo_step_``) follow,
   and ``Stepper.fused_step`` needs no change.
3. Each backend, ``foo_step(t: StepTensors, s: FooStates, h: FooHyper)``: the spec first
   (:mod:`fused_accum.backends.reference`), then ``backends/triton/`` (a kernel in
   ``kernels.py``, its launch in ``launch.py``, ``plan=None`` too), and one line in
   ``backends/ext.py`` (``foo_step = _step_function(ops.foo_step)``: it flattens the records
   into the C++ operator's arguments).
4. C++: the update rule once in ``csrc/math.h`` (``FooHyper``, ``foo_hyper``), the CPU and
   CUDA kernels (``csrc/cpu``, ``csrc/cuda``, declared in ``csrc/kernels.h``), and
   ``foo_step_impl`` in ``csrc/bindings.h`` (``FUSED_ACCUM_STEP_PARAMETERS``, then the states'
   and the record's fields, in the declaration's order: the dispatcher refuses any other types
   when :mod:`fused_accum.backends.ext` defines the schema) with its line in ``register_impls``
   and a ``step`` overload in each ``*Backend`` struct.
5. Tests: its row in ``tests/test_kernels.py``'s ``ALGOS`` and ``tests/test_ext.py``'s
   ``_step_args``; ``tests/test_ops.py`` checks the registered schemas against the declaration.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A fused algorithm: its torch.optim-named defaults, the state it keeps per parameter (what
    hyper-parameters add or remove: :func:`state_keys`) and the step op that updates it."""

    defaults: dict
    state_keys: tuple
    has_step: bool  # torch keeps a ``step`` entry in its state
    op: str  # its step op in fused_accum.ops.STEP_OPS, which names the hyper-parameter record


# torch.optim keywords that choose torch's implementation (kept in the param groups, as torch
# keeps them, and otherwise ignored: the implementation here is always ours).
_TORCH_IMPL = dict(foreach=None, differentiable=False, fused=None)
ALGORITHMS = {
    "sgd": Algorithm(
        dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, **_TORCH_IMPL),
        ("momentum_buffer",),
        False,
        "sgd_step",
    ),
    "adam": Algorithm(
        dict(
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            amsgrad=False,
            maximize=False,
            capturable=False,
            decoupled_weight_decay=False,
            **_TORCH_IMPL,
        ),
        ("exp_avg", "exp_avg_sq"),
        True,
        "adam_step",
    ),
    "adamw": Algorithm(
        dict(
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=1e-2,
            amsgrad=False,
            maximize=False,
            capturable=False,
            decoupled_weight_decay=True,
            **_TORCH_IMPL,
        ),
        ("exp_avg", "exp_avg_sq"),
        True,
        "adam_step",
    ),
    "lion": Algorithm(
        dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False), ("exp_avg",), False, "lion_step"
    ),
}


# --- the hyper-parameter records: a step op's scalar arguments, built from a param group --------
# Frozen (a NamedTuple), in the order the op's schema and kernels take them; each ``of`` reads
# the group once per step (a tensor beta is read on the host, as torch's fused optimizers do).


class SgdHyper(NamedTuple):
    """torch.optim.SGD's hyper-parameters, as sgd_step takes them."""

    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    @classmethod
    def of(cls, algorithm: str, group: dict) -> "SgdHyper":
        return cls(
            scalar(group["momentum"]),
            scalar(group["dampening"]),
            scalar(group["weight_decay"]),
            bool(group["nesterov"]),
            bool(group["maximize"]),
        )


class AdamHyper(NamedTuple):
    """torch.optim.Adam's and AdamW's hyper-parameters, as adam_step takes them (amsgrad is not
    one: it is whether the op is given ``max_exp_avg_sqs``)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW's weight decay (the "adamw" algorithm), else Adam's
    maximize: bool

    @classmethod
    def of(cls, algorithm: str, group: dict) -> "AdamHyper":
        beta1, beta2 = (scalar(b) for b in group["betas"])
        return cls(
            beta1,
            beta2,
            scalar(group["eps"]),
            scalar(group["weight_decay"]),
            algorithm == "adamw",
            bool(group["maximize"]),
        )


class LionHyper(NamedTuple):
    """Lion's hyper-parameters, as lion_step takes them."""

    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool

    @classmethod
    def of(cls, algorithm: str, group: dict) -> "LionHyper":
        beta1, beta2 = (scalar(b) for b in group["betas"])
        return cls(beta1, beta2, scalar(group["weight_decay"]), bool(group["maximize"]))


def validate_hyperparameters(algorithm: str, h: dict, constructor: bool = False) -> None:
    """torch.optim's checks, in torch's order and with torch's messages (Lion: the same style).
    ``constructor``: also those torch makes of its constructor's arguments only (not of a group
    added later): a tensor lr or betas with ``foreach=True``."""
    lr = h["lr"]
    adam = algorithm in ("adam", "adamw")
    foreach_refuses_tensors = constructor and adam and h.get("foreach") and not h.get("capturable")
    if isinstance(lr, Tensor) and foreach_refuses_tensors:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if algorithm == "sgd":
        if lr < 0.0:  # (torch's SGD test: a NaN lr passes it, as there)
            raise ValueError(f"Invalid learning rate: {lr}")
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if algorithm == "sgd":
        if h["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {h['momentum']}")
        if h["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {h['weight_decay']}")
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return
    if "eps" in h and not 0.0 <= h["eps"]:
        raise ValueError(f"Invalid epsilon value: {h['eps']}")
    betas = h["betas"]
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= h["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {h['weight_decay']}")
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and foreach_refuses_tensors:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if h.get("differentiable"):
        raise NotImplementedError("differentiable=True is not supported by fused_accum's optimizers")


def parse_algorithm(optimizer, hyperparameters: dict) -> tuple:
    """``optimizer=`` and the hyper-parameter keywords -> (fused algorithm name or None, torch.optim
    class or None, the param groups' defaults). The caller refuses its own classes first."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer= takes an optimizer class (e.g. torch.optim.RMSprop) or a name, "
            f"not an instance of {type(optimizer).__name__}"
        )
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return None, optimizer, dict(hyperparameters)
    if not isinstance(optimizer, str) or optimizer.lower() not in ALGORITHMS:
        raise ValueError(
            f"optimizer must be one of {sorted(ALGORITHMS)} or a torch.optim.Optimizer subclass, got {optimizer!r}"
        )
    name = optimizer.lower()
    defaults = dict(ALGORITHMS[name].defaults)
    for key, value in hyperparameters.items():
        if key not in defaults:
            raise TypeError(f"unexpected keyword {key!r} for optimizer {name!r}; expected one of {sorted(defaults)}")
        defaults[key] = value
    validate_hyperparameters(name, defaults, constructor=True)
    return name, None, defaults


def check_after_groups(algorithm, defaults: dict) -> None:
    """The check torch's SGD, Adam and AdamW make once their groups are accepted (before any
    hook is attached here: a constructor that fails changes nothing)."""
    if algorithm in ("sgd", "adam", "adamw") and defaults.get("fused") and defaults.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def state_keys(algorithm, group: dict) -> tuple:
    """The state buffers ``group``'s hyper-parameters ask of ``algorithm`` now (None: the generic
    path, whose torch.optim optimizer keeps its own state)."""
    if algorithm is None:
        return ()
    keys = ALGORITHMS[algorithm].state_keys
    if algorithm == "sgd" and group["momentum"] == 0:
        return ()  # no buffer without momentum (allocated if momentum is turned on later)
    if algorithm in ("adam", "adamw") and group["amsgrad"]:
        keys = keys + ("max_exp_avg_sq",)
    return keys


def scalar(value) -> float:
    """A hyper-parameter or a saved step as a Python float (a 1-element tensor read once)."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)
