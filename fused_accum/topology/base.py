"""Who owns a gradient between backward and the step: the fixed points every topology answers.

The window (:mod:`fused_accum.window`) folds gradients into the flat buffers the same way in
every topology; at a few fixed points it, its folds and the optimizer's step ask the topology
what else happens. :class:`Topology` declares each one, with what one process does there
(mostly nothing); each data-parallel way overrides the ones it needs, in its own module. A
topology sees the window's state through the window's ledger (fused_accum.ledger), whose event
methods are how it changes it.

===============================  ================================================================
``stands_aside``                 another engine fills ``.grad`` (DDP, FSDP2): the hooks do nothing
``fast_folds``                   the hooks may fold and run backwards without Python (nothing to
                                 reduce after a fold)
``sharded``                      no full gradient survives the window's reduction
``picklable``                    the optimizer may be pickled (a process group cannot)
``exact_norm``                   the norm is the world-size invariant one (reduce_dtype="exact"
                                 without a process group: :func:`one_process_chunk_sums`)
``decided``                      the topology is final (else ``resolve`` is asked at the first
                                 backward)
``join``                         parameters join: the topology from now on (DTensors: FSDP2's)
``resolve``                      at the first backward: the topology for good (a DDP wrapper)
``layout``                       the layout of a new flat group's buffers (fused_accum.flat.Layout)
``check_optimizer``              raise if the optimizer cannot step these parameters
``default_bucket_mb``            the bucket size when ``bucket_cap_mb`` is not given
``attach``                       a slot is hooked (FSDP2 adds a hook of its own)
``add``                          a flat group joins the window
``before_backward``              a backward starts (zero: none may follow the window's reduction)
``stage``                        fold a bucket's gradients somewhere else than the accumulator
                                 (shard="grads": a buffer reduce-scattered after the backward)
``in_place_ok``                  a gradient may be written straight into its slice (fused wgrad)
``added``                        gradients were folded (so a reduction is owed)
``bucket_complete``              a bucket's local values are final for this backward
``syncs``                        the backward now running ends with the reduction
``final_at_bucket``              a bucket the window's last backward completed holds the window's
                                 gradient here already (offload may step it as it lands)
``backward_ended``               a backward that reached the parameters ended
``backward_raised``              a backward raised before its end (a reduction it began is ended)
``finish``                       complete the reduction owed (the window's last backward, the step)
``take_user_grad``               a ``.grad`` the user assigned (True: taken here; zero-grads stages it)
``dropped``                      the user cleared a ``.grad`` (zero-grads: its sharded piece goes)
``norm_terms``                   the window's sum of squares and non-finite count, over every rank
``step_divisor``                 what the window's gradient is divided by when no ``num_items`` is
                                 given (shard="grads" with reduce_dtype="exact": the world size)
``average_``                     the window's item count, as the group's mean (``num_items``)
``before_flat_step``             a flat group is about to step
``after_step_params``            every flat group stepped (sharded: gather the parameters)
``after_step``                   the window ended (stepped, zeroed, discarded)
``reset``                        the window was discarded (forget a reduction in flight)
``no_sync``                      ``opt.no_sync()``'s context
``saved_value``                  a per-parameter value as a checkpoint holds it
``gather_full``                  a whole local buffer, in the one-process layout (sharded
                                 checkpoints), or None where this process holds it whole
``compiled_autograd_refusal``    why a backward compiled autograd captures is refused (its
                                 folds are in the graph, where no reduction is), or None
===============================  ================================================================

The choice is made once: at construction (:func:`fused_accum.topology.choose`), except that
one process's (``Local``) becomes FSDP2's when DTensor parameters join, or DDP's (``Native``)
at the first backward if a DDP wrapper was built after the optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from ..flat import ALIGN, FlatGroup, Layout, Slot

# --- the world-size invariant norm (reduce_dtype="exact") ----------------------------------------
#
# The window's sum of squares, computed so that it does not depend on how many ranks hold the
# accumulator: every bucket's range is cut into chunks of CHUNK elements from the bucket's start
# (the slots' offsets within a bucket, and so the chunks' contents, do not depend on the world
# size; the sharded layout pads each bucket to CHUNK x world, so every rank's part is whole
# chunks). Each chunk's sum of squares is a halving tree of element-wise adds over a [rows, CHUNK]
# view (row i's sum: s[i, :h] + s[i, h:] until one column is left): every output element is one
# fp32 add of two fixed inputs, so the result depends neither on how many rows one call has, nor
# on the thread count (torch's CPU reductions split a reduction of more than 32,768 elements
# between threads), nor on the device's reduction kernel. The chunk sums of the buckets' content
# (ceil(content / CHUNK) per bucket: a sharded bucket's padding chunks are left out) are put in
# buffer order and added by the same halving tree, zero padded to a power of two. A zero added
# to a sum is exact, so a chunk's zero padding (past the content, in either layout) changes
# nothing. One process (reduce_dtype="exact" without a process group) and N ranks so compute the
# same bits. About 2 log2(CHUNK) + log2(chunks) element-wise ops per flat group, whatever the
# number of parameters.

CHUNK = 1024  # elements (a multiple of ALIGN; a power of two): buckets pad to CHUNK x world in the exact mode


def chunk_sums(rows: Tensor) -> Tensor:
    """The sums of squares of the rows of a [rows, CHUNK] fp32 tensor, by a halving tree."""
    s = rows * rows
    while s.shape[1] > 1:
        half = s.shape[1] // 2
        s = s[:, :half] + s[:, half:]
    return s.reshape(-1)


def tree_sum(values: Tensor) -> Tensor:
    """The sum of a 1-D fp32 tensor by a halving tree over it zero padded to a power of two (0-d)."""
    n = values.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    width = 1 << (n - 1).bit_length()
    s = torch.nn.functional.pad(values, (0, width - n)) if width != n else values
    while s.numel() > 1:
        half = s.numel() // 2
        s = s[:half] + s[half:]
    return s.reshape(())


def content(bucket) -> int:
    """Elements of ``bucket``'s range its slots cover (each padded to ALIGN), from its start:
    the same at every world size (the layouts differ only in the padding after it)."""
    last = bucket.slots[-1]
    return last.offset + -(-last.param.numel() // ALIGN) * ALIGN - bucket.start


def buffer_order(flat) -> list:
    """``flat``'s bucket indices in the order their ranges lie in the buffer."""
    return sorted(range(len(flat.buckets)), key=lambda b: flat.buckets[b].start)


def one_process_chunk_sums(flat) -> Tensor:
    """The chunk sums of squares of a whole (one-process) accumulator in buffer order, a slot
    holding no gradient of this window counting as zeros."""
    acc = flat.acc
    if not all(s.has_grad for s in flat.slots):
        acc = acc.clone()
        for s in flat.slots:
            if not s.has_grad:
                acc[s.offset : s.offset + s.param.numel()] = 0
    rows = []
    for b in buffer_order(flat):
        bucket = flat.buckets[b]
        n = content(bucket)
        width = -(-n // CHUNK) * CHUNK
        seg = acc[bucket.start : bucket.start + n]
        rows.append(torch.nn.functional.pad(seg, (0, width - n)) if width != n else seg)
    if not rows:
        return acc.new_zeros(0)
    return chunk_sums(torch.cat(rows).view(-1, CHUNK))


def sum_of_squares(flat_groups, active: list, home) -> Tensor:
    """The sum of squares of the accumulator slices of the ``active`` slots (per flat group),
    0-d fp32 on ``home``: one ``_foreach_norm`` per flat group, no host sync."""
    total = torch.zeros((), dtype=torch.float32, device=home)
    for flat, slots in zip(flat_groups, active):
        if len(slots) == len(flat.slots):
            # Every slice holds this window's gradient: the whole buffer is one tensor (its
            # padding is zero: nothing writes outside the slices), so the op count does not
            # grow with the parameters (a CPU _foreach_norm is one op per tensor).
            accs = [flat.acc]
        elif torch.compiler.is_compiling():  # (sliced from the graph's input, which views passed in would alias)
            accs = [flat.acc[s.local] for s in slots]
        else:
            accs = [s.acc for s in slots]
        if accs:
            total.add_(torch.stack(torch._foreach_norm(accs)).square().sum().to(home))
    return total


class Topology:
    """The fixed points, each with what one process does there (see the module's table)."""

    name = "topology"
    stands_aside = False
    fast_folds = True  # nothing reads a fold's result before the step: the hooks may fold alone
    sharded = False
    picklable = True
    decided = True
    # the window's norm by :func:`one_process_chunk_sums` (reduce_dtype="exact" in one process:
    # the norm of every world size's exact wire, bit for bit)
    exact_norm = False
    # why a compiled autograd backward is refused (its folds are captured in the graph, where no
    # reduction, staging or handing over is), or None where it is covered (one process)
    compiled_autograd_refusal: Optional[str] = "data parallelism (its reductions run from the hooks)"

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

    def stage(self, flat: FlatGroup, bucket, slots: list, grads: list, plan) -> bool:
        """Fold ``grads`` (of ``slots``, in bucket order) somewhere of the topology's own
        instead of the accumulator: True when done here."""
        return False

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

    def backward_raised(self, ledger, flat_groups) -> None:
        """A backward raised before its end, its partly filled buckets folded: what it arrived
        with stays (as torch keeps it in ``.grad``), and a retried backward adds to it."""

    def finish(self, ledger, flat_groups) -> None:
        pass

    def take_user_grad(self, flat_groups, slot: Slot, grad: Tensor) -> bool:
        return False  # (not taken here: the window copies it into the slot's slice)

    def dropped(self, flat_groups, slot: Slot) -> None:
        """The user cleared ``slot``'s ``.grad`` (``p.grad = None``, a module's ``zero_grad()``):
        the window no longer holds its gradient (here: its slice is overwritten by the next)."""

    # --- the step ---

    def norm_terms(self, ledger, flat_groups, home) -> tuple:
        """(sum of squares, count of non-finite flags) of the window's gradient, 0-d fp32 on
        ``home``, over this process's devices. Taken from the buffers' values at the step, in a
        pass of its own (4 B/param read; one ``_foreach_norm`` per flat group, no host sync):
        what wrote ``.grad`` between the last backward and ``step()`` (``clip_grad_norm_``, a
        ``.data`` edit, ``dist.all_reduce(p.grad)``, ``scaler.unscale_``) is seen whatever it
        did to the version counters, which miss the last three. (A non-finite value makes the
        sum non-finite: the flag follows from it.)"""
        if self.exact_norm:
            total = torch.zeros((), dtype=torch.float32, device=home)
            for flat in flat_groups:
                total.add_(tree_sum(one_process_chunk_sums(flat)).to(home))
            return total, torch.zeros_like(total)
        total = sum_of_squares(flat_groups, [[s for s in flat.slots if s.has_grad] for flat in flat_groups], home)
        return total, torch.zeros_like(total)

    def average_(self, value: Tensor) -> Tensor:
        return value

    # the window's gradient is divided by this when the step is given no ``num_items``: 1, or
    # the world size where the accumulators hold the group's sum (reduce_dtype="exact")
    step_divisor = 1

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
