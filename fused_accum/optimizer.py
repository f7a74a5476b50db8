"""FusedAccumOptimizer: gradient accumulation into persistent fp32 buffers, then a fused step.

This class is bookkeeping only (param groups, hooks, micro-batch counting, state_dict); the math
lives in the ops (:mod:`fused_accum.ops`) and their backends.

Life of a window (k micro-batches, one optimizer step):

1. Each parameter owns an aligned slice of a flat fp32 accumulator, one buffer per
   (param group, device, param dtype): a :class:`_FlatGroup`.
2. During ``backward()``, a tensor hook hides any ``.grad`` we exposed earlier (else autograd
   would add into it natively, bypassing the kernels); then autograd produces ``p.grad`` in its
   own dtype (``p.grad_dtype = None`` for bf16/fp16 params stops autograd casting it) and a
   post-accumulate-grad hook hands it to the parameter's bucket and frees ``p.grad``. A full
   bucket is folded into the accumulator by one ``accumulate_`` call; the window's first
   gradient of a slice overwrites it, so no zeroing pass is ever needed.
3. A callback queued on the autograd engine flushes partial buckets and counts the micro-batch
   when the backward ends. After the ``accum_steps``-th backward (after every backward when
   ``accum_steps`` is None), each ``p.grad`` is set to the fp32 accumulated gradient, a view of
   the buffer, so ``clip_grad_norm_``, ``GradScaler.unscale_`` and loggers see (and edit) it.
4. ``step()`` reads the buffers once per flat group: one fused-step op call updates the state,
   the fp32 master and the low-precision parameter. The accumulator is left as it is, to be
   overwritten by the next window.

Gradients are summed over micro-batches, exactly as plain ``.grad`` accumulation does: scale the
loss yourself (as HF Trainer, Accelerate and Lightning already do), or pass
``step(num_items=N)`` to divide a summed gradient by the number of items (e.g. tokens) in the
window, which is the exact large-batch gradient when micro-batches differ in size.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import backends, ops
from .distributed import WindowReducer

logger = logging.getLogger("fused_accum")

ALIGN = 64  # elements: each slice starts 256 bytes into an fp32 buffer (16-byte vector loads, and 128-byte lines)


def padded_offsets(numels) -> tuple[list[int], int]:
    """Where each of ``numels`` starts in a flat buffer whose slices are padded to ``ALIGN``,
    and the buffer's total size."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total

LOW_PRECISION = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")  # torch >= 2.10
# id(parameter) -> (weak parameter, weak optimizer whose hooks take its gradients). Two live
# optimizers on one parameter would both take its .grad: the first would starve the second.
# Keyed by id because tensors compare element-wise, not by identity.
_OWNERS: dict = {}


def _owner(param: Tensor):
    """The live FusedAccumOptimizer hooked to ``param``, or None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A fused algorithm: its torch.optim-named defaults and the state it keeps per parameter."""

    defaults: dict
    state_keys: tuple


ALGORITHMS = {
    "sgd": Algorithm(
        dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
        ("momentum_buffer",),
    ),
    "adam": Algorithm(
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False),
        ("exp_avg", "exp_avg_sq"),
    ),
    "adamw": Algorithm(
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False),
        ("exp_avg", "exp_avg_sq"),
    ),
    "lion": Algorithm(
        dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False), ("exp_avg",)
    ),
}
# torch.optim keywords that choose torch's own implementation; accepted for drop-in
# compatibility and ignored, since the implementation here is always ours.
IGNORED_TORCH_KEYWORDS = ("foreach", "fused", "capturable", "differentiable")


@dataclasses.dataclass(eq=False)
class _Slot:
    """One parameter's place in its flat group."""

    param: Tensor
    name: str
    index: int  # position in the flat group (and in its ``steps`` vector)
    offset: int  # where its slice of the flat buffers starts
    acc: Tensor  # 1-D fp32 view of the accumulator
    grad_view: Tensor  # the same memory shaped like the param: what ``.grad`` is set to
    master: Optional[Tensor]  # 1-D fp32 master copy, for low-precision params with master weights
    state: dict  # optimizer state name -> 1-D fp32 view
    flat: "_FlatGroup"
    has_grad: bool = False  # the accumulator slice holds this window's gradient
    in_stats: bool = False  # its final value is already in the window's norm / non-finite flag
    bucket: Optional["_Bucket"] = None


@dataclasses.dataclass(eq=False)
class _Bucket:
    """Slots folded by one accumulate call; arrivals wait here until the bucket is complete."""

    slots: list  # consecutive slots, in flat-buffer order
    start: int = 0  # the bucket's slots cover flat buffer elements [start, end), padding included
    end: int = 0
    offsets: Optional[Tensor] = None  # int64 on the CPU: each slot's offset, for accumulate
    # slot -> its gradient so far in this backward (a parameter used both inside a reentrant
    # checkpoint and outside it receives two gradients in one backward: they are summed here)
    arrived: dict = dataclasses.field(default_factory=dict)


class _FlatGroup:
    """The flat fp32 buffers of the parameters of one param group, one device and one dtype."""

    def __init__(self, group_index, params, names, dtype, device, state_keys, master_weights, backend, bucket_numel):
        self.group_index, self.dtype, self.device, self.backend = group_index, dtype, device, backend
        self.has_master = dtype in LOW_PRECISION and master_weights
        offsets, total = padded_offsets(p.numel() for p in params)
        fp32 = dict(dtype=torch.float32, device=device)
        self.acc = torch.zeros(total, **fp32)
        self.master = torch.zeros(total, **fp32) if self.has_master else None
        self.state = {key: torch.zeros(total, **fp32) for key in state_keys}
        self.steps = torch.zeros(len(params), **fp32)  # per-parameter step counts
        self.lr = torch.zeros((), **fp32)
        self.coef = torch.ones((), **fp32)
        self.slots = []
        for i, (p, name, off) in enumerate(zip(params, names, offsets)):
            window = slice(off, off + p.numel())
            acc = self.acc[window]
            master = None
            if self.has_master:
                master = self.master[window]
                master.copy_(p.detach().reshape(-1))
            state = {key: buf[window] for key, buf in self.state.items()}
            self.slots.append(_Slot(p, name, i, off, acc, acc.view(p.shape), master, state, self))
        # Buckets follow reverse registration order, the order backward usually produces grads.
        self.buckets, current, size = [], [], 0
        for slot in reversed(self.slots):
            current.append(slot)
            size += slot.param.numel()
            if size >= bucket_numel:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        ends = offsets[1:] + [total]  # a slice's padded end is where the next one starts
        for bucket in self.buckets:  # consecutive slots: one contiguous range of the buffer
            bucket.slots.reverse()
            bucket.start = bucket.slots[0].offset
            bucket.end = ends[bucket.slots[-1].index]
            bucket.offsets = torch.tensor([s.offset for s in bucket.slots], dtype=torch.int64)
            for slot in bucket.slots:
                slot.bucket = bucket

    def step_targets(self, slot):
        """(tensor the step updates, low-precision tensor to write or None) for ``slot``."""
        # The param as it is (any strides: a channels_last weight cannot be viewed as 1-D); the
        # backends walk it in logical order, the order of its accumulator slice.
        param = slot.param.detach()
        if self.has_master:
            return slot.master, param
        return param, None


def _hide_exposed_grad(optimizer_ref, param: Tensor, grad: Tensor) -> Tensor:
    """Tensor hook, run just before AccumulateGrad: without it autograd would add the new
    gradient into the fp32 view we exposed (bypassing the kernels), and we would fold it twice."""
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._reconcile_exposed(before_backward=True)
        if param.grad is optimizer._slots[param].grad_view:
            param.grad = None
    return grad


def _fold_grad(optimizer_ref, param: Tensor) -> None:
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._receive(param)


def _param_label(group_index, j, param, names):
    if names is not None:
        return repr(names[j])
    return f"param_groups[{group_index}]['params'][{j}] (shape {tuple(param.shape)}, {param.dtype})"


class FusedAccumOptimizer(torch.optim.Optimizer):
    """Gradient accumulation into fp32 buffers with a fused optimizer step; a drop-in optimizer.

    Args:
        params: an iterable of parameters, of ``(name, parameter)`` pairs, or of param-group
            dicts, as for any ``torch.optim`` optimizer. Parameters with ``requires_grad=False``
            are skipped. float32, bfloat16 and float16 parameters are supported.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"lion"`` (fused), or any
            ``torch.optim.Optimizer`` subclass, which then steps the fp32 master parameters
            from the fp32 accumulated gradients (the generic path).
        lr and other hyper-parameters: torch.optim's names and defaults for the algorithm
            (``betas``, ``eps``, ``weight_decay``, ``momentum``, ``dampening``, ``nesterov``,
            ``maximize``). ``lr`` may be a tensor. They are re-read from ``param_groups`` at
            every step, so schedulers work.
        accum_steps: micro-batches per window, if known. ``.grad`` is exposed after that many
            backward passes; when None it is exposed after every backward.
        master_weights: keep an fp32 master copy of bf16/fp16 parameters (default True). With
            False, low-precision parameters are updated in place (fp32 math, rounded once).
        backend: ``"auto"``, ``"reference"``, ``"triton"``, ``"cpu"`` or ``"cuda"``; see
            :mod:`fused_accum.backends`. ``FUSED_ACCUM_BACKEND`` overrides ``"auto"``.
        bucket_cap_mb: size of the gradient buckets folded by one op call, in MB of fp32.
        step_in_backward: fuse the last micro-batch with the step (needs ``accum_steps``):
            each bucket of the window's last backward runs accumulate + step in one pass
            (32 instead of 10 + 30 bytes per bf16 parameter for AdamW), and ``step()`` only
            ends the window. The update then happens before ``step()`` returns control, so
            it is only for loops that neither clip, nor unscale, nor read ``.grad`` (it is
            not exposed) between backward and step; normalise the loss (num_items cannot
            apply).
        max_grad_norm: clip the window's global gradient norm (after ``num_items``) to this,
            as ``clip_grad_norm_`` would, on the device. With ``accum_steps`` known, the sum of
            squares comes out of the last micro-batch's accumulate pass at no extra read.
            Like ``skip_nonfinite`` it describes the gradient as accumulated: to clip after
            ``GradScaler.unscale_``, call ``clip_grad_norm_`` yourself instead.
        skip_nonfinite: skip the whole update (state, step counts and weights) when any
            accumulated gradient is inf/nan, without a host sync on the fused path.
        process_group: a ``torch.distributed`` group (e.g. ``torch.distributed.group.WORLD``)
            for data parallelism: the fp32 accumulators are averaged across it once per window
            (DDP's average, on fp32), the buckets finished during the last backward while it
            still runs. ``.grad`` at the window end and the step see the group's gradient.
            ``step(num_items=n)`` then takes this rank's item count; the counts are summed
            over the group. Every rank must run the same number of backward passes per window.

    A step with no accumulated gradient (no backward since the last step or ``zero_grad``)
    changes nothing, as torch's optimizers skip parameters whose ``.grad`` is None.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer: Union[str, type] = "adamw",
        *,
        accum_steps: Optional[int] = None,
        master_weights: Optional[bool] = None,
        backend: str = "auto",
        bucket_cap_mb: float = 25.0,
        step_in_backward: bool = False,
        max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = False,
        process_group=None,
        **hyperparameters: Any,
    ):
        if accum_steps is not None and (not isinstance(accum_steps, int) or accum_steps < 1):
            raise ValueError(f"accum_steps must be a positive int or None, got {accum_steps!r}")
        if backend != "auto" and backend not in backends.NAMES:
            raise ValueError(f"backend must be 'auto' or one of {backends.NAMES}, got {backend!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if step_in_backward and accum_steps is None:
            raise ValueError("step_in_backward=True needs accum_steps: the last micro-batch must be known")
        if step_in_backward and (max_grad_norm is not None or skip_nonfinite):
            raise ValueError("step_in_backward=True steps before the window's norm is known: "
                             "it cannot be combined with max_grad_norm or skip_nonfinite")
        if step_in_backward and process_group is not None:
            raise ValueError("step_in_backward=True steps before the window is reduced across "
                             "process_group: they cannot be combined")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        if step_in_backward and not isinstance(optimizer, str):
            raise ValueError("step_in_backward=True needs a fused algorithm (sgd, adam, adamw, lion)")
        self._config = dict(
            optimizer=optimizer, accum_steps=accum_steps, master_weights=master_weights,
            backend=backend, bucket_cap_mb=bucket_cap_mb, step_in_backward=step_in_backward,
            max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, process_group=process_group,
            hyperparameters=dict(hyperparameters),
        )  # fmt: skip
        self.accum_steps = accum_steps
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.last_grad_norm: Optional[Tensor] = None  # the last window's norm, when computed
        self._stats: dict = {}  # device -> (found_inf, sumsq) of the current window
        self._reducer = WindowReducer(process_group) if process_group is not None else None
        self._master_weights = True if master_weights is None else bool(master_weights)
        self._backend_request = backend
        self._bucket_numel = max(1, int(bucket_cap_mb * 2**20 / 4))
        self._algorithm, self._generic_class, defaults = self._parse_algorithm(optimizer, hyperparameters)
        self._flat_groups: list[_FlatGroup] = []
        self._slots: dict[Tensor, _Slot] = {}
        self._untrained: list[Tensor] = []  # frozen when added: no slot, no hooks
        self._hook_handles = []
        self._microbatches = 0
        self._queued_tasks: set = set()  # graph tasks (backwards) whose end callback is queued
        self._lock = threading.RLock()
        self._stepped_in_backward = False
        self._exposed = False  # .grad currently shows the window (see _reconcile_exposed)
        self._inner: Optional[torch.optim.Optimizer] = None  # the generic path's optimizer
        self._generic_params: dict[Tensor, Tensor] = {}  # param -> what the inner optimizer steps
        super().__init__(params, defaults)

    # --- construction ----------------------------------------------------------------------

    @staticmethod
    def _parse_algorithm(optimizer, hyperparameters):
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer= takes an optimizer class (e.g. torch.optim.RMSprop) or a name, "
                f"not an instance of {type(optimizer).__name__}"
            )
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if issubclass(optimizer, FusedAccumOptimizer):
                raise TypeError("optimizer= cannot be a FusedAccumOptimizer class")
            return None, optimizer, dict(hyperparameters)
        if not isinstance(optimizer, str) or optimizer.lower() not in ALGORITHMS:
            raise ValueError(
                f"optimizer must be one of {sorted(ALGORITHMS)} or a torch.optim.Optimizer "
                f"subclass, got {optimizer!r}"
            )
        name = optimizer.lower()
        defaults = dict(ALGORITHMS[name].defaults)
        for key, value in hyperparameters.items():
            if key in IGNORED_TORCH_KEYWORDS:
                continue
            if key not in defaults:
                raise TypeError(
                    f"unexpected keyword {key!r} for optimizer {name!r}; "
                    f"expected one of {sorted(defaults)}"
                )
            defaults[key] = value
        if defaults.get("amsgrad"):
            raise NotImplementedError("amsgrad=True is not fused; pass optimizer=torch.optim.Adam(W) "
                                      "to use the generic path, which supports it")
        if hyperparameters.get("differentiable"):
            raise NotImplementedError("differentiable=True is not supported")
        return name, None, defaults

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch.optim does), give its parameters slots, and hook them."""
        seen = {p for g in self.param_groups for p in g["params"]}
        group_index = len(self.param_groups)
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        for j, p in enumerate(raw):
            if isinstance(p, tuple):  # (name, param) pairs are resolved by torch below
                p = p[1]
            if p in seen:
                raise ValueError(f"{_param_label(group_index, j, p, None)} appears in more than one param group")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names")
        self._validate_hyperparameters(group, group_index)
        trainable = []
        for j, p in enumerate(group["params"]):
            label = _param_label(group_index, j, p, names)
            if not p.requires_grad:  # frozen: skipped, as torch skips params without .grad
                self._untrained.append(p)
                continue
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(f"parameter {label} has dtype {p.dtype}; only real floating-point parameters are supported")
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"parameter {label} has dtype {p.dtype}; supported: float32, bfloat16, float16")
            trainable.append((p, label))
        by_key: dict[tuple, list] = {}
        for p, label in trainable:
            by_key.setdefault((p.device, p.dtype), []).append((p, label))
        state_keys = ALGORITHMS[self._algorithm].state_keys if self._algorithm else ()
        for (device, dtype), members in by_key.items():
            backend = backends.resolve(self._backend_request, device)
            flat = _FlatGroup(
                group_index, [p for p, _ in members], [l for _, l in members], dtype, device,
                state_keys, self._master_weights, backend, self._bucket_numel,
            )  # fmt: skip
            self._flat_groups.append(flat)
            for slot in flat.slots:
                self._register(slot, flat)
        if self._generic_class is not None:
            self._add_generic_group(group, group_index)

    def _validate_hyperparameters(self, group, group_index):
        def check(ok, what):
            if not ok:
                raise ValueError(f"param_groups[{group_index}]: invalid {what}")

        lr = group["lr"]
        check(isinstance(lr, Tensor) and lr.numel() == 1 or isinstance(lr, (int, float)) and lr >= 0, f"lr {lr!r}")
        if self._algorithm is None:
            return
        check(group["weight_decay"] >= 0, f"weight_decay {group['weight_decay']!r}")
        if "betas" in group:
            b1, b2 = group["betas"]
            check(0 <= b1 < 1 and 0 <= b2 < 1, f"betas {group['betas']!r} (each must be in [0, 1))")
        if "eps" in group:
            check(group["eps"] >= 0, f"eps {group['eps']!r}")
        if self._algorithm == "sgd":
            check(group["momentum"] >= 0, f"momentum {group['momentum']!r}")
            check(not group["nesterov"] or (group["momentum"] > 0 and group["dampening"] == 0),
                  "nesterov: it requires momentum > 0 and dampening == 0")

    def _register(self, slot: _Slot, flat: _FlatGroup) -> None:
        p = slot.param
        if p in self._slots:  # shared parameters are caught above; this would be our bug
            raise AssertionError(f"{slot.name} registered twice")
        if _owner(p) is not None:
            raise RuntimeError(f"parameter {slot.name} is already trained by another FusedAccumOptimizer; "
                               "call remove_hooks() on that one (or delete it) first")  # fmt: skip
        key = id(p)

        def forget(ref, key=key):  # the parameter died: drop its entry (unless reused since)
            if _OWNERS.get(key, (None,))[0] is ref:
                del _OWNERS[key]

        _OWNERS[key] = (weakref.ref(p, forget), weakref.ref(self))
        self._slots[p] = slot
        if p.dtype in LOW_PRECISION and HAS_GRAD_DTYPE:
            # Let bf16/fp16 gradients reach the hook uncast, and let .grad be our fp32 view.
            p.grad_dtype = None
        # The hooks hold the optimizer weakly: once it is gone they do nothing, and they never
        # keep its buffers alive.
        this = weakref.ref(self)
        self._hook_handles.append(p.register_hook(lambda grad: _hide_exposed_grad(this, p, grad)))
        self._hook_handles.append(p.register_post_accumulate_grad_hook(lambda param: _fold_grad(this, param)))

    def remove_hooks(self) -> None:
        """Stop folding gradients (autograd fills ``.grad`` as usual again); the optimizer
        can no longer accumulate. Needed only to hand the parameters to another optimizer."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for p in self._slots:
            if _owner(p) is self:
                del _OWNERS[id(p)]

    def _add_generic_group(self, group, group_index):
        inner_params = []
        for p in group["params"]:
            slot = self._slots.get(p)
            if slot is None:
                continue
            target = p if slot.master is None else torch.nn.Parameter(slot.master.view(p.shape))
            self._generic_params[p] = target
            inner_params.append(target)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        try:
            if self._inner is None:
                self._inner = self._generic_class([dict(params=inner_params, **hyper)])
            else:
                self._inner.add_param_group(dict(params=inner_params, **hyper))
        except TypeError as err:
            raise TypeError(f"{self._generic_class.__name__} rejected param_groups[{group_index}]: {err}") from err

    # --- hooks -------------------------------------------------------------------------------

    def _receive(self, param: Tensor) -> None:
        """The post-accumulate-grad hook: take ``param.grad`` into its bucket."""
        grad, slot = param.grad, self._slots[param]
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(f"parameter {slot.name} received a sparse gradient; sparse gradients are not supported")
        param.grad = None
        with self._lock:  # autograd runs one thread per device: buckets may span devices' hooks
            self._queue_end_of_backward()
            bucket = slot.bucket
            if self._reducer is not None and self._reducer.launched(bucket):
                raise RuntimeError(f"parameter {slot.name} received a gradient after its bucket was reduced "
                                   "across the process group (more backward passes than accum_steps, or a "
                                   "second gradient in one backward): unsupported with process_group")  # fmt: skip
            earlier = bucket.arrived.get(slot)
            bucket.arrived[slot] = grad if earlier is None else earlier + grad
            if len(bucket.arrived) == len(bucket.slots):
                self._fold(slot.flat, bucket)

    def _queue_end_of_backward(self) -> None:
        """Queue ``_end_of_backward`` once per backward (graph task). Keyed by the task rather
        than a flag: a backward that raised before its end leaves nothing stuck (ids are never
        reused), and reentrant backwards nested in it keep their own."""
        task = torch._C._current_graph_task_id()
        if task not in self._queued_tasks:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task))
            self._queued_tasks.add(task)

    def _fold(self, flat: _FlatGroup, bucket: _Bucket) -> None:
        """One op call per (overwrite, add) kind for the bucket's arrived gradients: an
        accumulate, or on the last micro-batch with ``step_in_backward`` the fused step."""
        arrived, bucket.arrived = bucket.arrived, {}
        in_order = [s for s in bucket.slots if s in arrived]  # accumulate takes increasing offsets
        fuse_step = self.step_in_backward and self._microbatches == self.accum_steps - 1
        for overwrite in (True, False):
            slots = [s for s in in_order if s.has_grad != overwrite]
            if not slots:
                continue
            grads = [arrived[s] for s in slots]
            if fuse_step:
                self._fused_step(flat, slots, flat.coef.fill_(1.0), None, grads, overwrite)
                continue
            # On the window's last micro-batch the values written are final: the same pass
            # can add them to the window's norm and non-finite flag.
            last = self.accum_steps is not None and self._microbatches == self.accum_steps - 1
            # (with a process group the stats must describe the reduced values: taken at step)
            local_stats = last and self._wants_stats and self._reducer is None
            found_inf, sumsq = self._stats_tensors(flat.device) if local_stats else (None, None)
            if len(slots) == len(bucket.slots):
                offsets = bucket.offsets
            else:
                offsets = torch.tensor([s.offset for s in slots], dtype=torch.int64)
            ops.accumulate(flat.acc, offsets, grads, 1.0, overwrite, found_inf, sumsq, flat.backend)
            for slot in slots:
                slot.in_stats = sumsq is not None
        for slot in in_order:
            # A slot stepped from its last gradient holds nothing for this window any more.
            slot.has_grad = not fuse_step
        if self._reducer is not None and self._is_last_microbatch() and len(arrived) == len(bucket.slots):
            self._reducer.bucket_ready(self._flat_groups, bucket)  # overlaps the rest of the backward

    def _is_last_microbatch(self) -> bool:
        """The backward now running ends the window (known only with accum_steps)."""
        return self.accum_steps is not None and self._microbatches == self.accum_steps - 1

    @property
    def _wants_stats(self) -> bool:
        return self.max_grad_norm is not None or self.skip_nonfinite

    def _stats_tensors(self, device) -> tuple:
        if device not in self._stats:
            zeros = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(2)]
            self._stats[device] = tuple(zeros)
        return self._stats[device]

    def _reconcile_exposed(self, before_backward: bool = False) -> None:
        """Once ``.grad`` is exposed it is the truth, as with torch's optimizers: a ``.grad``
        cleared since (``model.zero_grad()``, as HF Trainer calls it, e.g. after GradScaler
        skipped our step) discards that parameter's window, and one replaced by another tensor
        becomes its accumulated gradient. Runs before the next backward touches any ``.grad``,
        at step() and at state_dict()."""
        with self._lock:
            if not self._exposed:
                return
            changed = False
            for slot in self._slots.values():
                grad = slot.param.grad
                if grad is slot.grad_view:
                    continue
                if grad is None:
                    changed |= slot.has_grad
                    slot.has_grad = False
                else:
                    self._take_user_grad(slot, grad)
                    changed = True
                    if before_backward:
                        slot.param.grad = None  # the next gradient is added by our kernels
            if not any(slot.has_grad for slot in self._slots.values()):
                self._end_window()  # everything was cleared: a new window starts
            elif changed:
                self._invalidate_stats()  # the norm/flag described values that are gone
            self._exposed = not before_backward

    def _invalidate_stats(self) -> None:
        """Forget the window's norm and non-finite flag; step() recomputes them from the buffers."""
        for slot in self._slots.values():
            slot.in_stats = False
        for found_inf, sumsq in self._stats.values():
            found_inf.zero_()
            sumsq.zero_()

    def _end_window(self) -> None:
        self._exposed = False
        if self._reducer is not None:
            self._reducer.reset()
        for slot in self._slots.values():
            slot.has_grad = False
        self._invalidate_stats()
        self._microbatches = 0

    def _window_scale(self, num_items) -> tuple:
        """(coef per device, found_inf per device or None): 1/num_items x the clip factor,
        computed on the device from the window's sum of squares, without a host sync."""
        devices = {flat.device for flat in self._flat_groups}
        inv_items = {}
        for device in devices:
            inv = torch.ones((), dtype=torch.float32, device=device)
            if num_items is not None:
                self._set_scalar(inv, num_items)
                if self._reducer is not None:  # gradients are the group's mean: so the counts
                    self._reducer.average_(inv)
                inv.reciprocal_()
            inv_items[device] = inv
        if not self._wants_stats:
            return inv_items, None
        for slot in self._slots.values():  # values not seen by a last-micro-batch pass
            if slot.has_grad and not slot.in_stats:
                _, sumsq = self._stats_tensors(slot.acc.device)
                sumsq.add_(torch.dot(slot.acc, slot.acc))
        home = next(iter(devices))
        total = sum(self._stats_tensors(d)[1].to(home) for d in devices)
        any_inf = sum(self._stats_tensors(d)[0].to(home) for d in devices)
        # inf/nan anywhere makes the sum of squares non-finite, which also covers the values
        # summed just above
        found_inf = torch.maximum(any_inf.clamp(max=1), (~torch.isfinite(total)).float())
        norm = total.sqrt() * inv_items[home]
        self.last_grad_norm = norm
        scale = {d: inv for d, inv in inv_items.items()}
        if self.max_grad_norm is not None:
            clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
            scale = {d: inv * clip.to(d) for d, inv in inv_items.items()}
        skip = {d: found_inf.to(d) for d in devices} if self.skip_nonfinite else None
        return scale, skip

    def _flush(self) -> None:
        for flat in self._flat_groups:
            for bucket in flat.buckets:
                if bucket.arrived:
                    self._fold(flat, bucket)

    def _end_of_backward(self, task: int) -> None:
        with self._lock:
            self._queued_tasks.discard(task)
            self._flush()
            enclosing = torch._C._current_autograd_node()
            if enclosing is not None:
                # This backward ran inside a node of another one (checkpoint(use_reentrant=True)
                # re-enters the engine): the micro-batch ends with the outermost backward, so
                # queue there once that node is done.
                enclosing.register_hook(lambda *_: self._queue_end_of_backward())
                return
            self._count_microbatch()

    def _count_microbatch(self) -> None:
        self._microbatches += 1
        if self.step_in_backward and self._microbatches == self.accum_steps:
            # Slots whose gradients all came before the last micro-batch step here; the rest
            # were stepped as their buckets completed. step() then only ends the window.
            for flat in self._flat_groups:
                self._fused_step(flat, [s for s in flat.slots if s.has_grad], flat.coef.fill_(1.0))
            for slot in self._slots.values():
                slot.has_grad = False
            self._stepped_in_backward = True
        elif self.accum_steps is None or self._microbatches >= self.accum_steps:
            if self._reducer is not None and self._microbatches == self.accum_steps:
                self._finish_reduction()
            self._expose_grads()

    def _finish_reduction(self) -> None:
        if not self._reducer.done:
            self._reducer.finish(self._flat_groups)
            self._invalidate_stats()  # any local norm described local values

    def _expose_grads(self) -> None:
        self._exposed = True
        for slot in self._slots.values():
            p = slot.param
            if slot.has_grad:
                if p.dtype in LOW_PRECISION and not HAS_GRAD_DTYPE:
                    continue  # old torch cannot hold an fp32 .grad on a low-precision param
                p.grad = slot.grad_view
            elif p.grad is slot.grad_view:
                p.grad = None

    # --- public API ----------------------------------------------------------------------------

    @property
    def microbatches(self) -> int:
        """Backward passes folded into the current window (each ``backward()`` that reaches a
        parameter counts once: two backward calls per micro-batch count twice)."""
        self._reconcile_exposed()
        return self._microbatches

    def accumulated_grad(self, param: Tensor) -> Optional[Tensor]:
        """The fp32 gradient accumulated for ``param`` in this window (a live view), or None."""
        slot = self._slots.get(param)
        if slot is None:
            raise KeyError("this parameter is not trained by this optimizer (not given, or frozen)")
        if slot.bucket.arrived:
            self._flush()
        return slot.grad_view if slot.has_grad else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the window: buffers are marked to be overwritten, every ``.grad`` is None.

        ``set_to_none`` is accepted for compatibility; ``.grad`` always becomes None, since
        the accumulator is already discarded without a zeroing pass.
        """
        for flat in self._flat_groups:
            for bucket in flat.buckets:
                bucket.arrived = {}
        self._queued_tasks.clear()  # those of a backward that raised: they will never run
        self._end_window()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, num_items=None):
        """Apply one update from the window's accumulated gradients, and end the window.

        ``num_items``: divide the summed gradient by this (an int, float or device tensor, e.g.
        the window's token count for a sum-reduced loss), without a host sync.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._flush()
        if num_items is not None and not isinstance(num_items, Tensor) and not num_items > 0:
            raise ValueError(f"num_items must be positive, got {num_items!r}")
        if self._stepped_in_backward:
            if num_items is not None:
                raise ValueError("step_in_backward=True already stepped during backward; "
                                 "num_items cannot apply (normalise the loss instead)")
            self._stepped_in_backward = False
            self._end_window()
            return loss
        self._reconcile_exposed()
        self._take_user_grads()
        if self._reducer is not None:
            self._finish_reduction()
        scale, skip = self._window_scale(num_items)
        if self._inner is not None:
            self._generic_step(scale, skip)
        else:
            for flat in self._flat_groups:
                active = [s for s in flat.slots if s.has_grad]
                self._fused_step(flat, active, scale[flat.device], skip and skip[flat.device])
        self._end_window()
        return loss

    def _take_user_grads(self) -> None:
        """A ``.grad`` the user assigned (not our view) is the gradient this step uses."""
        taken = False
        for slot in self._slots.values():
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                self._take_user_grad(slot, grad)
                taken = True
        if taken:
            self._invalidate_stats()
        for p in self._untrained:
            if p.grad is not None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} has a .grad but no place in this optimizer: it "
                    "had requires_grad=False when it was added; add it again with add_param_group() "
                    "after unfreezing it"
                )

    @staticmethod
    def _take_user_grad(slot: _Slot, grad: Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"parameter {slot.name} has a sparse .grad; sparse gradients are not supported")
        slot.acc.copy_(grad.reshape(-1))
        slot.has_grad = True

    @staticmethod
    def _set_scalar(dst: Tensor, value) -> None:
        if isinstance(value, Tensor):
            dst.copy_(value.detach().reshape(()))  # device to device: no host sync
        else:
            dst.fill_(float(value))

    def _fused_step(self, flat: _FlatGroup, active: list, coef: Tensor, found_inf=None, grads=(),
                    grads_overwrite=False) -> None:  # fmt: skip
        """One step-op call for ``active`` slots; with ``grads``, also their last micro-batch."""
        if not active:
            return
        group = self.param_groups[flat.group_index]
        self._set_scalar(flat.lr, group["lr"])
        flat.coef.copy_(coef)
        # A skipped step does not count (as torch's GradScaler skips the step call itself).
        increment = 1 if found_inf is None else 1 - found_inf
        if len(active) == len(flat.slots):
            flat.steps.add_(increment)
        else:
            index = torch.tensor([s.index for s in active], device=flat.device)
            flat.steps.index_add_(0, index, torch.ones(len(active), device=flat.device) * increment)
        steps = flat.steps if len(active) == len(flat.slots) else flat.steps[[s.index for s in active]]
        targets = [flat.step_targets(s) for s in active]
        params = [t for t, _ in targets]
        lp_params = [lp for _, lp in targets if lp is not None]
        accs = [s.acc for s in active]
        state = {key: [s.state[key] for s in active] for key in flat.state}
        common = (steps, flat.lr, flat.coef)
        tail = (lp_params, list(grads), 1.0, grads_overwrite, found_inf, flat.backend)
        if self._algorithm == "sgd":
            momentum = group["momentum"]
            bufs = state["momentum_buffer"] if momentum != 0 else []
            ops.sgd_step(params, bufs, accs, *common, momentum, group["dampening"],
                          group["weight_decay"], group["nesterov"], group["maximize"], *tail)  # fmt: skip
        elif self._algorithm in ("adam", "adamw"):
            beta1, beta2 = group["betas"]
            ops.adam_step(params, state["exp_avg"], state["exp_avg_sq"], accs, *common, beta1, beta2,
                           group["eps"], group["weight_decay"], self._algorithm == "adamw",
                           group["maximize"], *tail)  # fmt: skip
        else:
            beta1, beta2 = group["betas"]
            ops.lion_step(params, state["exp_avg"], accs, *common, beta1, beta2,
                           group["weight_decay"], group["maximize"], *tail)  # fmt: skip

    def _generic_step(self, scale, skip) -> None:
        if skip is not None and any(bool(f.item()) for f in skip.values()):
            return  # torch optimizers cannot skip on the device: this path syncs once
        for group, inner_group in zip(self.param_groups, self._inner.param_groups):
            for key, value in group.items():  # schedulers write our groups; mirror them
                if key not in ("params", "param_names"):
                    inner_group[key] = value
        saved_grads = {}
        for p, target in self._generic_params.items():
            slot = self._slots[p]
            saved_grads[p] = p.grad
            if not slot.has_grad:
                target.grad = None
                continue
            slot.acc.mul_(scale[slot.acc.device])
            # torch optimizers want .grad in the param's dtype: a bf16 param without a master
            # gets the fp32 sum rounded once, at the end of the window.
            target.grad = slot.grad_view if target.dtype == torch.float32 else slot.grad_view.to(target.dtype)
        self._inner.step()
        for p, target in self._generic_params.items():
            if target is not p:
                target.grad = None
                if self._slots[p].has_grad:
                    p.detach().copy_(target.detach())
            p.grad = saved_grads[p]

    # --- state_dict ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's ``{"state", "param_groups"}`` with per-parameter tensors only.

        Each trained parameter's entry holds its optimizer state (torch's key names; ``step``
        as a 0-d fp32 tensor), ``master`` (fp32 copy of a low-precision parameter) and, when
        the window has a gradient for it, ``accum`` (the fp32 accumulated gradient). Each param
        group also records ``window_microbatches``, so a checkpoint taken mid-window resumes
        exactly. Tensors are copies, safe to save while training goes on.
        """
        self._flush()
        self._reconcile_exposed()
        index_of, groups = {}, []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index_of.setdefault(p, len(index_of)) for p in group["params"]]
            packed["window_microbatches"] = self._microbatches
            groups.append(packed)
        state = {}
        for p, slot in self._slots.items():
            entry = self._param_state(p, slot)
            if slot.master is not None:
                entry["master"] = slot.master.view(p.shape).clone()
            if slot.has_grad:
                entry["accum"] = slot.grad_view.clone()
            state[index_of[p]] = entry
        return {"state": state, "param_groups": groups}

    def _param_state(self, p, slot) -> dict:
        if self._inner is not None:
            inner_state = self._inner.state.get(self._generic_params[p], {})
            return {k: v.clone() if isinstance(v, Tensor) else v for k, v in inner_state.items()}
        flat = slot.flat
        entry = {"step": flat.steps[slot.index].clone()}
        for key, view in slot.state.items():
            entry[key] = view.view(p.shape).clone()
        return entry

    def load_state_dict(self, state_dict: dict) -> None:
        """Load our own state_dict, or a plain torch SGD/Adam/AdamW one (missing keys default).

        Everything is restored in fp32, whatever dtype the saved tensors or the parameters
        have (torch's own loader would cast state to the parameter's dtype).
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer {len(self.param_groups)}")
        id_to_param = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"param_groups[{gi}] has {len(group['params'])} parameters, "
                                 f"the state_dict's {len(saved['params'])}")  # fmt: skip
            for key, value in saved.items():
                if key not in ("params", "param_names", "window_microbatches"):
                    group[key] = value
            id_to_param.update(zip(saved["params"], group["params"]))
        self.zero_grad()
        self._microbatches = int(saved_groups[0].get("window_microbatches", 0)) if saved_groups else 0
        saved_state = state_dict["state"]
        for pid, p in id_to_param.items():
            slot = self._slots.get(p)
            if slot is None:
                continue
            entry = saved_state.get(pid, {})
            self._load_param_state(p, slot, entry)
        if self.accum_steps is not None and self._microbatches >= self.accum_steps:
            self._expose_grads()  # saved at a window's end: .grad showed the window then too

    def _load_param_state(self, p, slot, entry) -> None:
        def fp32(value):
            return value.detach().to(device=slot.acc.device, dtype=torch.float32).reshape(-1)

        if slot.master is not None:
            slot.master.copy_(fp32(entry["master"]) if "master" in entry else p.detach().reshape(-1))
        if "accum" in entry:
            slot.acc.copy_(fp32(entry["accum"]))
            slot.has_grad = True
        if self._inner is not None:
            target = self._generic_params[p]
            inner = {k: v for k, v in entry.items() if k not in ("master", "accum")}
            self._inner.state[target] = {
                k: (v.detach().to(target.device).clone() if isinstance(v, Tensor) and v.dim() > 0 else v)
                for k, v in inner.items()
            }  # fmt: skip
            return
        flat = slot.flat
        # torch's SGD saves no step: a saved momentum buffer means at least one step was taken
        # (else the next step would re-initialise the buffer from the gradient).
        has_state = any(entry.get(key) is not None for key in slot.state)
        step = entry.get("step", 1.0 if has_state else 0.0)
        flat.steps[slot.index] = float(step.item() if isinstance(step, Tensor) else step)
        for key, view in slot.state.items():
            value = entry.get(key)
            if value is None:  # missing (or torch SGD's momentum_buffer=None): defaults to zero
                view.zero_()
            else:
                view.copy_(fp32(value))

    # --- pickling: rebuild buffers and hooks from the constructor arguments and the state -------

    def __getstate__(self) -> dict:
        if self._reducer is not None:
            raise TypeError("a FusedAccumOptimizer with a process_group cannot be pickled or copied "
                            "(a process group cannot); save its state_dict() instead")  # fmt: skip
        return {"config": self._config, "param_groups": self.param_groups, "state_dict": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        config = dict(state["config"])
        hyper = config.pop("hyperparameters")
        groups = [dict(g) for g in state["param_groups"]]
        FusedAccumOptimizer.__init__(self, groups, **config, **hyper)
        self.load_state_dict(state["state_dict"])

    def __repr__(self) -> str:
        algo = self._algorithm or self._generic_class.__name__
        backends_used = sorted({f.backend for f in self._flat_groups})
        return (f"FusedAccumOptimizer({algo}, accum_steps={self.accum_steps}, backends={backends_used}, "
                f"groups={len(self.param_groups)}, params={len(self._slots)})")  # fmt: skip


_ACCUMULATION_DOC = """
    Accumulation keywords (keyword-only), as for :class:`FusedAccumOptimizer`: ``accum_steps``,
    ``master_weights``, ``backend``, ``bucket_cap_mb``. ``foreach``, ``fused``, ``capturable``
    choose torch's implementation and are accepted and ignored.
"""


class SGD(FusedAccumOptimizer):
    __doc__ = "torch.optim.SGD's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, **accumulation):
        super().__init__(params, "sgd", lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         differentiable=differentiable, **accumulation)


class Adam(FusedAccumOptimizer):
    __doc__ = "torch.optim.Adam's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, **accumulation):
        name = "adamw" if decoupled_weight_decay or self._name == "adamw" else "adam"
        super().__init__(params, name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, differentiable=differentiable, **accumulation)


class AdamW(Adam):
    __doc__ = "torch.optim.AdamW's signature, fused with fp32 gradient accumulation." + _ACCUMULATION_DOC
    _name = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 **accumulation):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         differentiable=differentiable, **accumulation)


class Lion(FusedAccumOptimizer):
    __doc__ = "Lion (Chen et al. 2023), fused with fp32 gradient accumulation." + _ACCUMULATION_DOC

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **accumulation):
        super().__init__(params, "lion", lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                         **accumulation)
