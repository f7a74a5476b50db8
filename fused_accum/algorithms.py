"""The fused algorithms as data: torch.optim's defaults and checks, and the state each keeps.

Pure: no buffers, no kernels. :mod:`fused_accum.step` reads this table to take a step and
:mod:`fused_accum.optimizer` to accept param groups, so a new algorithm starts here (then its op
in :mod:`fused_accum.ops` and its branch in ``Stepper.fused_step``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A fused algorithm: its torch.optim-named defaults and the state it keeps per parameter
    (what hyper-parameters add or remove: :func:`state_keys`)."""

    defaults: dict
    state_keys: tuple
    has_step: bool  # torch keeps a ``step`` entry in its state


# torch.optim keywords that choose torch's implementation (kept in the param groups, as torch
# keeps them, and otherwise ignored: the implementation here is always ours).
_TORCH_IMPL = dict(foreach=None, differentiable=False, fused=None)
ALGORITHMS = {
    "sgd": Algorithm(
        dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, **_TORCH_IMPL),
        ("momentum_buffer",),
        False,
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
    ),
    "lion": Algorithm(dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False), ("exp_avg",), False),
}


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
