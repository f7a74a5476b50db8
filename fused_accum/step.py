"""The flat step: one fused update of a flat group's slots (the coefficient it applies is the
window's: ``GradientWindow.scale``).

:class:`Stepper` is what both callers of the update hold: the optimizer's ``step()`` and the
window, which steps each bucket of the last backward itself under ``step_in_backward`` and
moves a flat group after its parameters. It holds what the step reads (the param groups, the
optimizer's ``state`` and the views it last showed there, the backend asked for) and nothing
that holds it: no optimizer, no window. The optimizer holds the window, the window the stepper;
a reference back up would be a cycle, and deleting the optimizer would no longer free its
buffers until the cycle collector ran (``tests/test_dropin.py``,
``test_i14_del_frees_buffers_and_parameters_without_the_cycle_collector``).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from . import backends, ops
from .registry import ALGORITHMS, initial_states, scalar, state_keys
from .flat import FlatGroup, Slot


class StateEntry(dict):
    """``opt.state[p]`` as the optimizer shows it: torch's state names -> views of the flat
    buffers. It remembers whether the user assigned or removed a key since (``edited``), so the
    step reads the entry back instead of stepping from buffers the user replaced."""

    __slots__ = ("edited",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.edited = False

    def _edit(method):  # noqa: N805 (a decorator of the class body)
        def edited(self, *args, **kwargs):
            self.edited = True
            return method(self, *args, **kwargs)

        return edited

    __setitem__ = _edit(dict.__setitem__)
    __delitem__ = _edit(dict.__delitem__)
    __ior__ = _edit(dict.__ior__)
    pop = _edit(dict.pop)
    popitem = _edit(dict.popitem)
    clear = _edit(dict.clear)
    update = _edit(dict.update)
    setdefault = _edit(dict.setdefault)
    del _edit


class Stepper:
    """The fused update and ``opt.state``'s views of the flat buffers.

    ``param_groups`` and ``state`` are the optimizer's own objects: torch's ``Optimizer`` and
    users rebind them (``opt.state = {}`` restarts the state), and the optimizer's properties of
    those names write through to here, so these are always the ones the user sees."""

    def __init__(self, algorithm, backend_request: str) -> None:
        self.algorithm = algorithm  # a fused algorithm's name; None: the generic path (no fused step)
        self.backend_request = backend_request
        self.param_groups: list = []
        self.state: dict = {}
        self.shown: dict = {}  # slot key -> the StateEntry last put in self.state
        self.generic = None  # the generic path (fused_accum.generic), which keeps its own state

    # --- what the window calls ---------------------------------------------------------------

    @torch.no_grad()  # (also when a backward steps: step_in_backward, create_graph=True)
    def fused_step(
        self, flat: FlatGroup, active: list, coef: Tensor, found_inf=None, grads=(), grads_overwrite=False
    ) -> None:
        """One step-op call for ``active`` slots; with ``grads``, also their last micro-batch."""
        call = self.prepare_step(flat, active, coef, found_inf, grads, grads_overwrite)
        if call is not None:
            call()

    @torch.no_grad()
    def prepare_step(
        self, flat: FlatGroup, active: list, coef: Tensor, found_inf=None, grads=(), grads_overwrite=False
    ) -> Optional[Callable[[], None]]:
        """Everything of a step but the kernel: its books (the learning rate written, ``opt.state``
        taken back), then :meth:`step_call`; returns the op call, or None where nothing steps
        (the host placement calls it on its worker thread: fused_accum.placement)."""
        if not active:
            return None
        group = self.param_groups[flat.group_index]
        self.write_lr(flat.lr, group)
        self.take_user_state(flat, active, group)
        return self.step_call(flat, active, coef, found_inf, grads, grads_overwrite)

    @staticmethod
    def write_lr(lr: Tensor, group: dict) -> None:
        """``group``'s learning rate into the flat group's ``lr`` tensor, which the step op reads
        (and a compiled step: a schedule changes it without a recompile)."""
        value = group["lr"]
        if isinstance(value, Tensor):
            # device to device: no host sync, capturable; an fp32 lr is exact in float64
            lr.copy_(value.detach().reshape(()))
        else:
            lr.fill_(float(value))  # float64: every bit of the Python float, as torch takes it

    def step_call(
        self,
        flat: FlatGroup,
        active: list,
        coef: Tensor,
        found_inf=None,
        grads=(),
        grads_overwrite=False,
        aliased: bool = False,
    ) -> Optional[Callable[[], None]]:
        """The step's tensor core for ``active`` slots, once its books are taken (what a
        compiled step traces: fused_accum.compiled, which says whether the weights are written
        through their ``aliased`` slots' aliases): the coefficient, the step counts (a skipped
        step does not count), and the op call returned (None where this process holds none of
        them)."""
        group = self.param_groups[flat.group_index]
        if coef is not flat.coef:
            flat.coef.copy_(coef)
        # A skipped step does not count (as torch's GradScaler skips the step call itself).
        increment = flat.one if found_inf is None else 1 - found_inf
        if len(active) == len(flat.slots):
            flat.steps.add_(increment)
            steps = flat.steps
        else:
            index = flat.active_index(tuple(s.index for s in active))
            flat.steps.index_add_(0, index, increment.expand(len(active)))
            steps = flat.steps.index_select(0, index)
        if torch.compiler.is_compiling():
            accs, weights, slot_states = flat.graph_lists(active, aliased)
        else:
            held, accs, weights = flat.step_lists(active)  # sharded: this rank's pieces
            if held is not active:
                if not held:
                    return None
                index = flat.active_index(tuple(s.index for s in held))
                steps = flat.steps.index_select(0, index)
                active = held
            slot_states = [slot.state for slot in active]
        op = ops.step_op(self.algorithm)
        fused = dict(grads=list(grads), grads_overwrite=grads_overwrite)  # the last micro-batch, if any
        t = ops.StepTensors(
            accs=accs, steps=steps, lr=flat.lr, coef=flat.coef, found_inf=found_inf, **weights._asdict(), **fused
        )
        s = op.states_of(slot_states, state_keys(self.algorithm, group))
        # The Triton backend's launch-plan key (ops plan=): these lists are views at fixed places
        # of this flat group's buffers; what changes their layout (the active set, the lists
        # passed) is in the key.
        everyone = len(active) == len(flat.slots)
        layout = (None if everyone else tuple(x.index for x in active), len(grads), grads_overwrite)
        plan = (flat.plan, layout, tuple(map(bool, s)))
        return functools.partial(op, t, s, op.hyper.of(self.algorithm, group), flat.step_backend, plan=plan)

    def state_unchanged(self, slot: Slot) -> bool:
        """Whether ``opt.state`` of ``slot`` is still what this stepper last showed: the same
        entry, nothing assigned into it or removed (an in-place edit of its tensors is in the
        buffers already)."""
        shown = self.shown.get(slot.key)
        return shown is None or (self.state.get(slot.param) is shown and not shown.edited)

    def rehome(self, flat: FlatGroup) -> None:
        """Move ``flat``'s buffers to where its parameters now are (a model moved, or
        materialised with ``to_empty``, after the optimizer was built)."""
        device = flat.slots[0].param.device
        if device.type == "meta":
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported "
                "devices: fused_accum always fuses, and these parameters are on the meta device; "
                "materialise the model (to_empty() or to()) before stepping"
            )
        flat.rehome(device, backends.resolve(self.backend_request, device))
        if self.generic is not None:
            self.generic.retarget(flat, self.state)
            return
        group = self.param_groups[flat.group_index]
        for slot in flat.slots:
            if self.state.get(slot.param):
                self.show_state(flat, slot, group)

    # --- opt.state ---------------------------------------------------------------------------

    def take_user_state(self, flat: FlatGroup, active: list, group, values: bool = True) -> None:
        """Before a step: allocate state turned on since the last one, and take what the user
        did to ``opt.state`` (an entry deleted, cleared or replaced by ``{}`` starts afresh, as
        torch's would; tensors assigned into it become the state) before the kernels read the
        buffers. Step counts change here, before the step adds to them. ``values=False`` (a
        compiled step's books): an edit is refused, as the graph cannot be handed its values."""
        algorithm = ALGORITHMS[self.algorithm]
        for key in state_keys(self.algorithm, group):
            # (its initial value read only when it is allocated: a tensor one is read on the host)
            if key not in flat.state and flat.ensure_state(key, algorithm.state(key).initial(group)):
                if algorithm.state(key).from_first_gradient:
                    # torch's buffer starts as a copy of the gradient at its first step with it
                    # (the kernels' first step: a step count of 1), not at the first step.
                    flat.steps.zero_()
                for slot in flat.slots:  # show the new buffer too
                    if self.shown.get(slot.key) is not None:
                        self.show_state(flat, slot, group)
        if not (flat.state or algorithm.has_step):
            return  # torch keeps no entry without state
        for slot in active:
            entry = self.state.get(slot.param)
            mine = self.shown.get(slot.key)
            if entry is not None and entry is mine and not entry.edited:
                continue
            if mine is not None or entry:  # (no entry yet and none shown: the slot's first step)
                if not values:
                    raise RuntimeError(
                        f"opt.state of parameter {slot.name} was replaced or assigned into since it was shown, "
                        "which a compiled step cannot take (its graph steps the buffers it was traced with): "
                        "edit its tensors in place, load it with opt.load_state_dict(), or step this window "
                        "outside the compiled function"
                    )
                self.load_slot_state(flat, slot, dict(entry or {}))
            self.show_state(flat, slot, group)

    def load_slot_state(self, flat: FlatGroup, slot: Slot, state: dict) -> None:
        """One slot's optimizer state from torch-named values (a missing one starts at its
        initial value, and an empty ``state`` at step 0, as torch's would), shown in
        ``opt.state``."""
        group = self.param_groups[flat.group_index]
        algorithm = ALGORITHMS[self.algorithm]
        for key, initial in initial_states(self.algorithm, group).items():
            flat.ensure_state(key, initial)
        # torch's SGD saves no step: a saved momentum buffer means at least one step was taken
        # (else the next step would re-initialise the buffer from the gradient).
        has_state = any(state.get(key) is not None for key in slot.state)
        step = state.get("step", 1.0 if has_state else 0.0)
        flat.steps[slot.index] = scalar(step)
        for key, view in slot.state.items():
            value = state.get(key)
            if value is None:  # missing (or torch SGD's momentum_buffer=None): its initial value
                view.fill_(algorithm.state(key).initial(group))
            else:
                view.copy_(fp32_piece(flat, slot, value))
        self.show_state(flat, slot, group)

    def show_state(self, flat: FlatGroup, slot: Slot, group) -> None:
        """Put ``opt.state[p]``: torch's state names, as fp32 views of the flat buffers (in-place
        edits go through)."""
        views = {}
        if ALGORITHMS[self.algorithm].has_step:
            views["step"] = flat.steps[slot.index]
        for key in state_keys(self.algorithm, group):
            views[key] = flat.state_view(slot, slot.state[key])
        entry = StateEntry(views)  # (dict's constructor: not an edit, unlike entry[key] = ...)
        self.state[slot.param] = entry
        self.shown[slot.key] = entry


def fp32_piece(flat: FlatGroup, slot: Slot, value: Tensor) -> Tensor:
    """A saved or assigned per-parameter value as the 1-D fp32 values of the slot's master or
    state slice, on the flat group's device (what of it this process holds: the layout's)."""
    return flat.loaded(slot, value)
