"""Where the step runs: a placement, one object per optimizer, chosen once at construction.

The window, its folds, checkpoints and the optimizer call a placement at a few fixed points,
declared here with what the device placement does there (mostly nothing): the step on the
parameters' own device, after the window. The host placement (``offload="cpu"``,
:mod:`fused_accum.offload`) keeps the state on the host and steps there, each bucket of the
window's last backward as it completes (speculatively: committed, or put back and stepped again,
at ``step()``). A further placement is one more subclass, not one more branch in the core.

=====================  =====================================================================
``hands_on_buckets``   the window's last backward must reach Python at each completed bucket
                       (the C++ hooks do not fold it alone)
``layout``             the layout of a new flat group, over the topology's
``bucket_final``       a bucket of the window's last backward holds its final sums
``backward_ended``     a backward ended (its buckets all folded)
``discarded``          the window will not step: its gradients are gone (``zero_grad()``, every
                       ``.grad`` cleared) or a backward of it raised
``before_checkpoint``  ``state_dict()`` is about to read the state whole
``step_window``        the step of every flat group, after the window
=====================  =====================================================================
"""

from __future__ import annotations

from typing import Optional

from .flat import Layout


class Placement:
    """The device placement: the step on the parameters' device, at ``step()``."""

    hands_on_buckets = False
    # why a compiled autograd backward is refused, or None (the device: its step waits for step())
    compiled_autograd_refusal = None

    def layout(self, device, base: Layout) -> Layout:
        return base

    def bucket_final(self, flat, bucket_index: int, ledger) -> None:
        pass

    def backward_ended(self, flat_groups) -> None:
        pass

    def discarded(self, flat_groups) -> None:
        pass

    def before_checkpoint(self, flat_groups) -> None:
        pass

    def step_window(
        self, flat_groups, topology, stepper, scale: dict, skip: Optional[dict], speculable: bool = False
    ) -> None:
        """The one "step the window" sequence: each flat group's slots that hold a gradient in
        one fused step (``scale``, ``skip``: per device), then the topology's after-step of the
        parameters (``shard=``: the all-gather). ``speculable``: the host placement's (whether
        the step may be a speculation's). (step_in_backward's per-bucket steps aside.)"""
        for flat in flat_groups:
            active = [s for s in flat.slots if s.has_grad]
            topology.before_flat_step(flat, active)
            stepper.fused_step(flat, active, scale[flat.device], skip[flat.device] if skip else None)
        topology.after_step_params(flat_groups)
