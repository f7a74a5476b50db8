"""fused_accum.Muon: torch.optim.Muon's step, the registered algorithm whose step is not
elementwise (its record's ``middle``: the design document's "Steps that are not elementwise").

Its own module, beside :mod:`fused_accum.algorithms` (the elementwise ones), because it brings
the middle itself: torch.optim.Muon's Newton-Schulz orthogonalization of each matrix. The
prologue and epilogue are elementwise ops as every step op is: specified in
``backends/reference.py``, kernels in every backend (``csrc/math.h``'s MuonPrologue and
MuonEpilogue, ``backends/triton/updates.py``), run on the optimizer's backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .algorithms import _ACCUMULATION_DOC
from .optimizer import FusedAccumOptimizer
from .registry import Algorithm, Middle, State, check_tensor_lr, read_hyper, register


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


def _coefficients(group: dict) -> tuple:
    """``ns_coefficients``, refused at the step as torch.optim.Muon refuses it (its message),
    where indexing a wrong-length tuple would raise an IndexError or ignore a fourth value."""
    coefficients = group["ns_coefficients"]
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    return coefficients


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
            ns_a=lambda group: _coefficients(group)[0],
            ns_b=lambda group: _coefficients(group)[1],
            ns_c=lambda group: _coefficients(group)[2],
            match_rms_adamw=lambda group: group["adjust_lr_fn"] == "match_rms_adamw",
        ),
        # the prologue (momentum) and epilogue (decay, the adjusted-lr update, the weights'
        # formats) are step ops of every backend (muon_prologue, muon_epilogue), around this
        middle=Middle(_orthogonalize, _check_matrix),
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
