"""The host side's machinery of ``offload="cpu"`` (fused_accum.offload): one worker thread that
runs the host steps in order, and the transfers between the device and the host.

On a GPU each transfer runs on a side stream, stream-ordered after the device's work, and
returns its event (the worker synchronizes on it); on a CPU it runs on the worker, in order,
with nothing to wait for.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable, Optional

import torch

# A test's hook: called by the worker before each task (tests/test_offload.py makes the worker
# slow and its timing random with it, to show the next forward never sees half a step).
WORKER_DELAY: Optional[Callable[[], None]] = None


class Worker:
    """One host thread that runs tasks in order; an error is raised again by :meth:`drain`."""

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
