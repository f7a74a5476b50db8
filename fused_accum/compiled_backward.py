"""A backward captured by compiled autograd (``torch._dynamo.config.compiled_autograd``): what
the window puts in its graph.

Compiled autograd runs no hook. Before it runs the graph it captured (a cache hit included), it
asks each node's hooks what to put in that graph (``compiled_args``: ``csrc/hooks.cpp``'s
``Arrivals::compiled_pre_hook``, through the hooks' table's ``compile_with``), and it drops the
callbacks queued on the engine, so no end of backward is ever seen. So:

- at the first hooked parameter of such a backward, :func:`capture` does at once what the
  window does at the start and at the end of an eager backward (the user's edits taken, the
  micro-batch counted, ``.grad`` shown), and hands the table what the graph folds each slot with;
- each slot's fold enters the graph as a pre-hook of its AccumulateGrad that Dynamo traces: the
  custom op ``fused_accum::accumulate_`` into the slot's fp32 view (:func:`fold`; AccumulateGrad
  is handed no gradient), then a post-hook setting ``.grad`` to that view (:func:`show`);
- a slot without a gradient in the window yet is recorded as holding one when the capture first
  reaches it, and its fold overwrites (:meth:`CapturedFolds.first`).

Covered: one process, the step on the device; the topology and the placement refuse the others
(``compiled_autograd_refusal``). The tests: ``tests/test_compiled_autograd.py``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import ops

_ALONE = torch.zeros(1, dtype=torch.int64)  # the offset of a slot's gradient in its own view

_REFUSED = (
    "{label} cannot take gradients from a compiled autograd backward with {refusal}. Run this backward "
    "without compiled autograd (torch._dynamo.config.compiled_autograd = False, or outside "
    "torch._dynamo.compiled_autograd._enable); torch.compile(model) with an eager backward is supported"
)


def fold(view: Tensor, overwrite: bool, backend: str, grads: list) -> tuple:
    """A slot's fold, the pre-hook before its AccumulateGrad in the captured graph: the custom op
    ``fused_accum::accumulate_`` into ``view``, the slot's fp32 view; AccumulateGrad is handed no
    gradient. (One op per parameter rather than per bucket: the graph holds no bucket; the
    kernel is element-wise, so the bits are the bucket's.) ``grads[0]`` is None where a fused
    weight gradient (fused_accum.nn) wrote the slice."""
    grad = grads[0]
    if grad is not None:
        ops.accumulate(view.view(-1), _ALONE, [grad], 1.0, overwrite, None, None, backend)
    return (None,)


def show(param: Tensor, view: Tensor, outputs: list, inputs: list) -> None:
    """The post-hook after the parameter's AccumulateGrad in the captured graph: ``.grad`` shows
    the slot's view, the running sum, as after an eager backward."""
    param.grad = view


def capture(window) -> list:
    """Compiled autograd captures a backward that reaches ``window``'s parameters (once per
    backward, before its graph runs): the checks of an eager backward's start, the micro-batch
    counted and ``.grad`` shown, as at an eager backward's end; returned, by key, what the graph
    folds each slot with (:meth:`CapturedFolds.all`)."""
    with window.lock, window.ledger.planning():
        refusal = window.resolve_topology().compiled_autograd_refusal or window.placement.compiled_autograd_refusal
        if refusal is not None:
            raise RuntimeError(_REFUSED.format(label=window.label, refusal=refusal))
        window.take_edits()
        window.count_captured()
        return window.captured.all()


class CapturedFolds:
    """By slot, the hooks a captured graph holds: ``(fold, show, view)``. The same objects are
    handed while nothing changes (Dynamo guards on the hooks it traces: new objects each backward
    would recompile the graph)."""

    def __init__(self, ledger, flat_groups: list) -> None:
        self.ledger = ledger
        self.flat_groups = flat_groups
        self._all: list = []  # by key, at the change count _at
        self._at: Optional[int] = None
        self._hooks: dict = {}  # (key, overwrite) -> (fold, show, view)

    def all(self) -> list:
        """By key, ``(fold, show, view)`` where the slot holds a gradient of the window (an add),
        None where it holds none yet (the hooks then ask :meth:`first`). Kept while the window's
        change counter keeps its value (a window's middle backwards change nothing)."""
        if self._at != self.ledger.changes[0]:
            self._all = [self._of(s, False) if s.has_grad else None for s in self.ledger.slots]
            self._at = self.ledger.changes[0]
        return self._all

    def first(self, slot, topology) -> tuple:
        """``slot``'s first gradient of the window, in the backward being captured: recorded now
        (its graph runs after), and folded by overwriting."""
        self.ledger.captured_first([slot])
        topology.added()
        return self._of(slot, True)

    def _of(self, slot, overwrite: bool) -> tuple:
        key = (slot.key, overwrite)
        hooks = self._hooks.get(key)
        if hooks is None or hooks[2] is not slot.grad_view:
            view, backend = slot.grad_view, self.flat_groups[slot.flat_index].backend
            hooks = (functools.partial(fold, view, overwrite, backend), functools.partial(show, slot.param, view), view)
            self._hooks[key] = hooks
        return hooks
