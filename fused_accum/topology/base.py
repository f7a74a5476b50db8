"""Who owns a gradient between backward and the step: the fixed points every topology answers.

The window (:mod:`fused_accum.window`) folds gradients into the flat buffers the same way in
every topology; at a few fixed points it, its folds and the optimizer's step ask the topology
what else happens. :class:`Topology` declares each one, with what one process does there
(mostly nothing); each data-parallel way overrides the ones it needs, in its own module. A
topology sees the window's state through the window's ledger (fused_accum.ledger), whose event
methods are how it changes it.

===========================  ================================================================
``stands_aside``             another engine fills ``.grad`` (DDP, FSDP2): the hooks do nothing
``fast_folds``               the hooks may fold and run backwards without Python (nothing to
                             reduce after a fold)
``sharded``                  no full gradient survives the window's reduction
``picklable``                the optimizer may be pickled (a process group cannot)
``decided``                  the topology is final (else ``resolve`` is asked at the first
                             backward)
``join``                     parameters join: the topology from now on (DTensors: FSDP2's)
``resolve``                  at the first backward: the topology for good (a DDP wrapper)
``layout``                   the layout of a new flat group's buffers (fused_accum.flat.Layout)
``check_optimizer``          raise if the optimizer cannot step these parameters
``default_bucket_mb``        the bucket size when ``bucket_cap_mb`` is not given
``attach``                   a slot is hooked (FSDP2 adds a hook of its own)
``add``                      a flat group joins the window
``before_backward``          a backward starts (zero: none may follow the window's reduction)
``staging_for``              where a bucket's gradients are folded instead of the accumulator
                             (shard="grads": a buffer reduce-scattered after the backward)
``in_place_ok``              a gradient may be written straight into its slice (fused wgrad)
``added``                    gradients were folded (so a reduction is owed)
``bucket_complete``          a bucket's local values are final for this backward
``syncs``                    the backward now running ends with the reduction
``final_at_bucket``          a bucket the window's last backward completed holds the window's
                             gradient here already (offload may step it as it lands)
``backward_ended``           a backward that reached the parameters ended
``finish``                   complete the reduction owed (the window's last backward, the step)
``take_user_grad``           a ``.grad`` the user assigned (True: taken here; zero-grads stages it)
``norm_terms``               the window's sum of squares and non-finite count, over every rank
``average_``                 the window's item count, as the group's mean (``num_items``)
``before_flat_step``         a flat group is about to step
``after_step_params``        every flat group stepped (sharded: gather the parameters)
``after_step``               the window ended (stepped, zeroed, discarded)
``reset``                    the window was discarded (forget a reduction in flight)
``no_sync``                  ``opt.no_sync()``'s context
``saved_value``              a per-parameter value as a checkpoint holds it
``gather_full``              a whole local buffer, in the one-process layout (sharded
                             checkpoints), or None where this process holds it whole
===========================  ================================================================

The choice is made once: at construction (:func:`fused_accum.topology.choose`), except that
one process's (``Local``) becomes FSDP2's when DTensor parameters join, or DDP's (``Native``)
at the first backward if a DDP wrapper was built after the optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from ..flat import FlatGroup, Layout, Slot


class Topology:
    """The fixed points, each with what one process does there (see the module's table)."""

    name = "topology"
    stands_aside = False
    fast_folds = True  # nothing reads a fold's result before the step: the hooks may fold alone
    sharded = False
    picklable = True
    decided = True

    # --- construction ---

    def join(self, ledger, params) -> "Topology":
        return self

    def resolve(self, params) -> "Topology":
        return self

    def layout(self) -> Layout:
        return Layout()

    def check_optimizer(self, ledger, generic: Optional[str]) -> None:
        """``generic``: the name of the torch.optim class that steps the parameters whole, or
        None for a fused algorithm."""

    def default_bucket_mb(self, device) -> float:
        # On a CPU the fold reads the bucket's gradients back: at 0.5 MB they are still in the
        # core's L2 cache (GPT-2 layout, d = 64, window_phases: a window's backwards 1-2 ms
        # faster than with 25 MB). Elsewhere DDP's 25 MB.
        return 0.5 if device.type == "cpu" else 25.0

    def attach(self, window, slot: Slot) -> None:
        pass

    def add(self, ledger, flat: FlatGroup) -> None:
        pass

    # --- a backward ---

    def before_backward(self, ledger) -> None:
        pass

    def staging_for(self, flat: FlatGroup, bucket) -> Optional[Tensor]:
        return None

    def in_place_ok(self, ledger, flat: FlatGroup) -> bool:
        return True

    def added(self) -> None:
        pass

    def bucket_complete(self, flat_groups, ledger, flat: FlatGroup, bucket) -> None:
        pass

    def syncs(self, ledger) -> bool:
        return False

    def final_at_bucket(self, ledger) -> bool:
        return True

    def backward_ended(self, ledger, flat_groups) -> None:
        pass

    def finish(self, ledger, flat_groups) -> None:
        pass

    def take_user_grad(self, flat_groups, slot: Slot, grad: Tensor) -> bool:
        return False  # (not taken here: the window copies it into the slot's slice)

    # --- the step ---

    def norm_terms(self, ledger, flat_groups, home) -> tuple:
        """(sum of squares, count of non-finite flags) of the window's gradient, 0-d fp32 on
        ``home``, over this process's devices. Taken from the buffers' values at the step, in a
        pass of its own (4 B/param read; one ``_foreach_norm`` per flat group, no host sync):
        what wrote ``.grad`` between the last backward and ``step()`` (``clip_grad_norm_``, a
        ``.data`` edit, ``dist.all_reduce(p.grad)``, ``scaler.unscale_``) is seen whatever it
        did to the version counters, which miss the last three. (A non-finite value makes the
        sum non-finite: the flag follows from it.)"""
        total = torch.zeros((), dtype=torch.float32, device=home)
        for flat in flat_groups:
            accs = [s.acc for s in flat.slots if s.has_grad]
            if len(accs) == len(flat.slots):
                # Every slice holds this window's gradient: the whole buffer is one tensor (its
                # padding is zero: nothing writes outside the slices), so the op count does not
                # grow with the parameters (a CPU _foreach_norm is one op per tensor).
                accs = [flat.acc]
            if accs:
                total.add_(torch.stack(torch._foreach_norm(accs)).square().sum().to(home))
        return total, torch.zeros_like(total)

    def average_(self, value: Tensor) -> Tensor:
        return value

    def before_flat_step(self, flat: FlatGroup, active: list) -> None:
        pass

    def after_step_params(self, flat_groups) -> None:
        pass

    def after_step(self, ledger, flat_groups) -> None:
        pass

    def reset(self) -> None:
        pass

    @contextlib.contextmanager
    def no_sync(self):
        yield

    # --- checkpoints ---

    def saved_value(self, flat: FlatGroup, slot: Slot, key: str, value: Tensor) -> Tensor:
        return value

    def gather_full(self, flat: FlatGroup, buf: Tensor) -> Optional[Tensor]:
        return None
