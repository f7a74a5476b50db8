"""What a flat group's fp32 master is: one object per format, chosen once from ``master_weights=``
and the parameters' dtype (:func:`choose`), which the flat buffers and their layouts call
without asking which format it is.

- :class:`WeightIsMaster`: no master is kept. fp32 parameters are their own; with
  ``master_weights=False`` bf16/fp16 parameters are updated in place (fp32 math, rounded once).
- :class:`Fp32Copy` (``master_weights=True``, the default for bf16/fp16): an fp32 copy of each
  parameter, 4 B/param; the step writes the parameter as the master rounded to nearest even.
- :class:`Remainder` (``master_weights="remainder"``, bf16 only): the master is the bf16
  parameter itself (its high half) and an int16 remainder (the rest), 2 B/param, split and
  rebuilt inside every step (``fused_accum.backends.reference.split_master``).

A format allocates its buffer, points each slot's views into it, says what the step op reads
and writes (the master lists, the low-precision copies, the remainders), reads and writes one
slot's master in fp32 (checkpoints) and decides what a weight written from outside means: an
fp32 copy follows it element by element, by value (the step kernels do it as they step; this
module for what reads the masters outside a step); a remainder stays under it (every (weight,
remainder) pair decodes within half an ulp of its weight); a weight that is its own master needs
nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)


class StepWeights(NamedTuple):
    """What a step op writes of the weights, by the names of its fields in
    :class:`fused_accum.ops.StepTensors`: ``params`` (the fp32 masters, or the parameters
    themselves), the low-precision copies the masters are rounded into, and the int16 low
    halves under bf16 parameters that are their own masters' high halves."""

    params: list
    lp_params: list = ()
    remainders: list = ()


class WeightIsMaster:
    """No master kept: the parameter is its own (fp32 parameters, ``master_weights=False``)."""

    keeps = False  # a checkpoint holds a "master" entry of its own
    dtype: Optional[torch.dtype] = None  # the dtype of the buffer it keeps (None: none)

    def new_buffer(self, numel: int, device) -> Optional[Tensor]:
        return torch.zeros(numel, dtype=self.dtype, device=device) if self.dtype is not None else None

    def set_views(self, flat, slot) -> None:
        """Point ``slot.master`` at its slice of ``flat.master`` (None: no buffer)."""
        slot.master = None

    def initialise(self, flat, slot) -> None:
        """A new slot, or one that moved: its master from the parameter's value."""

    def step_tensors(self, slots: list, weights: list, masters: Optional[list] = None) -> StepWeights:
        """What the step op writes for ``slots`` whose parameters (or the pieces of them this
        process steps) are ``weights`` (``masters``: their master slices, where not their views)."""
        return StepWeights(weights)

    def master_of(self, flat, slot) -> Tensor:
        """``slot``'s fp32 master as this process holds it (1-D)."""
        return flat.param_piece(slot).float()

    def set_master(self, flat, slot, value: Optional[Tensor]) -> None:
        """``slot``'s master becomes ``value`` (1-D fp32, a checkpoint's), or the parameter's value
        exactly (None)."""

    def follow(self, flat) -> None:
        """The masters follow weights written from outside, outside a step (see the module)."""

    def fp32_buffer(self, flat) -> Optional[Tensor]:
        """The local fp32 masters as one buffer of the master buffer's layout (a checkpoint's),
        or None where the format keeps none."""
        return None


class Fp32Copy(WeightIsMaster):
    """An fp32 copy of each low-precision parameter (``master_weights=True``)."""

    keeps = True
    dtype = torch.float32

    def set_views(self, flat, slot) -> None:
        slot.master = flat.master[slot.local]

    def initialise(self, flat, slot) -> None:
        slot.master.copy_(flat.param_piece(slot))

    def step_tensors(self, slots: list, weights: list, masters: Optional[list] = None) -> StepWeights:
        return StepWeights([s.master for s in slots] if masters is None else masters, lp_params=weights)

    def master_of(self, flat, slot) -> Tensor:
        return slot.master

    def set_master(self, flat, slot, value: Optional[Tensor]) -> None:
        slot.master.copy_(flat.param_piece(slot) if value is None else value)

    def follow(self, flat) -> None:
        """Where a weight's bits are no longer its master's rounding, the weight was written from
        outside the optimizer (``model.load_state_dict``, ``clamp_``, ``nn.init``, an EMA swap,
        ``.data``, ``dist.broadcast``: no version counter sees them all): that element's master
        restarts from it; the others keep their full precision. The step kernels do the same as
        they step (``reference.follow_weight``: +2 B/param read, no pass of its own); this is
        for what reads the masters outside a step (checkpoints, a torch.optim class stepping
        them)."""
        from .backends.reference import follow_weight

        for slot in flat.slots:
            weight = flat.param_piece(slot)
            if weight.numel():
                slot.master.copy_(follow_weight(slot.master, weight.to(slot.master.device)))

    def fp32_buffer(self, flat) -> Optional[Tensor]:
        return flat.master


class Remainder(WeightIsMaster):
    """The bf16 parameter is the master's high half, an int16 remainder its low half
    (``master_weights="remainder"``)."""

    keeps = True
    dtype = torch.int16

    def set_views(self, flat, slot) -> None:
        slot.master = flat.master[slot.local]  # (int16: the low halves)

    def step_tensors(self, slots: list, weights: list, masters: Optional[list] = None) -> StepWeights:
        return StepWeights(weights, remainders=[s.master for s in slots] if masters is None else masters)

    def master_of(self, flat, slot) -> Tensor:
        from .backends.reference import rebuild_master

        return rebuild_master(flat.param_piece(slot).to(slot.master.device), slot.master)  # (offload: on the host)

    def set_master(self, flat, slot, value: Optional[Tensor]) -> None:
        """(None: the remainder restarts at zero, so the master is the weight exactly; a value:
        the weight is written with the split's high half.)"""
        if value is None:
            slot.master.zero_()
            return
        from .backends.reference import split_master

        weight, remainder = split_master(value)
        flat.layout.write_param_piece(flat, slot, weight)
        slot.master.copy_(remainder)

    def fp32_buffer(self, flat) -> Optional[Tensor]:
        buf = torch.zeros(flat.local_numel, dtype=torch.float32, device=flat.device)
        for slot in flat.slots:
            buf[slot.local] = self.master_of(flat, slot)
        return buf


def choose(master_weights, dtype: torch.dtype, label: str) -> WeightIsMaster:
    """The format of the masters of parameters of ``dtype`` under ``master_weights`` (True, False
    or "remainder"); raises where it cannot keep them (``label`` names the parameters)."""
    if master_weights == "remainder" and dtype == torch.float16:
        raise TypeError(
            f"master_weights='remainder' is exact for bfloat16 parameters only, and parameter {label} is "
            "float16: an fp16 value is not the high half of an fp32 one (5 exponent bits, not 8), so no "
            "16-bit remainder rebuilds its fp32 master; use master_weights=True for fp16"
        )
    if dtype in LOW_PRECISION and master_weights is True:
        return Fp32Copy()
    if dtype == torch.bfloat16 and master_weights == "remainder":
        return Remainder()
    return WeightIsMaster()
