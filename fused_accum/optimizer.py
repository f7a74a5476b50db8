"""FusedAccumOptimizer: the ``torch.optim`` face of fused gradient accumulation.

This module holds what a user or a trainer sees: param groups and their hyper-parameters,
``step``, ``zero_grad``, ``state`` and ``state_dict``. It does no math and no hook plumbing:

- :mod:`fused_accum.window` takes the gradients (hooks, micro-batch counting, ``.grad``
  exposure, the window's norm and non-finite flag);
- :mod:`fused_accum.flat` holds the fp32 buffers (accumulator, masters, optimizer state);
- :mod:`fused_accum.ops` runs the kernels on the backend each flat group resolved.

Gradients are summed over micro-batches, exactly as plain ``.grad`` accumulation does, and
``.grad`` shows that fp32 sum after every backward: scale the loss yourself (as HF Trainer,
Accelerate and Lightning already do), or pass ``step(num_items=N)`` to divide a summed gradient
by the number of items (e.g. tokens) in the window, the exact large-batch gradient when
micro-batches differ in size.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import backends, ops
from .distributed import SHARD_MODES, ShardSums, WindowReducer
from .flat import LOW_PRECISION, SUPPORTED_DTYPES, FlatGroup, Slot, is_dtensor, padded_offsets  # noqa: F401 (padded_offsets: re-exported)
from .window import GradientWindow

logger = logging.getLogger("fused_accum")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A fused algorithm: its torch.optim-named defaults and the state it keeps per parameter
    (``optional``: kept only when a hyper-parameter asks for it)."""

    defaults: dict
    state_keys: tuple
    has_step: bool  # torch keeps a ``step`` entry in its state


# torch.optim keywords that choose torch's implementation (kept in the param groups, as torch
# keeps them, and otherwise ignored: the implementation here is always ours).
_TORCH_IMPL = dict(foreach=None, differentiable=False, fused=None)
ALGORITHMS = {
    "sgd": Algorithm(
        dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, **_TORCH_IMPL),
        ("momentum_buffer",), False,
    ),
    "adam": Algorithm(
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
             capturable=False, decoupled_weight_decay=False, **_TORCH_IMPL),
        ("exp_avg", "exp_avg_sq"), True,
    ),
    "adamw": Algorithm(
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False,
             capturable=False, decoupled_weight_decay=True, **_TORCH_IMPL),
        ("exp_avg", "exp_avg_sq"), True,
    ),
    "lion": Algorithm(dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False), ("exp_avg",), False),
}  # fmt: skip


def validate_hyperparameters(algorithm: str, h: dict) -> None:
    """torch.optim's checks, in torch's order and with torch's messages (Lion: the same style)."""
    lr = h["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
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
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if h.get("differentiable"):
        raise NotImplementedError("differentiable=True is not supported by fused_accum's optimizers")


def _scalar(value) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


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


class _WeakStepper:
    """What the window calls up into (a stand-in until the step has its own object): the
    optimizer held weakly, so the window keeps no cycle through it."""

    def __init__(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def fused_step(self, *args) -> None:
        self._optimizer()._fused_step(*args)

    def rehome(self, flat) -> None:
        self._optimizer()._rehome(flat)


def _param_label(group_index, j, param, names):
    if names is not None:
        return repr(names[j])
    return f"param_groups[{group_index}]['params'][{j}] (shape {tuple(param.shape)}, {param.dtype})"


class FusedAccumOptimizer(torch.optim.Optimizer):
    """Gradient accumulation into fp32 buffers with a fused optimizer step; a drop-in optimizer.

    Args:
        params: an iterable (or generator) of parameters, of ``(name, parameter)`` pairs, or of
            param-group dicts, as for any ``torch.optim`` optimizer. float32, bfloat16 and
            float16 parameters are supported. A parameter with ``requires_grad=False`` gets its
            buffers when it is first stepped after being unfrozen.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"lion"`` (fused), or any
            ``torch.optim.Optimizer`` subclass, which then steps the fp32 master parameters
            from the fp32 accumulated gradients (the generic path).
        lr and other hyper-parameters: torch.optim's names and defaults for the algorithm
            (``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``momentum``, ``dampening``,
            ``nesterov``, ``maximize``). ``lr`` may be a tensor. They are re-read from
            ``param_groups`` at every step, so schedulers work.
        accum_steps: micro-batches per window, if known: a hint that enables the fusions of
            the window's last backward (its accumulate pass computes the norm and non-finite
            flag; ``step_in_backward``; an overlapped data-parallel reduction). A window of any
            other length steps exactly as torch would.
        master_weights: keep an fp32 master copy of bf16/fp16 parameters (default True). With
            False, low-precision parameters are updated in place (fp32 math, rounded once).
        backend: ``"auto"``, ``"reference"``, ``"triton"``, ``"cpu"`` or ``"cuda"``; see
            :mod:`fused_accum.backends`. ``FUSED_ACCUM_BACKEND`` overrides ``"auto"``.
        bucket_cap_mb: size of the gradient buckets folded by one op call, in MB of fp32.
            Default: 25 (as DDP's), but 0.5 for parameters on the CPU without a process group,
            so that a bucket is folded while its gradients are still in the core's cache
            (chosen by the parameters' device when the optimizer is built; see the README).
        step_in_backward: fuse the last micro-batch with the step (needs ``accum_steps``):
            each bucket of the window's last backward runs accumulate + step in one pass
            (32 instead of 10 + 30 bytes per bf16 parameter for AdamW), and ``step()`` only
            ends the window. The update happens before ``step()`` is called, so it is only for
            loops that neither clip, nor unscale, nor read ``.grad`` (not exposed for stepped
            parameters) between backward and step; normalise the loss (num_items cannot apply).
        max_grad_norm: clip the window's global gradient norm (after ``num_items`` and a
            GradScaler's unscale) to this, as ``clip_grad_norm_`` would, on the device.
        skip_nonfinite: skip the whole update (state, step counts and weights) when any
            accumulated gradient is inf/nan, without a host sync on the fused path.
        process_group: a ``torch.distributed`` group for data parallelism, used instead of
            wrapping the model in DistributedDataParallel: the fp32 accumulators are averaged
            across it at the end of the window (see :meth:`no_sync`), buckets finished during
            that backward while it still runs.
        shard: with ``process_group``, shard the fp32 buffers across it (each rank owns one
            contiguous 1/N part of every bucket of every flat buffer, padded to the same length
            on every rank; buffers are bytes of fp32 per parameter, N ranks, AdamW):

            - ``None`` (default): replicated. acc 4 + master 4 + state 8 = 16 B (no master for
              fp32 params: 12 B); one all-reduce of the accumulator per window.
            - ``"state"`` (ZeRO-1, window-level): the full accumulator per rank, the master and
              optimizer state only for the local part: 4 + 12/N B (fp32 params: 4 + 8/N). At
              the window's end one reduce-scatter per bucket (the buckets of the last backward
              launched while it runs), the fused step on the local part, one all-gather per
              bucket of the updated parameters in their own dtype (a transient buffer of the
              params' size). Wire bytes per window: (4 + param bytes) x (N-1)/N per param,
              against the all-reduce's 8 x (N-1)/N. The window is reduced once: every backward
              but the last must run under ``no_sync()`` unless ``accum_steps`` says which is
              last (with ``accum_steps=None`` and no ``no_sync()``, one backward per step).
            - ``"grads"`` (ZeRO-2): the accumulator is sharded too, 16/N B (fp32 params 12/N):
              every backward reduce-scatters each bucket (in ``reduce_dtype``) and this rank
              folds its part into the 1/N fp32 accumulator; transient: each bucket's fp32
              staging buffer from its first gradient to its reduce-scatter (buckets of
              ``bucket_cap_mb``, launched in order as they complete, the rest at the end of the
              backward). Wire bytes per window: (reduce_dtype bytes x micro-batches + param
              bytes) x (N-1)/N.
              ``no_sync()`` has no effect.

            ``max_grad_norm`` and ``skip_nonfinite`` are global (each rank's part of the sum of
            squares, one all-reduce, no host sync); ``num_items`` is averaged as when
            replicated. ``.grad``: the group's gradient exists only as shards, so once the
            window is reduced (``"state"``: after its last backward; ``"grads"``: after every
            backward) ``.grad`` is a ``fused_accum.window.ShardedGrad`` placeholder whose every
            use, ``clip_grad_norm_`` included, raises an error pointing to ``max_grad_norm``;
            before that (``"state"``) it is the local running sum, and after ``step()`` None:
            the window ends with the step. A GradScaler needs ``.grad`` and cannot be used:
            use ``skip_nonfinite`` (bf16 needs no scaler). Checkpoints: ``opt.state[p]`` holds
            this rank's 1-D piece of each parameter's state (possibly empty) with torch's key
            names; ``state_dict()`` holds each piece as this rank's row of a DTensor of shape
            (world, longest piece) over the group (rows: the ranks' pieces differ in length),
            and no accumulated gradient (take it at window boundaries). ``load_state_dict``
            takes one saved by the same rank of the same layout (world size, params,
            ``bucket_cap_mb``), and so do ``torch.distributed.checkpoint``'s ``dcp.save`` /
            ``dcp.load`` (every rank's rows are stored) with ``get_optimizer_state_dict`` /
            ``set_optimizer_state_dict``. To change the world size use
            :meth:`gathered_state_dict` (a collective: torch's full shapes on every rank),
            saved with ``torch.save`` or ``dcp.save`` from the ranks; any optimizer over the
            same params loads it with ``load_state_dict`` (sharded: each rank cuts its piece),
            and so does a sharded one a torch-shaped state dict of an unsharded optimizer.
            Needs a fused algorithm.
        reduce_dtype: ``shard="grads"``: the dtype of the per-backward reduce-scatter
            (``torch.float32`` by default: exact sums; ``torch.bfloat16`` halves the traffic
            and rounds each micro-batch's gradient, and the partial sums of the collective,
            to bf16 before the fp32 accumulation).

    FSDP2 (``fully_shard``): build the optimizer after ``fully_shard``, over its DTensor
    parameters, without ``process_group``/``shard``. FSDP2 reduce-scatters each micro-batch into
    the sharded parameter's ``.grad``; the window then shows an fp32 DTensor over the
    parameter's slice of the accumulator as ``.grad``, into which FSDP2 adds the later
    micro-batches (fp32 sums whatever the parameter's dtype; under
    ``set_requires_gradient_sync(False)`` FSDP2 sums unsharded, in its ``reduce_dtype``, and
    hands over once). The buffers cover the local shards only: fp32 masters and state per rank,
    updated in place in FSDP2's sharded storage.
    ``max_grad_norm``/``skip_nonfinite`` are global over the mesh; ``opt.state`` and
    ``state_dict()`` hold DTensors, as torch.optim's do on FSDP2.

    ``step()`` does not clear ``.grad``, as torch's optimizers do not: call ``zero_grad()``
    to start the next window (every trainer does).
    """

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's flag for "step() takes GradScaler's grad_scale and found_inf": True when
        torch.amp.GradScaler asks (the unscale folds into the step's coefficient and an inf skips
        the step on the device: no unscale pass, no host sync). Anyone else reads False: Lightning
        reads the flag as "this optimizer cannot be clipped" and refuses gradient_clip_val for
        it, even under bf16-mixed where there is no scaler; with False its fp16 path unscales
        .grad first (then clips) and GradScaler.step still hands the step found_inf."""
        return sys._getframe(1).f_globals.get("__name__") == "torch.amp.grad_scaler"

    def __init__(
        self,
        params: Iterable,
        optimizer: Union[str, type] = "adamw",
        *,
        accum_steps: Optional[int] = None,
        master_weights: Optional[bool] = None,
        backend: str = "auto",
        bucket_cap_mb: Optional[float] = None,
        step_in_backward: bool = False,
        max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = False,
        process_group=None,
        shard: Optional[str] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        **hyperparameters: Any,
    ):
        if accum_steps is not None and (not isinstance(accum_steps, int) or accum_steps < 1):
            raise ValueError(f"accum_steps must be a positive int or None, got {accum_steps!r}")
        if backend != "auto" and backend not in backends.NAMES:
            raise ValueError(f"backend must be 'auto' or one of {backends.NAMES}, got {backend!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if step_in_backward and accum_steps is None:
            raise ValueError("step_in_backward=True needs accum_steps: the last micro-batch must be known")
        if step_in_backward and (max_grad_norm is not None or skip_nonfinite):
            raise ValueError("step_in_backward=True steps before the window's norm is known: "
                             "it cannot be combined with max_grad_norm or skip_nonfinite")
        if step_in_backward and process_group is not None:
            raise ValueError("step_in_backward=True steps before the window is reduced across "
                             "process_group: they cannot be combined")
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
        if shard is not None and process_group is None:
            raise ValueError(f"shard={shard!r} needs a process_group to shard across")
        if shard is not None and not isinstance(optimizer, str):
            raise ValueError("shard= needs a fused algorithm (sgd, adam, adamw, lion): a torch.optim "
                             "class steps whole parameters")  # fmt: skip
        if reduce_dtype is not None and shard != "grads":
            raise ValueError("reduce_dtype= applies to shard='grads' only (the window-level "
                             "reductions are fp32)")  # fmt: skip
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        if step_in_backward and not isinstance(optimizer, str):
            raise ValueError("step_in_backward=True needs a fused algorithm (sgd, adam, adamw, lion)")
        self._algorithm, self._generic_class, defaults = self._parse_algorithm(optimizer, hyperparameters)
        self._config = dict(
            optimizer=optimizer, accum_steps=accum_steps, master_weights=master_weights,
            backend=backend, bucket_cap_mb=bucket_cap_mb, step_in_backward=step_in_backward,
            max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, process_group=process_group,
            shard=shard, reduce_dtype=reduce_dtype, hyperparameters=dict(hyperparameters),
        )  # fmt: skip
        self.accum_steps = accum_steps
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.last_grad_norm: Optional[Tensor] = None  # the last window's norm, when computed
        self._master_weights = True if master_weights is None else bool(master_weights)
        self._backend_request = backend
        self._bucket_cap_mb = bucket_cap_mb
        reducer = WindowReducer(process_group, shard, reduce_dtype) if process_group is not None else None
        self._window = GradientWindow(
            accum_steps=accum_steps, step_in_backward=step_in_backward,
            wants_stats=max_grad_norm is not None or skip_nonfinite, reducer=reducer,
            stepper=_WeakStepper(self), label=f"{type(self).__name__} at {id(self):#x}",
        )  # fmt: skip
        self._frozen: list = []  # (param, group index, label): no buffers until unfrozen
        self._inner: Optional[torch.optim.Optimizer] = None  # the generic path's optimizer
        self._generic_params: dict = {}  # id(param) -> what the inner optimizer steps
        self._shard_sums: Optional[ShardSums] = None  # DTensor params: sums the window's stats over the mesh
        self._attached = False
        self._shown_state: dict = {}  # slot key -> the StateEntry last put in opt.state
        super().__init__(params, defaults)
        # All-or-nothing: hooks go on (and older optimizers over these parameters are
        # detached) only once every group has been accepted.
        self._window.attach(self._window.slots)
        self._attached = True

    # --- construction ----------------------------------------------------------------------

    @staticmethod
    def _parse_algorithm(optimizer, hyperparameters):
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer= takes an optimizer class (e.g. torch.optim.RMSprop) or a name, "
                            f"not an instance of {type(optimizer).__name__}")  # fmt: skip
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if issubclass(optimizer, FusedAccumOptimizer):
                raise TypeError("optimizer= cannot be a FusedAccumOptimizer class")
            return None, optimizer, dict(hyperparameters)
        if not isinstance(optimizer, str) or optimizer.lower() not in ALGORITHMS:
            raise ValueError(f"optimizer must be one of {sorted(ALGORITHMS)} or a torch.optim.Optimizer "
                             f"subclass, got {optimizer!r}")  # fmt: skip
        name = optimizer.lower()
        defaults = dict(ALGORITHMS[name].defaults)
        for key, value in hyperparameters.items():
            if key not in defaults:
                raise TypeError(f"unexpected keyword {key!r} for optimizer {name!r}; expected one of {sorted(defaults)}")
            defaults[key] = value
        validate_hyperparameters(name, defaults)
        return name, None, defaults

    def add_param_group(self, param_group: dict) -> None:
        """Add a group as torch.optim does (generators, names, the same errors), then give its
        parameters buffers and, once the optimizer is built, hooks. All or nothing."""
        super().add_param_group(param_group)
        try:
            self._build_group(len(self.param_groups) - 1)
        except BaseException:
            self.param_groups.pop()
            raise

    def _build_group(self, group_index: int) -> None:
        group = self.param_groups[group_index]
        if self._algorithm is not None:
            validate_hyperparameters(self._algorithm, group)
        names = group.get("param_names")
        seen, trainable = set(), []
        for j, p in enumerate(group["params"]):
            if id(p) in seen:  # torch warned about the duplicate; it is trained once
                continue
            seen.add(id(p))
            label = _param_label(group_index, j, p, names)
            if p.requires_grad:
                trainable.append((p, label))
            else:  # any dtype: an integer counter kept in a group is never trained
                self._frozen.append((p, group_index, label))
        self._make_flat_groups(group_index, trainable)

    def _bucket_numel(self, device: torch.device) -> int:
        """Elements per bucket for parameters on ``device`` (see ``bucket_cap_mb``)."""
        cap = self._bucket_cap_mb
        if cap is None:
            # On a CPU the fold reads the bucket's gradients back: at 0.5 MB they are still in
            # the core's L2 cache (GPT-2 layout, d = 64, window_phases: a window's backwards
            # 1-2 ms faster than with 25 MB). Data-parallel buckets keep DDP's size: each is a
            # collective, and sharded checkpoints are laid out by them.
            cap = 0.5 if device.type == "cpu" and self._window.reducer is None else 25.0
        return max(1, int(cap * 2**20 / 4))

    def _make_flat_groups(self, group_index: int, members: list) -> list:
        """Buffers for ``members`` ((param, label) pairs of one param group), one flat group per
        (device, dtype); hooks too once the optimizer is built. Returns the new slots."""
        group = self.param_groups[group_index]
        by_key: dict = {}
        for p, label in members:
            if p.is_complex() or not p.is_floating_point() or p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"parameter {label} has dtype {p.dtype}; supported: float32, bfloat16, float16")
            by_key.setdefault((p.device, p.dtype), []).append((p, label))
        resolved = {key: backends.resolve(self._backend_request, key[0]) for key in by_key}  # may raise: before any buffer
        window, new_slots = self._window, []
        for (device, dtype), pairs in by_key.items():
            flat = FlatGroup(
                len(window.flat_groups), group_index, [p for p, _ in pairs], [l for _, l in pairs],
                len(window.slots), dtype, device, self._state_keys(group), self._master_weights,
                resolved[(device, dtype)], self._bucket_numel(device),
                window.reducer.sharding if window.reducer is not None else None,
            )  # fmt: skip
            window.add(flat)
            new_slots.extend(flat.slots)
        if any(is_dtensor(s.param) for s in new_slots):
            self._adopt_dtensors()
        if self._generic_class is not None:
            self._add_generic_params(group, group_index, new_slots)
        if self._attached:
            window.attach(new_slots)
        return new_slots

    def _adopt_dtensors(self) -> None:
        """DTensor parameters (FSDP2's ``fully_shard``): FSDP2 reduce-scatters every micro-batch's
        gradient into the sharded parameter's ``.grad``, so the window's autograd hooks stand
        aside, as under DDP; its FSDP2 hook (``GradientWindow._fsdp_grad``) keeps ``.grad`` an
        fp32 DTensor over the accumulator, and the step takes ``.grad`` as it finds it.
        Decided now rather than at the first backward: a step may come first (torch.distributed.
        checkpoint's ``set_optimizer_state_dict`` steps with zero gradients to make state)."""
        if self._config["process_group"] is not None:
            raise ValueError("the parameters are DTensors (FSDP2's fully_shard or tensor parallelism), "
                             "whose gradients FSDP2 reduces: process_group= and shard= cannot be added")  # fmt: skip
        if self._generic_class is not None:
            raise ValueError(f"optimizer={self._generic_class.__name__} cannot step DTensor parameters "
                             "(it would see local shards as whole parameters); use a fused algorithm "
                             "(sgd, adam, adamw, lion)")  # fmt: skip
        # ddp_wrapping says yes for DTensor params, without walking the garbage collector
        if not self._window._check_native():
            raise ValueError("DTensor parameters cannot join an optimizer whose plain parameters "
                             "already took gradients through its hooks")  # fmt: skip
        if self.max_grad_norm is not None or self.skip_nonfinite:
            self._shard_sums = ShardSums(s.param for s in self._window.slots)

    def _state_keys(self, group) -> tuple:
        if self._algorithm is None:
            return ()
        keys = ALGORITHMS[self._algorithm].state_keys
        if self._algorithm == "sgd" and group["momentum"] == 0:
            return ()  # no buffer without momentum (allocated if momentum is turned on later)
        if self._algorithm in ("adam", "adamw") and group["amsgrad"]:
            keys = keys + ("max_exp_avg_sq",)
        return keys

    def _add_generic_params(self, group, group_index, slots):
        inner_params = []
        for slot in slots:
            p = slot.param
            target = p if slot.master is None else torch.nn.Parameter(slot.master.view(p.shape))
            self._generic_params[id(p)] = target
            inner_params.append(target)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        try:
            if self._inner is None:
                self._inner = self._generic_class([dict(params=inner_params, **hyper)])
                self._inner._fused_accum_inner = True  # ours: its steps take nothing over (window.py)
            elif len(self._inner.param_groups) > group_index:  # an unfrozen parameter joins its group
                self._inner.param_groups[group_index]["params"].extend(inner_params)
            else:
                self._inner.add_param_group(dict(params=inner_params, **hyper))
        except TypeError as err:
            raise TypeError(f"{self._generic_class.__name__} rejected param_groups[{group_index}]: {err}") from err

    def _adopt_unfrozen(self) -> None:
        """Give buffers and hooks to parameters frozen when added and trainable now (gradual
        unfreezing). Their first window was accumulated natively in ``.grad``: taken as is."""
        ready = [entry for entry in self._frozen if entry[0].requires_grad]
        if not ready:
            return
        self._frozen = [entry for entry in self._frozen if not entry[0].requires_grad]
        by_group: dict = {}
        for p, group_index, label in ready:
            by_group.setdefault(group_index, []).append((p, label))
        for group_index, members in by_group.items():
            for slot in self._make_flat_groups(group_index, members):
                if slot.param.grad is not None:
                    self._window.take_user_grad(slot, slot.param.grad)

    def remove_hooks(self) -> None:
        """Stop folding gradients (autograd fills ``.grad`` natively again); the optimizer can
        no longer step. Building a new optimizer over the parameters does this implicitly."""
        self._window.detach("remove_hooks() was called")

    # --- the window, as the user drives it ----------------------------------------------------

    @property
    def microbatches(self) -> int:
        """Backward passes folded since the last step (each ``backward()`` that reaches a
        parameter counts once: two backward calls per micro-batch count twice)."""
        self._window.reconcile()
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
        return self._window.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the window. ``set_to_none=True`` (default): every ``.grad`` becomes None and
        the next gradient of each slice overwrites it, with no zeroing pass. ``False``: the
        exposed gradients are zeroed in place and stay exposed, as in torch."""
        window = self._window
        if not window.native:
            window.follow_moved_params()
        if set_to_none or window.reducer is not None and window.reducer.sharding is not None:
            window.discard()  # (sharded: no full gradient to zero and show)
        else:
            window.flush()
            window.reconcile()
            for slot in window.slots:
                if slot.has_grad:
                    slot.acc.zero_()
            window.invalidate_stats()
            window.after_step()
            window.expose()
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
        """Apply one update from the accumulated gradients.

        ``num_items``: divide the summed gradient by this (an int, float or device tensor, e.g.
        the window's token count for a sum-reduced loss), without a host sync. A tensor that
        is zero, negative or non-finite skips the step.
        """
        window = self._window
        window.check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if num_items is not None and not isinstance(num_items, Tensor):
            if not (num_items > 0 and math.isfinite(num_items)):
                raise ValueError(f"num_items must be positive and finite, got {num_items!r}")
        window.flush()
        if window.stepped_in_backward:
            if num_items is not None:
                raise ValueError("step_in_backward=True already stepped during backward; "
                                 "num_items cannot apply (normalise the loss instead)")
            # Parameters unfrozen during the window were not hooked: their gradients are in
            # .grad, natively; they join here and step now (their later windows step in backward).
            self._adopt_unfrozen()
            for flat in window.flat_groups:
                self._fused_step(flat, [s for s in flat.slots if s.has_grad], flat.one)
                flat.masters_written()
            window.after_step()
            window.expose()
            return loss
        window.reconcile()
        self._take_user_grads()
        window.finish_reduction()
        scale, skip = self._window_scale(num_items)
        for flat in window.flat_groups:
            flat.refresh_masters()  # the user may have written the params since the last step
        if self._inner is not None:
            self._generic_step(scale, skip)
        else:
            sharded = window.reducer is not None and window.reducer.sharding is not None
            for flat in window.flat_groups:
                active = [s for s in flat.slots if s.has_grad]
                if sharded and active:
                    flat.begin_step()  # stage this rank's pieces of the params
                self._fused_step(flat, active, scale[flat.device], skip[flat.device] if skip else None)
            if sharded:
                window.reducer.gather_params(window.flat_groups)  # the updated params, to every rank
        for flat in window.flat_groups:
            flat.masters_written()
        window.after_step()
        window.expose()
        return loss

    def _rehome(self, flat: FlatGroup) -> None:
        """Move ``flat``'s buffers to where its parameters now are (a model moved, or
        materialised with ``to_empty``, after the optimizer was built)."""
        device = flat.slots[0].param.device
        if device.type == "meta":
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported "
                               "devices: fused_accum always fuses, and these parameters are on the meta device; "
                               "materialise the model (to_empty() or to()) before stepping")  # fmt: skip
        flat.rehome(device, backends.resolve(self._backend_request, device))
        group = self.param_groups[flat.group_index]
        for slot in flat.slots:
            if self.state.get(slot.param):
                self._show_state(slot, group)

    def _take_user_grads(self) -> None:
        """A ``.grad`` the user assigned (not our view) is the gradient this step uses."""
        self._adopt_unfrozen()
        window = self._window
        window.follow_moved_params()
        for flat in window.flat_groups:
            param = flat.slots[0].param
            moved = param.device != flat.device or param.dtype != flat.dtype
            if moved or flat.device.type == "meta" and any(s.param.grad is not None for s in flat.slots):
                self._rehome(flat)
        for slot in window.slots:
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                window.take_user_grad(slot, window.flat_groups[slot.flat_index].local_grad(slot, grad))
            elif grad is None and window.native:
                slot.has_grad = False  # under DDP .grad is autograd's: None means no gradient

    def _window_scale(self, num_items) -> tuple:
        """(coef per device, skip flag per device or None), computed on the device without a
        host sync: 1/num_items x 1/grad_scale x the clip factor; skip when num_items is not
        positive and finite, when GradScaler found an inf, or (skip_nonfinite) when the
        window's gradient has one."""
        window = self._window
        devices = list(dict.fromkeys(flat.device for flat in window.flat_groups))
        if not devices:
            return {}, None
        home = devices[0]
        fp32 = dict(dtype=torch.float32, device=home)
        coef = torch.ones((), **fp32)
        bad = None  # a 0-d fp32 flag on home: 1 skips the step
        if num_items is not None:
            items = torch.empty((), **fp32)
            if isinstance(num_items, Tensor):
                items.copy_(num_items.detach().reshape(()))
            else:
                items.fill_(float(num_items))
            if window.reducer is not None:  # gradients are the group's mean: so the counts
                window.reducer.average_(items)
            bad = (~((items > 0) & torch.isfinite(items))).float()
            coef = coef / items
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step
        if grad_scale is not None:
            coef = coef / grad_scale.to(home)
        found_inf = getattr(self, "found_inf", None)
        if isinstance(found_inf, Tensor):
            flag = (found_inf.to(home) > 0).float()
            bad = flag if bad is None else torch.maximum(bad, flag)
            if grad_scale is None:
                # GradScaler passes no scale after its unscale_(opt), which divided .grad in place
                # with an op that leaves the version counter alone (torch 2.13's
                # _amp_foreach_non_finite_check_and_unscale_): the last pass's norm is stale.
                window.invalidate_stats()
        if self.max_grad_norm is not None or self.skip_nonfinite:
            stats = window.complete_stats()
            total = sum(sumsq.to(home) for _, sumsq in stats.values())
            any_inf = sum(flag.to(home) for flag, _ in stats.values())
            if self._shard_sums is not None:  # DTensor params: the stats of local shards
                both = self._shard_sums.sum_(torch.stack([total, any_inf]))
                total, any_inf = both[0], both[1]
            # inf/nan anywhere makes the sum of squares non-finite too
            nonfinite = torch.maximum(any_inf.clamp(max=1), (~torch.isfinite(total)).float())
            norm = total.sqrt() * coef
            self.last_grad_norm = norm
            if self.max_grad_norm is not None:
                coef = coef * (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
            if self.skip_nonfinite:
                bad = nonfinite if bad is None else torch.maximum(bad, nonfinite)
        scale = {d: coef.to(d) for d in devices}
        skip = {d: bad.to(d) for d in devices} if bad is not None else None
        return scale, skip

    @torch.no_grad()  # (also when a backward steps: step_in_backward, create_graph=True)
    def _fused_step(self, flat: FlatGroup, active: list, coef: Tensor, found_inf=None, grads=(),
                    grads_overwrite=False) -> None:  # fmt: skip
        """One step-op call for ``active`` slots; with ``grads``, also their last micro-batch."""
        if not active:
            return
        group = self.param_groups[flat.group_index]
        lr = group["lr"]
        if isinstance(lr, Tensor):
            # device to device: no host sync, capturable; an fp32 lr is exact in float64
            flat.lr.copy_(lr.detach().reshape(()))
        else:
            flat.lr.fill_(float(lr))  # float64: every bit of the Python float, as torch takes it
        if coef is not flat.coef:
            flat.coef.copy_(coef)
        self._take_user_state(flat, active, group)
        # A skipped step does not count (as torch's GradScaler skips the step call itself).
        increment = flat.one if found_inf is None else 1 - found_inf
        if len(active) == len(flat.slots):
            flat.steps.add_(increment)
            steps = flat.steps
        else:
            index = flat.active_index(tuple(s.index for s in active))
            flat.steps.index_add_(0, index, increment.expand(len(active)))
            steps = flat.steps.index_select(0, index)
        held, accs, params, lp_params = flat.step_lists(active)  # sharded: this rank's pieces
        if held is not active:
            if not held:
                return
            index = flat.active_index(tuple(s.index for s in held))
            steps = flat.steps.index_select(0, index)
            active = held
        common = (steps, flat.lr, flat.coef)
        tail = (lp_params, list(grads), 1.0, grads_overwrite, found_inf, flat.backend)
        # The Triton backend's launch-plan key (ops plan=): these lists are views at fixed places
        # of this flat group's buffers; what changes their layout (the active set, the lists
        # passed) is in the key.
        everyone = len(active) == len(flat.slots)
        layout = (None if everyone else tuple(s.index for s in active), len(grads), grads_overwrite)
        if self._algorithm == "sgd":
            momentum = group["momentum"]
            bufs = [s.state["momentum_buffer"] for s in active] if momentum != 0 else []
            ops.sgd_step(params, bufs, accs, *common, momentum, group["dampening"],
                         group["weight_decay"], group["nesterov"], group["maximize"], *tail,
                         plan=(flat.plan, layout, bool(bufs)))  # fmt: skip
            return
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        exp_avgs = [s.state["exp_avg"] for s in active]
        if self._algorithm in ("adam", "adamw"):
            maxes = [s.state["max_exp_avg_sq"] for s in active] if group["amsgrad"] else []
            ops.adam_step(params, exp_avgs, [s.state["exp_avg_sq"] for s in active], maxes, accs, *common,
                          beta1, beta2, group["eps"], group["weight_decay"], self._algorithm == "adamw",
                          group["maximize"], *tail, plan=(flat.plan, layout, bool(maxes)))  # fmt: skip
        else:
            ops.lion_step(params, exp_avgs, accs, *common, beta1, beta2, group["weight_decay"],
                          group["maximize"], *tail, plan=(flat.plan, layout))  # fmt: skip

    def _take_user_state(self, flat: FlatGroup, active: list, group) -> None:
        """Before a step: allocate state turned on since the last one, and take what the user
        did to ``opt.state`` (an entry deleted, cleared or replaced by ``{}`` starts afresh, as
        torch's would; tensors assigned into it become the state) before the kernels read the
        buffers. Step counts change here, before the step adds to them."""
        for key in self._state_keys(group):
            if flat.ensure_state(key):
                if key == "momentum_buffer":
                    # torch's buffer starts as a copy of the gradient at its first step with
                    # momentum (the kernels' first step: a step count of 1), not at the first step.
                    flat.steps.zero_()
                for slot in flat.slots:  # show the new buffer too
                    if self._shown_state.get(slot.key) is not None:
                        self._show_state(slot, group)
        if not (flat.state or ALGORITHMS[self._algorithm].has_step):
            return  # torch keeps no entry without state
        shown = self._shown_state
        for slot in active:
            entry = self.state.get(slot.param)
            mine = shown.get(slot.key)
            if entry is not None and entry is mine and not entry.edited:
                continue
            if mine is not None or entry:  # (no entry yet and none shown: the slot's first step)
                self._load_slot_state(slot, dict(entry or {}))
            self._show_state(slot, group)

    def _show_state(self, slot: Slot, group) -> None:
        entry = self._state_views(slot, group)
        self.state[slot.param] = entry
        self._shown_state[slot.key] = entry

    def _state_views(self, slot: Slot, group) -> dict:
        """``opt.state[p]``: torch's state names, as fp32 views of the flat buffers (in-place
        edits go through)."""
        views = StateEntry()
        if ALGORITHMS[self._algorithm].has_step:
            views["step"] = self._window.flat_groups[slot.flat_index].steps[slot.index]
        for key in self._state_keys(group):
            views[key] = self._window.flat_groups[slot.flat_index].state_view(slot, slot.state[key])
        return views

    def _generic_step(self, scale, skip) -> None:
        if skip is not None and any(bool(f.item()) for f in skip.values()):
            return  # torch optimizers cannot skip on the device: this path syncs once
        for group, inner_group in zip(self.param_groups, self._inner.param_groups):
            for key, value in group.items():  # schedulers write our groups; mirror them
                if key not in ("params", "param_names"):
                    inner_group[key] = value
        saved_grads = {}
        window = self._window
        for slot in window.slots:
            p, target = slot.param, self._generic_params[id(slot.param)]
            saved_grads[slot.key] = p.grad
            if not slot.has_grad:
                target.grad = None
                continue
            # Scaled into a copy: the exposed .grad keeps the sum, as torch leaves .grad alone.
            grad = slot.grad_view * scale[slot.acc.device]
            # torch optimizers want .grad in the param's dtype: a bf16 param without a master
            # gets the fp32 sum rounded once, at the end of the window.
            target.grad = grad if target.dtype == torch.float32 else grad.to(target.dtype)
        self._inner.step()
        for slot in window.slots:
            p, target = slot.param, self._generic_params[id(slot.param)]
            if target is not p:
                target.grad = None
                if slot.has_grad:
                    p.detach().copy_(target.detach())
            p.grad = saved_grads[slot.key]
            if target in self._inner.state:
                self.state[p] = self._inner.state[target]

    # --- state_dict -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's ``{"state", "param_groups"}`` with per-parameter tensors only (copies).

        Each stepped parameter's entry holds its optimizer state (torch's key names),
        ``master`` (fp32 copy of a low-precision parameter) and, when the window has a gradient
        for it, ``accum`` (the fp32 accumulated gradient). Each param group also records
        ``window_microbatches``, so a checkpoint taken mid-window resumes exactly. The four
        kinds of state-dict hooks run as in torch.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        window = self._window
        window.flush()
        window.reconcile()
        for flat in window.flat_groups:
            flat.refresh_masters()  # a checkpoint holds the weights the model has now
        index_of, groups, start = {}, [], 0
        for group in self.param_groups:  # torch's numbering: by position, a duplicate keeps its first
            packed = {k: v for k, v in group.items() if k != "params"}
            for i, p in enumerate(group["params"], start):
                index_of.setdefault(id(p), i)
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            packed["window_microbatches"] = window.microbatches
            start += len(group["params"])
            groups.append(packed)
        state = {}
        for key, entry in self.state.items():
            if not isinstance(key, Tensor):  # put there by a hook or a subclass: kept as is, as torch does
                state[key] = entry
            elif id(key) in index_of:
                state[index_of[id(key)]] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
        for slot in window.slots:
            p = slot.param
            if slot.master is None and not slot.has_grad:
                continue
            entry = state.setdefault(index_of[id(p)], {})
            if slot.master is not None:
                entry["master"] = window.flat_groups[slot.flat_index].state_view(slot, slot.master).clone()
            # (sharded: the local sum. DTensor params: the window's gradient is the .grad FSDP2
            # adds into, which a checkpoint does not hold, as with torch.optim)
            if slot.has_grad and slot.grad_view is not slot.placeholder and not is_dtensor(p):
                entry["accum"] = slot.grad_view.clone()
        if window.reducer is not None and window.reducer.sharding is not None:
            # each rank's pieces as rows of DTensors, so torch.distributed.checkpoint keeps them all
            for slot in window.slots:
                entry = state.get(index_of[id(slot.param)], {})
                for key, value in entry.items():
                    if key != "accum" and isinstance(value, Tensor) and value.dim() == 1:
                        entry[key] = window.reducer.state_rows(window.flat_groups[slot.flat_index], slot, value)
        state_dict = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def gathered_state_dict(self) -> dict:
        """Sharded (``shard=``): :meth:`state_dict` with every per-parameter tensor whole, in
        torch's shape, all-gathered from the ranks' pieces: a collective (call it on every rank;
        each gets the same dict and holds the whole state transiently). Save it from one rank;
        :meth:`load_state_dict` of an unsharded optimizer, or of a sharded one of any world size
        and ``bucket_cap_mb``, loads it (each rank keeps its piece). Without sharding it is
        :meth:`state_dict`. Take it at a window boundary: a sharded state dict holds no
        accumulated gradient."""
        state_dict = self.state_dict()
        window = self._window
        if window.reducer is None or window.reducer.sharding is None:
            return state_dict
        index_of, start = {}, 0
        for group in self.param_groups:
            for i, p in enumerate(group["params"], start):
                index_of.setdefault(id(p), i)
            start += len(group["params"])
        for flat in window.flat_groups:  # the same flat groups and keys, in the same order, on every rank
            buffers = dict(sorted(flat.state.items()))
            if flat.master is not None:
                buffers["master"] = flat.master
            for key, buf in buffers.items():
                full = window.reducer.gather_full(flat, buf)
                for slot in flat.slots:
                    entry = state_dict["state"].get(index_of[id(slot.param)])
                    if entry is not None and key in entry:
                        p = slot.param
                        entry[key] = full[slot.offset : slot.offset + p.numel()].view(p.shape).clone()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load our own state_dict, or a plain torch SGD/Adam/AdamW one (missing keys default).

        Everything is restored in fp32, whatever dtype the saved tensors or the parameters
        have (torch's own loader would cast state to the parameter's dtype). Sharded: a
        tensor with the parameter's number of elements (torch's, an unsharded optimizer's, or
        :meth:`gathered_state_dict`'s) is cut to this rank's piece; any other is taken as this
        rank's piece (the same rank's :meth:`state_dict`, same world size and layout). The four kinds of
        state-dict hooks run as in torch; saved ``param_names`` are kept.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        window = self._window
        window.discard()
        self.state.clear()
        id_to_param = {}
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key not in ("params", "window_microbatches"):
                    group[key] = value
            id_to_param.update(zip(saved["params"], group["params"]))
        window.microbatches = int(saved_groups[0].get("window_microbatches", 0)) if saved_groups else 0
        saved_state = state_dict["state"]
        for pid, p in id_to_param.items():
            slot = window.slot_for(p)
            if slot is not None and pid in saved_state:
                self._load_param_state(slot, saved_state[pid])
        for key, value in saved_state.items():
            if key not in id_to_param:  # not a parameter's: kept as is, as torch does
                self.state[key] = value
        for flat in window.flat_groups:
            flat.masters_written()  # the masters are the checkpoint's now
        window.expose()  # the gradients the checkpoint held show in .grad, as they did when saved
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_param_state(self, slot: Slot, entry: dict) -> None:
        p = slot.param
        flat = self._window.flat_groups[slot.flat_index]

        def fp32(value):  # (sharded: this rank's piece of a whole parameter's value; DTensor: its local shard)
            value = flat.local_value(slot, value.detach())
            return flat.piece_of(slot, value.to(device=flat.device, dtype=torch.float32).reshape(-1))

        if slot.master is not None:
            slot.master.copy_(fp32(entry["master"]) if "master" in entry else flat.param_piece(slot))
        if "accum" in entry:
            slot.acc.copy_(fp32(entry["accum"]))
            slot.has_grad = True
        state = {k: v for k, v in entry.items() if k not in ("master", "accum")}
        if self._inner is not None:
            target = self._generic_params[id(p)]
            self._inner.state[target] = {
                k: (v.detach().to(target.device).clone() if isinstance(v, Tensor) and v.dim() > 0 else v)
                for k, v in state.items()
            }  # fmt: skip
            self.state[p] = self._inner.state[target]
            return
        if state:
            self._load_slot_state(slot, state)

    def _load_slot_state(self, slot: Slot, state: dict) -> None:
        """One slot's optimizer state from torch-named values (a missing one starts at zero, and
        an empty ``state`` at step 0, as torch's would), shown in ``opt.state``."""
        flat = self._window.flat_groups[slot.flat_index]

        def fp32(value):  # (sharded: this rank's piece of a whole parameter's value; DTensor: its local shard)
            value = flat.local_value(slot, value.detach())
            return flat.piece_of(slot, value.to(device=flat.device, dtype=torch.float32).reshape(-1))

        group = self.param_groups[flat.group_index]
        for key in self._state_keys(group):
            flat.ensure_state(key)
        # torch's SGD saves no step: a saved momentum buffer means at least one step was taken
        # (else the next step would re-initialise the buffer from the gradient).
        has_state = any(state.get(key) is not None for key in slot.state)
        step = state.get("step", 1.0 if has_state else 0.0)
        flat.steps[slot.index] = _scalar(step)
        for key, view in slot.state.items():
            value = state.get(key)
            if value is None:  # missing (or torch SGD's momentum_buffer=None): defaults to zero
                view.zero_()
            else:
                view.copy_(fp32(value))
        self._show_state(slot, group)

    # --- pickling: rebuild buffers and hooks from the constructor arguments and the state -------

    def __getstate__(self) -> dict:
        if self._window.reducer is not None:
            raise TypeError("a FusedAccumOptimizer with a process_group cannot be pickled or copied "
                            "(a process group cannot); save its state_dict() instead")  # fmt: skip
        return {"config": self._config, "param_groups": self.param_groups, "state_dict": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        config = dict(state["config"])
        hyper = config.pop("hyperparameters")
        groups = [dict(g) for g in state["param_groups"]]
        for group in groups:
            group.pop("window_microbatches", None)
        FusedAccumOptimizer.__init__(self, groups, **config, **hyper)
        self.load_state_dict(state["state_dict"])

    def __repr__(self) -> str:
        algo = self._algorithm or self._generic_class.__name__
        backends_used = sorted({f.backend for f in self._window.flat_groups})
        return (f"FusedAccumOptimizer({algo}, accum_steps={self.accum_steps}, backends={backends_used}, "
                f"groups={len(self.param_groups)}, params={len(self._window.slots)})")  # fmt: skip


_ACCUMULATION_DOC = """
    Accumulation keywords (keyword-only), as for :class:`FusedAccumOptimizer`: ``accum_steps``,
    ``master_weights``, ``backend``, ``bucket_cap_mb``, ``step_in_backward``, ``max_grad_norm``,
    ``skip_nonfinite``, ``process_group``. ``foreach``, ``fused`` and ``capturable`` choose
    torch's implementation: kept in the param groups and otherwise ignored.
"""


class SGD(FusedAccumOptimizer):
    __doc__ = "torch.optim.SGD's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, **accumulation):
        super().__init__(params, "sgd", lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
                         differentiable=differentiable, fused=fused, **accumulation)


class Adam(FusedAccumOptimizer):
    __doc__ = "torch.optim.Adam's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, **accumulation):
        name = "adamw" if decoupled_weight_decay or self._name == "adamw" else "adam"
        super().__init__(params, name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                         differentiable=differentiable, fused=fused, **accumulation)


class AdamW(Adam):
    __doc__ = "torch.optim.AdamW's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 **accumulation):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused, **accumulation)


class Lion(FusedAccumOptimizer):
    __doc__ = "Lion (Chen et al. 2023), fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **accumulation):
        super().__init__(params, "lion", lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                         **accumulation)
