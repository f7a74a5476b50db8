"""FusedAccumOptimizer: the ``torch.optim`` face of fused gradient accumulation.

This module holds what a user or a trainer sees: param groups and their hyper-parameters,
``step``, ``zero_grad``, ``state`` and ``state_dict``. It does no math and no hook plumbing,
and names no algorithm:

- :mod:`fused_accum.registry`: what it asks of the fused algorithms (their defaults, torch's
  checks, their state); :mod:`fused_accum.algorithms`: each one's record and drop-in class;
- :mod:`fused_accum.step`: the fused step (``Stepper``),
  and ``opt.state``'s views of the buffers;
- :mod:`fused_accum.checkpoint`: ``state_dict``, ``gathered_state_dict``, ``load_state_dict``;
- :mod:`fused_accum.generic`: ``optimizer=`` a ``torch.optim`` class;
- :mod:`fused_accum.window` takes the gradients (hooks, micro-batch counting, ``.grad``
  exposure, the window's norm and non-finite flag);
- :mod:`fused_accum.flat` holds the fp32 buffers (accumulator, masters, optimizer state).

What each argument does, and where the optimizer differs from torch's: docs/optimizer.md,
docs/distributed.md and docs/differences.md.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import backends, checkpoint, compiled
from .registry import ALGORITHMS, Algorithm  # noqa: F401 (importable here, as before they moved)
from .registry import check_after_groups, check_whole_tensors, fused_names, parse_algorithm
from . import topology
from .flat import padded_offsets  # noqa: F401 (re-exported)
from .members import Members
from .offload import Offload
from .placement import Placement
from .generic import GenericPath
from .step import StateEntry, Stepper  # noqa: F401 (StateEntry: importable here, as before)
from .window import GradientWindow, check_num_items, window_scale


def _check_offload(offload, optimizer, master_weights, step_in_backward) -> None:
    """``offload=``'s own checks (what it needs)."""
    if offload is None:
        return
    if offload != "cpu":
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    if not isinstance(optimizer, str):
        raise ValueError(
            "offload='cpu' steps on the host with the package's kernels: a fused algorithm only "
            f"({fused_names()}), not a torch.optim class"
        )
    if master_weights is False:
        raise ValueError("offload='cpu' keeps the masters on the host: master_weights=False leaves none to keep")
    if step_in_backward:
        raise ValueError("step_in_backward=True steps on the device during backward: offload='cpu' steps on the host")


def _check_arguments(
    optimizer, accum_steps, master_weights, backend, bucket_cap_mb, step_in_backward, max_grad_norm, skip_nonfinite
) -> None:
    """The constructor's keywords, checked before anything is built (in this order: the first
    error found is the one raised). Those of data parallelism are checked by topology.choose."""
    if not (master_weights is None or isinstance(master_weights, bool) or master_weights == "remainder"):
        raise ValueError(f"master_weights must be True, False, 'remainder' or None, got {master_weights!r}")
    if master_weights == "remainder" and not isinstance(optimizer, str):
        raise ValueError(
            f"master_weights='remainder' needs a fused algorithm ({fused_names()}): a torch.optim "
            "class steps fp32 master tensors, which this mode does not keep"
        )
    if accum_steps is not None and (not isinstance(accum_steps, int) or accum_steps < 1):
        raise ValueError(f"accum_steps must be a positive int or None, got {accum_steps!r}")
    if backend != "auto" and backend not in backends.NAMES:
        raise ValueError(f"backend must be 'auto' or one of {backends.NAMES}, got {backend!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    if step_in_backward and accum_steps is None:
        raise ValueError("step_in_backward=True needs accum_steps: the last micro-batch must be known")
    if step_in_backward and (max_grad_norm is not None or skip_nonfinite):
        raise ValueError(
            "step_in_backward=True steps before the window's norm is known: "
            "it cannot be combined with max_grad_norm or skip_nonfinite"
        )
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
    if step_in_backward and not isinstance(optimizer, str):
        raise ValueError(f"step_in_backward=True needs a fused algorithm ({fused_names()})")


class _LastNorm:
    """The last window's norm (``last_grad_norm``). Its own object: Dynamo does not replay a
    compiled step's attribute stores into the optimizer itself (torch 2.13)."""

    value: Optional[Tensor] = None


class FusedAccumOptimizer(torch.optim.Optimizer):
    """Gradient accumulation into fp32 buffers with a fused optimizer step; a drop-in optimizer.

    ``optimizer``: the name of a fused algorithm (one of :data:`fused_accum.registry.ALGORITHMS`,
    each defined in :mod:`fused_accum.algorithms`), or any ``torch.optim.Optimizer`` class (the
    generic path, built with the hyper-parameter keywords as torch's constructor takes them);
    its hyper-parameters take torch.optim's names and defaults. The keywords (``accum_steps``,
    ``master_weights``, ``backend``, ``bucket_cap_mb``, ``step_in_backward``,
    ``max_grad_norm``, ``skip_nonfinite``, ``process_group``, ``shard``, ``reduce_dtype``) and
    FSDP2 use are documented in docs/optimizer.md and
    docs/distributed.md.
    """

    _fused_accum_owner = True  # (fused_accum.owners: a torch.optim step pre-hook tells ours apart)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's flag for "step() takes GradScaler's grad_scale and found_inf": True only when
        torch.amp.GradScaler asks (docs/optimizer.md, "GradScaler, fused": Lightning reads the flag as
        "cannot be clipped")."""
        return sys._getframe(1).f_globals.get("__name__") == "torch.amp.grad_scaler"

    @property
    def last_grad_norm(self) -> Optional[Tensor]:
        """The last window's norm (0-d, on the device), where the step computed one; else None."""
        return self._last_norm.value

    # torch's Optimizer and users rebind these two (``opt.state = {}`` restarts the state, as
    # torch's does): the stepper, which the window holds, must always read the ones shown here.
    @property
    def state(self) -> dict:
        return self._stepper.state

    @state.setter
    def state(self, value: dict) -> None:
        self._stepper.state = value

    @property
    def param_groups(self) -> list:
        return self._stepper.param_groups

    @param_groups.setter
    def param_groups(self, value: list) -> None:
        self._stepper.param_groups = value

    @torch.inference_mode(False)  # built under inference_mode, the buffers would be inference tensors
    def __init__(
        self,
        params: Iterable,
        optimizer: Union[str, type] = "adamw",
        *,
        accum_steps: Optional[int] = None,
        master_weights: Union[bool, str, None] = None,
        backend: str = "auto",
        bucket_cap_mb: Optional[float] = None,
        step_in_backward: bool = False,
        max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = False,
        process_group=None,
        shard: Optional[str] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        offload: Optional[str] = None,
        **hyperparameters: Any,
    ):
        _check_offload(offload, optimizer, master_weights, step_in_backward)
        _check_arguments(
            optimizer,
            accum_steps,
            master_weights,
            backend,
            bucket_cap_mb,
            step_in_backward,
            max_grad_norm,
            skip_nonfinite,
        )
        topology.check_arguments(
            process_group, shard, reduce_dtype, fused=isinstance(optimizer, str), step_in_backward=step_in_backward
        )
        if isinstance(optimizer, type) and issubclass(optimizer, FusedAccumOptimizer):
            raise TypeError("optimizer= cannot be a FusedAccumOptimizer class")
        self._algorithm, generic_class, defaults = parse_algorithm(optimizer, hyperparameters)
        check_whole_tensors(self._algorithm, shard=shard, offload=offload)
        self._config = dict(
            optimizer=optimizer,
            accum_steps=accum_steps,
            master_weights=master_weights,
            backend=backend,
            bucket_cap_mb=bucket_cap_mb,
            step_in_backward=step_in_backward,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=skip_nonfinite,
            process_group=process_group,
            shard=shard,
            reduce_dtype=reduce_dtype,
            offload=offload,
            hyperparameters=dict(hyperparameters),
        )
        self.accum_steps = accum_steps
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self._last_norm = _LastNorm()  # (a holder: Dynamo replays a compiled step's store into it)
        self._master_weights = True if master_weights is None else master_weights
        # before torch's __init__, which sets self.state and self.param_groups through it
        self._stepper = Stepper(self._algorithm, backend)
        self._generic = GenericPath(generic_class, defaults) if generic_class is not None else None
        self._stepper.generic = self._generic
        self._window = GradientWindow(
            accum_steps=accum_steps,
            step_in_backward=step_in_backward,
            wants_stats=max_grad_norm is not None or skip_nonfinite,
            topology=topology.choose(process_group, shard, reduce_dtype),
            stepper=self._stepper,
            label=f"{type(self).__name__} at {id(self):#x}",
            placement=Offload(self._stepper, weakref.ref(self)) if offload == "cpu" else Placement(),
        )
        self._members = Members(
            self._window,
            algorithm=self._algorithm,
            generic=self._generic,
            master_weights=self._master_weights,
            backend=backend,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._warned_unstarted = False  # (step_in_backward: see _warn_unstarted_window)
        # how compiled graphs name this optimizer to their books (fused_accum.compiled)
        self._graph_id, self._graph_token = compiled.register(self)
        super().__init__(params, defaults)
        if self._generic is not None:  # the class's defaults where not given, as its own shows them
            self.defaults = {**self._generic.inner.defaults, **self.defaults}
        check_after_groups(self._algorithm, defaults)
        # All-or-nothing: hooks go on (and older optimizers over these parameters are
        # detached) only once every group has been accepted.
        self._window.attach(self._window.slots)
        self._members.attached = True

    # --- construction ----------------------------------------------------------------------

    @torch.inference_mode(False)
    def add_param_group(self, param_group: dict) -> None:
        """Add a group as torch.optim does (generators, names, the same errors), then give its
        parameters buffers and, once the optimizer is built, hooks. All or nothing."""
        super().add_param_group(param_group)
        try:
            check_whole_tensors(self._algorithm, params=self.param_groups[-1]["params"])
            self._members.add_group(self.param_groups, len(self.param_groups) - 1, self.state)
        except BaseException:
            self.param_groups.pop()
            raise

    # --- the window, as the user drives it ----------------------------------------------------

    def remove_hooks(self) -> None:
        """Stop folding gradients (autograd fills ``.grad`` natively again); the optimizer can
        no longer step. Building a new optimizer over the parameters does this implicitly."""
        self._window.detach("remove_hooks() was called")

    @property
    def microbatches(self) -> int:
        """Backward passes folded since the last step (each ``backward()`` that reaches a
        parameter counts once: two backward calls per micro-batch count twice)."""
        return self._window.microbatches

    def accumulated_grad(self, param: Tensor) -> Optional[Tensor]:
        """The fp32 gradient accumulated for ``param`` in this window (a live view), or None."""
        slot = self._window.slot_for(param)
        if slot is None:
            raise KeyError("this parameter is not trained by this optimizer (not given, or frozen)")
        self._window.flush()
        return slot.grad_view if slot.has_grad else None

    def no_sync(self):
        """With ``process_group``: backward passes inside this context are not reduced across
        the group; the next backward outside it ends the window with the reduction, as
        DistributedDataParallel's ``no_sync()``. Without it the window ends (and is reduced)
        after ``accum_steps`` backward passes, or after every backward when that is None."""
        return self._window.topology.no_sync()

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``; traced by ``torch.compile`` under ``trace_autograd_ops``, the
        gradients of this optimizer's parameters folded by ops of the graph (fused_accum.compiled)."""
        if torch.compiler.is_compiling():
            return compiled.backward(self, loss)
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the window. ``set_to_none=True`` (default): every ``.grad`` becomes None and
        the next gradient of each slice overwrites it, with no zeroing pass. ``False``: the
        exposed gradients are zeroed in place and stay exposed, as in torch."""
        if torch.compiler.is_compiling():
            return compiled.zero_grad(self, set_to_none)
        window = self._window
        window.zero_grad(set_to_none)
        for group in self.param_groups:  # the rest: frozen parameters, or grads the window does not own
            for p in group["params"]:
                if p.grad is None:
                    continue
                slot = window.slot_for(p)
                if slot is not None and p.grad is slot.grad_view:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_() if p.grad.grad_fn is not None else p.grad.requires_grad_(False)
                    p.grad.zero_()

    # --- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, num_items=None):
        """Apply one update from the accumulated gradients. ``num_items``: divide the summed
        gradient by it (an int, float or device tensor; see docs/optimizer.md, "Sums, like .grad").
        Traced by ``torch.compile`` where it can be (fused_accum.compiled), else a graph break."""
        if torch.compiler.is_compiling():
            return compiled.step(self, closure, num_items)
        return self._step(closure, num_items)

    def _step(self, closure: Optional[Callable[[], Any]], num_items):
        window = self._window
        window.check_attached()
        self._members.check_unchanged(self.param_groups, type(self).__name__)
        self._opt_called = True  # (what an LR scheduler's wrapper would record: see below the class)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if num_items is not None and not isinstance(num_items, Tensor):
            check_num_items(num_items)
        window.flush()
        if window.ledger.stepped_in_backward:
            if num_items is not None:
                raise ValueError(
                    "step_in_backward=True already stepped during backward; "
                    "num_items cannot apply (normalise the loss instead)"
                )
            # Parameters unfrozen during the window were not hooked: their gradients are in
            # .grad, natively; they join here and step now (their later windows step in backward).
            self._members.adopt_unfrozen(self)
            ones = {flat.device: flat.one for flat in window.flat_groups}
            window.placement.step_window(window.flat_groups, window.topology, self._stepper, ones, None)
            window.after_step()
            return loss
        if self.step_in_backward and not window.ledger.may_step_in_backward and window.microbatches:
            self._warn_unstarted_window()
        window.reconcile()
        self._take_user_grads()
        window.finish_reduction()
        scale, skip, norm = window_scale(
            window,
            num_items,
            grad_scale=getattr(self, "grad_scale", None),  # (both set by GradScaler.step)
            found_inf=getattr(self, "found_inf", None),
            max_grad_norm=self.max_grad_norm,
            skip_nonfinite=self.skip_nonfinite,
        )
        if norm is not None:
            self._last_norm.value = norm
        if self._generic is not None:
            for flat in window.flat_groups:
                flat.refresh_masters()  # (torch's step does not follow a weight written from outside)
            self._generic.step(self.param_groups, window.slots, self.state, scale, skip)
        else:
            # a speculation (offload's) is the step only without num_items or a GradScaler
            speculable = num_items is None and getattr(self, "grad_scale", None) is None
            speculable = speculable and getattr(self, "found_inf", None) is None
            window.placement.step_window(window.flat_groups, window.topology, self._stepper, scale, skip, speculable)
        window.after_step()
        return loss

    def _warn_unstarted_window(self) -> None:
        if not self._warned_unstarted:
            self._warned_unstarted = True
            warnings.warn(
                "step_in_backward=True: this window began without zero_grad() after the last step(), "
                "so none of its backwards stepped (a backward between step() and zero_grad() may be "
                "another model's: DCGAN's generator loss reaches the discriminator); it steps now, at "
                "step(). Call opt.zero_grad() between windows to step in the last backward.",
                stacklevel=3,
            )

    def _take_user_grads(self) -> None:
        """A ``.grad`` the user assigned (not our view) is the gradient this step uses."""
        self._members.adopt_unfrozen(self)
        window = self._window  # (its nodes rebuilt since were followed by reconcile's look)
        for flat in window.flat_groups:
            param = flat.slots[0].param
            moved = param.device != flat.device or param.dtype != flat.dtype
            if moved or flat.device.type == "meta" and any(s.param.grad is not None for s in flat.slots):
                window.rehome(flat)
        taken = []
        for slot in window.slots:
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                taken.append((slot, window.flat_groups[slot.flat_index].user_grad(slot, grad)))
            elif grad is None and window.topology.stands_aside:
                window.ledger.cleared(slot)  # under DDP .grad is autograd's: None means no gradient
        if taken:
            window.take_user_grads(taken)

    # --- checkpoints (fused_accum.checkpoint; what each holds: docs/optimizer.md, "Checkpoints") --

    def state_dict(self) -> dict:
        """torch's ``{"state", "param_groups"}`` (copies), plus ``master``, ``accum`` and
        ``window_microbatches``."""
        return checkpoint.state_dict(self)

    def gathered_state_dict(self) -> dict:
        """Sharded (``shard=``): :meth:`state_dict` in torch's full shapes, all-gathered (a
        collective: call it on every rank). Without sharding it is :meth:`state_dict`."""
        return checkpoint.gathered_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load our own state_dict, or a plain torch.optim one of the same algorithm (missing keys
        default)."""
        checkpoint.load_state_dict(self, state_dict)

    # --- pickling: rebuild buffers and hooks from the constructor arguments and the state -------

    def __getstate__(self) -> dict:
        if not self._window.topology.picklable:
            raise TypeError(
                "a FusedAccumOptimizer with a process_group cannot be pickled or copied "
                "(a process group cannot); save its state_dict() instead"
            )
        return {"config": self._config, "param_groups": self.param_groups, "state_dict": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        config = dict(state["config"])
        hyper = config.pop("hyperparameters")
        groups = [dict(g) for g in state["param_groups"]]
        for group in groups:
            group.pop("window_microbatches", None)
        FusedAccumOptimizer.__init__(self, groups, **config, **hyper)
        self.load_state_dict(state["state_dict"])

    def __copy__(self) -> "FusedAccumOptimizer":
        """A shallow copy, as torch's: another handle on the same groups, state and window
        (``__getstate__`` would build a second optimizer over the same parameters, which would
        detach this one)."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __repr__(self) -> str:
        algo = self._algorithm or self._generic.cls.__name__
        backends_used = sorted({f.backend for f in self._window.flat_groups})
        return (
            f"FusedAccumOptimizer({algo}, accum_steps={self.accum_steps}, backends={backends_used}, "
            f"groups={len(self.param_groups)}, params={len(self._window.slots)})"
        )


# An LR scheduler wraps ``opt.step`` to record that it was called (``opt._opt_called``, which
# its first step() checks), unless the step says it is wrapped already. Its wrapper is code of
# torch/optim/lr_scheduler.py, which Dynamo skips: a window compiled whole (fused_accum.compiled)
# would break its graph at the step. The step records the call itself (eagerly, and a compiled
# step's books), so it says so.
FusedAccumOptimizer.step._wrapped_by_lr_sched = True
