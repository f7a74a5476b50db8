"""The host side's machinery of ``offload="cpu"`` (fused_accum.offload): one worker thread that
runs the host steps in order, the transfers between the device and the host, and each flat
group's host buffers (:class:`HostLayout`, over the topology's layout).

On a GPU each transfer runs on a side stream, stream-ordered after the device's work, and
returns its event (the worker synchronizes on it); on a CPU it runs on the worker, in order,
with nothing to wait for.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

from . import backends
from .extension import swap_storages

# A test's hook: called by the worker before each task (tests/test_offload.py makes the worker
# slow and its timing random with it, to show the next forward never sees half a step).
WORKER_DELAY: Optional[Callable[[], None]] = None


class Worker:
    """One host thread that runs tasks in order; an error is raised again by :meth:`drain`, and
    the tasks queued after the one that failed are not run (each follows from those before it:
    a step from its copies, the twins' swap from the steps, a send from the swap), until then."""

    def __init__(self) -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self.busy_s = 0.0  # seconds spent running tasks (benchmarks/offload.py: how much hides)
        self._thread = threading.Thread(target=_work, args=(self._tasks, weakref.ref(self)), daemon=True)
        self._thread.name = "fused_accum offload"
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        # The submitter's intra-op thread count goes with the task: torch fixes a thread's OpenMP
        # count at its first parallel call, so the worker would keep the count it first ran with
        # (after a later torch.set_num_threads(2), one thread: tests/test_cpu_threads.py).
        self._tasks.put((task, torch.get_num_threads()))

    def wait(self) -> None:
        """Wait until every submitted task has run (an error stays for :meth:`drain`)."""
        self._tasks.join()

    def drain(self) -> None:
        """Wait until every submitted task has run; raise a task's error."""
        self._tasks.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("fused_accum offload: the host step failed") from error

    def stop(self) -> None:
        """End the thread and wait for it (also at interpreter exit, through the optimizer's
        finalizer, before finalizing begins: a thread still running then would be cut off inside
        a torch op, and that aborts the process)."""
        self._tasks.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)


def _work(tasks: queue.Queue, worker_ref) -> None:
    while True:
        item = tasks.get()
        task = None
        try:
            if item is None:
                return
            task, threads = item
            if getattr(worker_ref(), "_error", None) is not None:
                continue  # (an earlier task failed: see Worker)
            if torch.get_num_threads() != threads:  # (only on a change: it also clears oneDNN's cache)
                torch.set_num_threads(threads)
            if WORKER_DELAY is not None:
                WORKER_DELAY()
            start = time.perf_counter()
            with torch.no_grad():
                task()
            worker = worker_ref()
            if worker is not None:
                worker.busy_s += time.perf_counter() - start
        except BaseException as error:  # (kept for drain: the main thread raises it)
            worker = worker_ref()
            if worker is not None and worker._error is None:
                worker._error = error
        finally:
            task = item = None  # (let go of the task's tensors now, not at the next one)
            tasks.task_done()


class Copies:
    """Transfers between the device and the host. On a GPU each runs on a side stream, stream-
    ordered after the device's work, and returns its event (the worker synchronizes on it); on a
    CPU it runs on the worker, in order, with nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def after_compute(self) -> None:
        """What the side stream runs from now on waits for the compute stream's work so far."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, dsts: list, srcs: list):
        """Start ``dsts[i].copy_(srcs[i])``: None on a CPU (the worker copies), else the copy's
        event."""
        if not self.cuda or not dsts:
            return None
        self.after_compute()  # (after the folds)
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            return self.stream.record_event()

    def to_device(self, dsts: list, srcs: list, pending: list) -> None:
        """``dsts[i].copy_(srcs[i])``; on a GPU on the side stream, its event kept in ``pending``
        (the compute stream waits on it before the next forward). Nothing to copy where a rank
        holds none of a flat group (its part of every bucket is padding)."""
        if not dsts:
            return
        if not self.cuda:
            torch._foreach_copy_(dsts, srcs)
            return
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            pending.append((self.device, self.stream.record_event()))


_HOST = torch.device("cpu")


class HostLayout:
    """A flat group's buffers under offload, over the topology's layout (``base``: one
    process's, a rank's part of each bucket under ``shard=``, the local shards of DTensor
    parameters under FSDP2). The base decides what this process stores and steps of each
    parameter and where its slices lie, and keeps the accumulator on the device where it puts
    it; this layout puts everything the step reads and writes on the host (the masters, the
    state, a copy of what the step writes of each parameter, the window's gradient as it
    arrives, and a twin of each buffer a step writes: every host step reads the live buffers and
    writes the twins, out of place, and the window's step is committed by swapping each buffer
    with its twin) and says what crosses per bucket. One instance per flat group.

    It asks the base through the layout's own methods, never by its kind: ``step_lists`` for
    what of each slot the step reads and writes on the device (the slots held here, their
    gradient and weight views: a parameter, a DTensor's local shard, a ZeRO piece of the
    staging buffer), ``part`` for a bucket's part where the base splits buckets (``shard=``).
    Every other attribute is the base's (:meth:`__getattr__`): the layout's protocol it does
    not change (``stored``, ``local_numel``, ``acc_numel``, ``bucket_align``, ``param_piece``,
    ``loaded``, ``state_view`` ...) and what the topology asks of its own layout
    (``shard=``'s ``begin_step``, ``staging``, ``gather_ranges``, ``finish_step``, ...)."""

    def __init__(self, base, pinned: bool) -> None:
        self.base = base
        self.pinned = pinned
        self.host_params: Optional[Tensor] = None  # the parameters' values, in their dtype, flat
        self.host_acc: Optional[Tensor] = None  # the window's gradient, copied from the device
        self.twin: dict = {}  # buffer name -> its twin, which the window's host steps write
        self._twins: dict = {}  # (see _twin_views)
        self._twin_keys: dict = {}  # buffer name -> the storage its twin was made for
        self._twins_stale = True  # (the slots held here changed: the views are made again)
        # Views made once (at set_views), so that a step and a transfer issue no view op per
        # parameter (tests/test_host_cost.py): slot index -> (its gradient on the host, its host
        # copy 1-D, the same shaped as the base's device view), for the slots held here; bucket
        # index -> 1-D aliases of its device weights (made again where one's storage moved)
        self._views: dict = {}
        self._aliases: dict = {}

    def __getattr__(self, name: str):
        if name == "base" or name.startswith("__"):  # (not set yet: unpickling, copying)
            raise AttributeError(name)
        return getattr(self.base, name)

    def _host(self, numel: int, dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, device=_HOST, pin_memory=self.pinned)

    def state_device(self, device) -> torch.device:
        return _HOST

    def step_backend(self, backend: str) -> str:
        return backends.resolve("auto", _HOST)  # the C++ CPU kernels (the reference without them)

    def place_buckets(self, flat) -> None:
        self.base.place_buckets(flat)  # (then local_numel is what this process holds)
        self.host_params = self._host(flat.local_numel, flat.dtype)
        self.host_acc = self._host(flat.local_numel, torch.float32)

    def set_views(self, flat, slot) -> None:
        self.base.set_views(flat, slot)
        if self.host_params.dtype != flat.dtype:  # the model was cast after the optimizer was built
            self.host_params = self._host(flat.local_numel, flat.dtype)
        self._aliases, self._twins_stale = {}, True
        held, _, weights = self._device_lists(flat, [slot])
        if not held:  # (shard=: this rank holds none of it)
            self._views.pop(slot.index, None)
            return
        host = self.host_params[slot.local]
        self._views[slot.index] = (self.host_acc[slot.local], host, host.view(weights[0].shape))
        host.copy_(self.base.param_piece(flat, slot))  # (fetched again at each step)

    def _device_lists(self, flat, slots: list) -> tuple:
        """(held, accumulator views, weights): what the step would read and write of ``slots`` on
        the device (the base's step lists: the slots held here, and where a step writes each
        one's weight: its low-precision copy beside an fp32 master, else the parameter itself,
        the master)."""
        held, accs, weights = self.base.step_lists(flat, slots)
        return held, accs, weights.lp_params or weights.params

    # --- what crosses, per bucket ---

    def local_range(self, flat, bucket_index: int) -> tuple:
        """(start, end) of a bucket's elements in the host buffers: its part where the base
        splits buckets (``shard=``), else all of it."""
        part = getattr(self.base, "part", None)
        if part is None:
            bucket = flat.buckets[bucket_index]
            return bucket.start, bucket.end
        start, end, local = part(flat, bucket_index)
        return local, local + end - start

    def _device_acc(self, flat, bucket_index: int) -> Tensor:
        """The bucket's accumulator range this process steps: in the host buffers' layout where
        the accumulator has it, else (whole, beside a part: ``shard="state"``) the part's."""
        if flat.acc.numel() == flat.local_numel:
            start, end = self.local_range(flat, bucket_index)
        else:
            start, end, _ = self.base.part(flat, bucket_index)
        return flat.acc[start:end]

    def fetch_lists(self, flat, bucket_index: int) -> tuple:
        """(host views, device views) to copy in before a bucket's step: its gradient, and the
        weights as the device has them (the step reads them: as the master itself, where there
        is no fp32 copy, or to follow a weight written from outside, where there is; an edit
        through ``.data`` or a collective moves no version counter, and the step without
        offload would read it): 4 + 2 B/param from the device for bf16 weights."""
        start, end = self.local_range(flat, bucket_index)
        held, _, weights = self._device_lists(flat, flat.buckets[bucket_index].slots)
        hosts = [self.host_acc[start:end]] + [self._views[s.index][2] for s in held]
        return hosts, [self._device_acc(flat, bucket_index)] + weights

    def fingerprint(self, flat, bucket_index: int) -> Tensor:
        """What a bucket's step reads from the device, as a fingerprint (see :func:`fingerprint`):
        its accumulator range and its weights."""
        parts = [fingerprint(self._device_acc(flat, bucket_index))]
        weights = self._weights_1d(flat, bucket_index)
        if weights:
            parts.append(fingerprint(torch.cat(weights)))
        return torch.cat(parts)

    def _weights_1d(self, flat, bucket_index: int) -> list:
        """1-D aliases of a bucket's device weights (what its step reads), made once and made
        again only where one's storage moved (``p.data = ...``, a cast, FSDP2's new local
        shard): no op per parameter per window. (Not kept where a weight is not contiguous: its
        flattening is a copy, taken at each use.)"""
        _, _, weights = self._device_lists(flat, flat.buckets[bucket_index].slots)
        kept = self._aliases.get(bucket_index)
        if kept is not None and len(kept) == len(weights) and all(map(_aliases, kept, weights)):
            return kept
        aliases = [w.detach().reshape(-1) for w in weights]
        if all(w.is_contiguous() for w in weights):
            self._aliases[bucket_index] = aliases
        return aliases

    def send_lists(self, flat, stepped: list) -> tuple:
        """(device views, host views): the updated weights to send back after a step, of the
        ``stepped`` slots (the others are not written, as without offload), into what the base's
        step would have written (``shard=``: its staging buffer, between the topology's
        ``before_flat_step`` and its all-gathers)."""
        held, _, weights = self._device_lists(flat, stepped)
        return weights, [self._views[s.index][2] for s in held]

    def step_lists(self, flat, active: list) -> tuple:
        """The host's: the held slots, the gradient as copied, the host copy of each weight
        (written by the step: as the rounded master, or stepped in place with its remainder,
        or as an fp32 parameter's own master)."""
        views = self._views
        held = [s for s in active if s.index in views]
        if len(held) == len(active):
            held = active  # (the same list: the stepper indexes nothing more)
        pairs = [views[s.index] for s in held]
        return held, [v[0] for v in pairs], flat.masters.step_tensors(held, [v[1] for v in pairs])

    # --- the twins: each buffer a step writes, double-buffered ---

    def _buffers(self, flat) -> dict:
        buffers = {"params": self.host_params, **flat.state}
        if flat.master is not None:  # (the fp32 copies, or the remainders: fused_accum.masters)
            buffers["master"] = flat.master
        return buffers

    def _twin_views(self, flat) -> dict:
        """buffer name -> slot index -> (the slot's view of the live buffer, of its twin), for the
        slots held here: made at the first step (the twins zeros: their padding is the buffers',
        and the weights' twin pinned as the weights are, since it becomes what crosses), and
        again where a buffer was replaced (a cast, a momentum turned on, a move: that buffer's
        twin only) or the slots held here changed. Keyed by the buffers' storages, not their
        addresses: a swap moves the addresses, not the storages."""
        buffers = self._buffers(flat)
        keys = {name: (buf.untyped_storage()._cdata, buf.numel(), buf.dtype) for name, buf in buffers.items()}
        if keys != self._twin_keys or self._twins_stale:
            # only a replaced buffer's twin is new: another's may hold a speculation's step
            self.twin = {
                name: self.twin[name]
                if self._twin_keys.get(name) == key
                else torch.zeros(
                    buffers[name].shape, dtype=buffers[name].dtype, pin_memory=self.pinned and name == "params"
                )
                for name, key in keys.items()
            }
            held = [s for s in flat.slots if s.index in self._views]
            self._twins = {
                name: {s.index: (buf[s.local], self.twin[name][s.local]) for s in held} for name, buf in buffers.items()
            }
            self._twin_keys, self._twins_stale = keys, False
        return self._twins

    def out_of_place(self, flat, slots: list, call):
        """``call`` (the step of ``slots`` that :meth:`Stepper.prepare_step` returned:
        ``functools.partial(op, t, states, hyper, backend, plan=...)``) made to step out of
        place: to read the old values from the live buffers (``ops.StepTensors.sources``) and
        write the new ones into their twins, the live buffers left as they were. The written
        lists, in the op's order: params, lp_params, remainders (each the host copy of the
        weights or the masters' buffer), then the state lists it writes."""
        t, states = call.args[0], call.args[1]
        views = self._twin_views(flat)
        held = [s.index for s in slots if s.index in self._views]
        weights = self.host_params.untyped_storage().data_ptr()
        fields = [f for f in ("params", "lp_params", "remainders") if getattr(t, f)]
        names = ["params" if getattr(t, f)[0].untyped_storage().data_ptr() == weights else "master" for f in fields]
        written = [f for f, lst in zip(type(states)._fields, states) if lst]
        names += [f[:-1] for f in written]  # (exp_avgs: exp_avg)
        twins = [[views[name][i][1] for i in held] for name in names]
        sources = [views[name][i][0] for name in names for i in held]
        t = t._replace(sources=sources, **dict(zip(fields, twins)))
        states = states._replace(**dict(zip(written, twins[len(fields) :])))
        return functools.partial(call.func, t, states, *call.args[2:], **call.keywords)

    def commit(self, flat, stepped: set) -> None:
        """The window's step stands: every slot in ``stepped`` (keys) was stepped into the
        twins; each run of the other held slots is copied over from the live buffers (only
        those: no op where every slot stepped), then each buffer and its twin swap their memory
        (O(1) with the extension: fused_accum.extension.swap_storages), so that ``opt.state``'s
        views, the slot views and the twins' views all see the other memory; a buffer whose
        memory the user holds from outside (:func:`_held_outside`) keeps it, and takes the
        twin's values by a copy."""
        self._twin_views(flat)  # (made, or made again where a buffer was replaced)
        runs, run = [], None
        for s in sorted((s for s in flat.slots if s.index in self._views), key=lambda s: s.local.start):
            if s.key in stepped:
                run = None
            elif run is None:
                run = [s.local.start, s.local.stop]
                runs.append(run)
            else:
                run[1] = s.local.stop
        buffers = self._buffers(flat)
        if runs:
            lives, twins = [], []
            for name, buf in buffers.items():
                lives += [buf[a:b] for a, b in runs]
                twins += [self.twin[name][a:b] for a, b in runs]
            torch._foreach_copy_(twins, lives)
        for name, buf in buffers.items():
            if _held_outside(buf):
                buf.copy_(self.twin[name])
            else:
                swap_storages(buf, self.twin[name])

    def versions(self, flat) -> tuple:
        """The version counters of what a step changes and the user can reach: ``opt.state``'s
        views of the step counts (written by the main thread) and of the state buffers (by the
        worker's steps). (The masters and the host copies are the optimizer's own.)"""
        return tuple(buf._version for buf in (flat.steps, *flat.state.values()))


def _held_outside(buf: Tensor) -> bool:
    """Whether ``buf``'s memory is held where a swap would not follow: moved into shared memory
    (``share_memory_()`` on ``opt.state``, A3C's shared optimizer: other processes map that
    memory) or viewed by NumPy (``.numpy()``, ``np.asarray``: the array keeps the address, and
    torch marks the storage not resizable for it). Such a buffer keeps its memory and takes the
    twin's values by a copy (8 B/param for AdamW's two moments, at each commit), so the user's
    views keep following ``opt.state``. (A raw address taken otherwise, ``data_ptr()`` or
    DLPack, leaves no mark: it sees the twin's memory after a swap.)"""
    storage = buf.untyped_storage()
    return storage.is_shared() or not storage.resizable()


def _aliases(alias: Tensor, weight: Tensor) -> bool:
    """Whether a kept 1-D ``alias`` still reads ``weight``'s elements in order."""
    return (
        alias.data_ptr() == weight.data_ptr()
        and alias.dtype == weight.dtype
        and alias.numel() == weight.numel()
        and weight.is_contiguous()
    )


# Each dtype's bits as an integer type of its width (a fingerprint sums bits, not values).
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def fingerprint(values: Tensor) -> Tensor:
    """Three int64 sums of the bits of 1-D ``values``: plain, squared and weighted by position
    (a cumulative sum), in exact wrap-around integer arithmetic on their device, so that the
    same values give the same fingerprint whatever the order of the additions, and a changed
    value, a swap of two values or a sign flip almost surely do not. ``mul_(1.0)`` keeps it."""
    bits = values.view(_BITS[values.dtype]).to(torch.int64)
    return torch.stack([bits.sum(), bits.square().sum(), bits.cumsum(0).sum()])
