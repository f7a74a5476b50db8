"""Which gradients have arrived in the backward now running: the per-parameter autograd hooks,
and their contract, written once here: the protocol :class:`HookTable`, and the values the
window and the table exchange, one call each way at each end of a backward the window sees: at
its start a :class:`Look` taken (what the user did to the parameters' nodes and ``.grad``) and a
:class:`Plan` handed to the hooks (their flags, and the fast path: folds and whole backwards
without Python, which only the C++ table acts on); at its end a :class:`Report` taken back (what
the hooks did that the window records) and the next plan handed, with ``.grad``'s views.

Two hooks sit on each parameter's AccumulateGrad node (the node that stores a leaf's ``.grad``):

* a pre-hook, before the node runs. While the plan's ``slow`` is set it first calls ``before_backward()``
  (the window's once-per-backward checks). It then usually takes the gradient into the
  parameter's place in its bucket itself and hands the node an undefined gradient, which
  AccumulateGrad skips: ``.grad`` is left alone (it keeps showing the window's fp32 running sum)
  and autograd stores nothing. A parameter with a user's post-accumulate-grad hook, or a user's
  post-hook on its node (``grad_fn.next_functions[0][0].register_hook``: the overlapped
  all-reduce of Megatron and DeepSpeed), is handed to ``fold_hooked(key, grad)``: True when the
  window folded it at once into the running sum that ``.grad`` shows; AccumulateGrad, handed an
  undefined gradient, still runs the user's hooks, which so see the sum as natively. Where
  AccumulateGrad must run (a double backward keeps the gradient's graph; a sparse or zero
  tensor; a parameter that no longer requires grad; a user's pre-hook on the node runs after
  ours and must be handed the gradient; a hooked one the window declined) the pre-hook leaves it
  the gradient, and while the plan's ``hide`` is set (the running sums are showing) hides a
  defined ``.grad``: else autograd would add the new gradient into the running sum itself, and
  it would be folded twice.
* a post-hook, after the node stored such a gradient in ``.grad`` (in its own dtype: the window
  sets ``grad_dtype = None`` on bf16/fp16 parameters). It takes it into the bucket (a sparse one
  is an error), or to ``fold_hooked`` where the user's post-hooks on the node follow, and shows
  the hidden ``.grad`` again (brought up to date when the bucket is folded).

A second gradient for one parameter in one backward (a parameter used inside and outside a
reentrant checkpoint) is summed into its place, as autograd would have summed it into ``.grad``.
When every parameter of a bucket has arrived the hooks call ``bucket_complete(bucket, grads)``,
grads in bucket order (None for one written in place). The first arrival of a backward calls
``queue_end()``, so the window sees the backward end. A backward that raises never ends: the
engine drops its final callbacks unrun. The window's callback notices that as it is dropped; a
quiet backward's (:class:`Plan`) calls ``backward_raised()``. The hooks call the window
with the GIL and without the table's lock held (it may call back: ``arrive_in_place``,
``clear``); an exception raised there reaches the caller of ``backward()`` unchanged. Several
threads may each run a backward of one model at once (torch adds their gradients under the
node's lock): their gradients of one bucket are summed alike, and every fold of a bucket, the
hooks' own or the window's, runs after the last one, never beside it (see :class:`Plan`).

Node hooks rather than tensor hooks: they run only when AccumulateGrad runs (not when
``torch.autograd.grad`` captures a gradient), after the tensor hooks users register (which may
change the gradient first), and next to them (assigning a tensor's Python hook dict would clear
C++ tensor hooks). The table keeps each hooked node alive: tensors hold their AccumulateGrad
weakly, and a node no graph references is rebuilt, without the hooks, by the next forward.

There are two implementations. ``fused_accum._C.Arrivals`` (csrc/hooks.cpp) runs the hooks in
C++: a few pointer operations per parameter, Python at most once per bucket and per backward,
and not at all in a quiet one; it acts on the whole plan (``fast``). :class:`PythonArrivals` is its
twin in Python, which acts on the plan's flags only, used without the extension or when
``FUSED_ACCUM_PYTHON_HOOKS=1`` (several microseconds per parameter: the engine takes the GIL and
wraps tensors for each call; a fold called from Python saves nothing by skipping the window).
The window plans grants and quiet backwards only for a table whose ``fast`` is set.
tests/test_hooks.py holds both implementations to the protocol, member by member, and to the plan
and the report.

Every callback into Python that the autograd engine or the hooks make is :func:`_untraced`
(``torch.compiler.disable``): a ``torch.compile``d function that calls ``loss.backward()``
keeps Dynamo's frame callback set while the engine runs, and Dynamo would otherwise compile each
Python frame entered from the backward, tracing the window's state changes into graphs that
replay or drop them (tests/test_compiled_backward.py).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from torch._dynamo import compiled_autograd

from .extension import _C

logger = logging.getLogger("fused_accum")

_current_graph_task_id = torch._C._current_graph_task_id

# Wraps each callback the engine or the hooks make into Python (the hooks on the nodes, the
# window's callbacks, the window's end-of-backward callbacks). Inside a torch.compile'd function
# that calls backward(), Dynamo would trace these frames: the window's Python state changes (a
# step's lr filled in during backward, the topology decided, a running sum shown in .grad) would
# be traced into graphs and replayed or dropped. Eagerly it costs about 0.6 us per call (Dynamo's
# eval-frame callback set to None and back): once per bucket and per backward with the C++ hooks,
# twice per parameter with the Python ones.
_untraced = torch.compiler.disable


_PYTHON_HOOKS_UNDER_COMPILED_AUTOGRAD = (
    "fused_accum's Python hooks cannot fold a gradient under compiled autograd (its graph calls a "
    "Python pre-hook with no call before the graph, where the window's checks, count and .grad "
    "must be set): they need fused_accum's C++ hooks, which run with the built extension "
    "(fused_accum._C) unless FUSED_ACCUM_PYTHON_HOOKS=1; or run this backward without compiled "
    "autograd (torch._dynamo.config.compiled_autograd = False, or outside "
    "torch._dynamo.compiled_autograd._enable)"
)


def _brief(value) -> str:
    """A tensor as its dtype, shape and device (a plan or report prints on one line)."""
    if isinstance(value, torch.Tensor):
        return f"<{str(value.dtype).removeprefix('torch.')}{list(value.shape)} {value.device.type}>"
    return repr(value)


class Grant(NamedTuple):
    """A fast fold (see :class:`Plan`): bucket ``bucket``, when complete, is folded by the hooks
    into ``acc`` at ``offsets``, overwriting where ``overwrite`` (the window's first gradients:
    used once) else adding."""

    bucket: int
    acc: torch.Tensor
    offsets: torch.Tensor
    overwrite: bool

    def __repr__(self) -> str:
        return f"Grant({self.bucket}, {_brief(self.acc)}, offsets={self.offsets.tolist()}, overwrite={self.overwrite})"


class Plan(NamedTuple):
    """What the window lets its hooks do, handed whole (``HookTable.hand``) at the start of each
    backward the window sees and at its end (for the next ones), and after an event between
    backwards that changes a flag. The table holds it until the next one (``HookTable.plan``).

    The flags: ``stands_aside`` (another engine fills ``.grad``: DDP, FSDP2, the topology's
    ``stands_aside``; both hooks do nothing, and for good after ``detach_all()``); ``slow``
    (the pre-hook first calls ``before_backward()``, the window's once-per-backward checks);
    ``hide`` (the running sums show in ``.grad``: a gradient left to AccumulateGrad has the
    parameter's defined ``.grad`` hidden from it, shown again by the post-hook); ``seen`` (the
    graph task whose end the window queued itself: that backward ends there, it is not quiet).

    The fast path (acted on only by a table whose ``fast`` is set, the C++ one; the window
    plans none for the Python twin). ``grants``: the buckets the hooks fold themselves when
    complete (:class:`Grant`), without calling ``bucket_complete``, under the table's lock (so
    two threads' folds of a bucket run one after the other); a second completion in one
    backward is the window's; an overwrite is used once, an add stays while the plan does. A
    bucket whose gradients go to the window (``bucket_complete``, a report's ``partial``) loses
    its grant, as the window folds them; and a plan handed before the window took them back (in
    a callback of another thread's backward, or of a nested one) grants neither that bucket
    while ``bucket_complete`` runs nor an overwrite used since the last report.
    ``quiet_until``: backwards may run quietly, without calling Python at all, while the
    table's count of quiet backwards (``counters[1]``) is below it (0: none); each checks at
    its first gradient what ``before_backward`` would (``counters[0]``, the window's change
    counter, still holds ``at``, the value the plan was decided at; no ``.grad`` changed since
    it was exposed; nothing is left over from a backward that raised; not ``seen``; not a
    double backward) and queues its own end. One that stays quiet (every bucket folded by its
    grant, no backward nested in it, Python not called) is only counted, in ``counters[1]``;
    one that does not hands its end to the window (``queue_end()``), and one that raises calls
    ``backward_raised()`` unless the window saw it. ``counters``: the window's two int64 (an
    ``array("q")``, read and written in place: its change counter, and the table's count of
    quiet backwards, never reset)."""

    stands_aside: bool = False
    slow: bool = True
    hide: bool = False
    seen: int = -1
    grants: Tuple[Grant, ...] = ()
    quiet_until: int = 0
    counters: Optional[object] = None
    at: int = 0


class Report(NamedTuple):
    """What the hooks did that the window records, taken whole (``HookTable.report``) at the end
    of each backward and in any Python callback while an overwrite grant is out: the buckets an
    overwrite grant filled since the last report (their slots now hold the window's first
    gradient, which cannot be recorded from inside a hook), the partly arrived buckets, emptied
    (``[(bucket, grads)]``, taken only at the end), and the count of quiet backwards so far
    (``counters[1]``)."""

    overwritten: Tuple[int, ...] = ()
    partial: Tuple[Tuple[int, list], ...] = ()
    quiet: int = 0

    def __repr__(self) -> str:
        partial = ", ".join(f"({b}, [{', '.join(map(_brief, grads))}])" for b, grads in self.partial)
        return f"Report(overwritten={self.overwritten}, partial=[{partial}], quiet={self.quiet})"


class Look(NamedTuple):
    """What changed on the parameters' side since the window last looked (``HookTable.look``),
    found in one pass over them: ``moved``, the keys hooked again on a new AccumulateGrad node
    (a ``.data`` moved to another device or dtype by ``model.to(...)``: autograd builds a new
    node at the next forward, and asking for it builds it now, which the forward then uses; or
    a tensor swapped in by ``torch.utils.swap_tensors``: the old hooks would never see those
    gradients again); ``changed``, the keys whose ``.grad`` is no longer what was last shown
    (``HookTable.hand``'s ``show``): the user cleared or replaced it, or re-pointed it
    (``p.grad.data = t``)."""

    moved: Tuple[int, ...] = ()
    changed: Tuple[int, ...] = ()


@runtime_checkable
class HookTable(Protocol):
    """The hooks of one gradient window, by slot (a parameter's key, numbered from 0 in the
    order ``extend`` adds them, at a position of a bucket), and the window's per-parameter
    ``.grad`` work, which runs once per backward and would otherwise be a Python loop over every
    parameter. Made by :func:`make_arrivals` with the window's callbacks (see the module). The
    window talks to it one call each way at each end of a backward: at its start ``look`` and
    ``hand``, at its end ``report`` and ``hand`` (with ``.grad``'s views)."""

    # Whether the table acts on a plan's fast path (grants, quiet backwards): the C++ table.
    fast: bool

    def hand(self, plan: Plan, show: Optional[Tuple[Sequence[Optional[torch.Tensor]], Sequence[bool]]] = None) -> None:
        """The window's plan (see :class:`Plan`), in force until the next; it replaces the last
        one whole (grants not in it are revoked). A table without the fast path takes only
        the flags (a plan with grants or quiet backwards is an error there). With ``show``
        (``views, held``, by key), ``.grad`` first shows the window: ``.grad`` = ``views[key]``
        where ``held[key]``, else None where ``.grad`` was that view; what is shown is what
        :meth:`look` compares with. Nothing is shown once detached."""

    @property
    def plan(self) -> Plan:
        """The plan in force: the last one handed, less the overwrite grants used since."""

    def report(self, end: bool) -> Report:
        """What the hooks did since the last report (see :class:`Report`); with ``end`` (a
        backward ended, or raised) also the partly arrived buckets, emptied, their grants
        revoked."""

    def extend(
        self,
        bucket_sizes: Sequence[int],
        slot_bucket: Sequence[int],
        slot_position: Sequence[int],
        names: Sequence[str],
    ) -> None:
        """New buckets (numbered on from the last) and new slots (keys numbered on from the
        last), each slot at a position of a bucket, with the parameter's name for errors."""

    def attach(self, key: int, param: torch.Tensor) -> None:
        """Hooks slot ``key``'s parameter (a leaf that requires grad) on its AccumulateGrad node,
        which the table keeps alive. A slot is hooked once."""

    def look(self, params: Sequence[torch.Tensor]) -> Look:
        """One pass over the parameters (``params``, by key: the Python objects the optimizer
        holds): the slots whose node was rebuilt, hooked again (nothing once detached), and the
        ``.grad`` the user changed since it was shown (:class:`Look`)."""

    def detach_all(self) -> None:
        """The hooks stand aside for good (the window was detached) and the nodes are let go. It
        may run inside one of the hooks (a backward that builds a newer optimizer)."""

    def arrive_in_place(self, key: int) -> None:
        """Slot ``key``'s gradient was written straight into its accumulator (a fused weight
        gradient): it counts as arrived, with None for its gradient. The caller has told the
        window of the backward itself (no ``queue_end()``)."""

    def clear(self) -> None:
        """Forgets every arrival, the plan's grants and quiet backwards (the plan in force keeps
        its flags), every hidden ``.grad``, and which backward was last seen (a backward that
        raised never ends)."""

    def clear_grads(self) -> bool:
        """Every hooked parameter's ``.grad`` becomes None (``zero_grad()``). False once detached
        (the nodes are let go): the caller then clears them itself."""

    def has_arrivals(self) -> bool:
        """Whether any bucket holds an arrival of the backward now running (or of one that
        raised)."""

    def compile_with(self, compiled_backward: Callable, compiled_first: Callable) -> None:
        """The window's callbacks under compiled autograd, which runs no hook: it asks each
        node's hooks, once per backward it captures and before the captured graph runs, what
        to put in the graph. At the first hooked parameter of such a backward the table calls
        ``compiled_backward()`` (the window's checks and count, as ``before_backward`` and the
        end of a backward in eager); it returns, by key, ``(fold, show, view)`` or None (for a
        None the table first asks ``compiled_first(key)``: the slot's first gradient of the
        window, recorded, and the triple returned overwrites). Each parameter's node then gets
        ``fold`` as a pre-hook and ``show`` as a post-hook, Python functions Dynamo traces into
        the graph (fused_accum.compiled_backward.fold and show: the custom op
        ``fused_accum::accumulate_`` into ``view``, AccumulateGrad handed no gradient, then
        ``.grad`` = ``view``); ``.grad`` is None until the graph runs (a bf16 parameter's fp32
        ``.grad`` cannot be made a FakeTensor for the capture). A parameter with a
        post-accumulate-grad hook is refused (it would run before ``show``). The C++ table
        only: the Python hooks are plain Python hooks, which compiled autograd traces with no
        call before the graph, so they refuse compiled autograd with an error that says so."""


def make_arrivals(
    before_backward: Callable,
    queue_end: Callable,
    bucket_complete: Callable,
    fold_hooked: Callable,
    backward_raised: Callable,
) -> HookTable:
    """The C++ hooks (``fast``) where the extension is built, else the Python ones."""
    callbacks = tuple(_untraced(c) for c in (before_backward, queue_end, bucket_complete, fold_hooked, backward_raised))
    if os.environ.get("FUSED_ACCUM_PYTHON_HOOKS") == "1":
        return PythonArrivals(*callbacks)
    if _C is None or not hasattr(_C, "Arrivals"):
        return PythonArrivals(*callbacks)
    return _C.Arrivals(*callbacks)


class _Bucket:
    __slots__ = ("grads", "arrived", "count")

    def __init__(self, size: int):
        self.grads = [None] * size  # by position: the gradient that arrived as a tensor
        self.arrived = [False] * size  # as a tensor or written in place
        self.count = 0

    def take(self) -> list:
        grads = self.grads
        self.grads = [None] * len(grads)
        self.arrived = [False] * len(grads)
        self.count = 0
        return grads


def _pre_hook(arrivals_ref, param_ref, key, grad_outputs):
    # Not _untraced itself: compiled autograd's graph calls it (traced by Dynamo, or eagerly
    # where its backend allows graph breaks), and a fullgraph capture would otherwise stop at
    # Dynamo's "torch.compiler.disable()d function" rather than say why.
    if compiled_autograd.in_compiled_autograd_region:
        raise RuntimeError(_PYTHON_HOOKS_UNDER_COMPILED_AUTOGRAD)
    return _eager_pre_hook(arrivals_ref, param_ref, key, grad_outputs)


@_untraced  # (registered on the AccumulateGrad nodes: see _untraced)
def _eager_pre_hook(arrivals_ref, param_ref, key, grad_outputs):
    arrivals, param = arrivals_ref(), param_ref()
    if arrivals is not None and param is not None:
        return arrivals._before_accumulate(key, param, grad_outputs)
    return None


@_untraced  # (registered on the AccumulateGrad nodes: see _untraced)
def _post_hook(arrivals_ref, param_ref, key, grad_inputs, grad_outputs):
    if grad_outputs[0] is None:
        return  # the pre-hook took the gradient (or there was none)
    arrivals, param = arrivals_ref(), param_ref()
    if arrivals is not None and param is not None:
        arrivals._after_accumulate(key, param)


class PythonArrivals:
    """``fused_accum._C.Arrivals`` in Python: a :class:`HookTable`, without the fast path (see the
    module)."""

    def __init__(
        self,
        before_backward: Callable,
        queue_end: Callable,
        bucket_complete: Callable,
        fold_hooked: Callable,
        backward_raised: Callable,
    ):
        self._before_backward = before_backward
        self._queue_end = queue_end
        self._bucket_complete = bucket_complete
        self._fold_hooked = fold_hooked
        # (never called here: no backward runs quietly, so the window sees every one that raised)
        self._backward_raised = backward_raised
        self._plan = Plan()  # (only its flags are acted on here: no fast path)
        self._detached = False
        self._buckets: list = []
        self._slot_bucket: list = []
        self._slot_position: list = []
        self._names: list = []  # by key, for errors
        self._nodes: dict = {}  # key -> the AccumulateGrad node hooked (kept alive: see attach)
        self._own: dict = {}  # key -> our (pre-hook, post-hook) handles on that node
        self._hidden: dict = {}  # key -> the .grad the pre-hook hid, until the post-hook
        self._shown: dict = {}  # key -> what hand's show set .grad to
        self._handles: list = []
        self._lock = threading.Lock()
        self._last_task = -1  # the graph task whose end the window was last asked to see

    fast = False

    def hand(self, plan: Plan, show=None) -> None:
        if plan.grants or plan.quiet_until > (plan.counters[1] if plan.counters is not None else 0):
            raise ValueError(f"PythonArrivals has no fast path: {plan}")
        if show is not None:
            self._expose(*show)
        self._plan = plan

    @property
    def plan(self) -> Plan:
        return self._plan

    def report(self, end: bool) -> Report:
        partial = ()
        if end:
            with self._lock:
                partial = tuple((i, b.take()) for i, b in enumerate(self._buckets) if b.count)
        return Report((), partial, 0)

    def extend(self, bucket_sizes, slot_bucket, slot_position, names) -> None:
        with self._lock:
            self._buckets.extend(_Bucket(size) for size in bucket_sizes)
            self._slot_bucket.extend(slot_bucket)
            self._slot_position.extend(slot_position)
            self._names.extend(names)

    def attach(self, key: int, param: torch.Tensor) -> None:
        if key in self._nodes:
            raise RuntimeError(f"Arrivals.attach: slot {key} is already hooked")
        self._hook(key, param, torch.autograd.graph.get_gradient_edge(param).node)

    def _hook(self, key: int, param: torch.Tensor, node) -> None:
        this, param_ref = weakref.ref(self), weakref.ref(param)
        own = (
            node.register_prehook(functools.partial(_pre_hook, this, param_ref, key)),
            node.register_hook(functools.partial(_post_hook, this, param_ref, key)),
        )
        self._handles.extend(own)
        self._own[key] = own
        # Tensors hold their AccumulateGrad weakly: a node no graph references is rebuilt,
        # without our hooks, by the next forward. Holding it keeps the hooks.
        self._nodes[key] = node

    def look(self, params: list) -> Look:
        moved = []
        for key, node in list(self._nodes.items()):  # (none once detached)
            param = params[key]
            if not (param.requires_grad and param.is_leaf):
                continue
            now = torch.autograd.graph.get_gradient_edge(param).node
            if now is not node:
                self._hook(key, param, now)
                moved.append(key)
        return Look(tuple(moved), self._changed())

    def detach_all(self) -> None:
        self._detached = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()
        self._own.clear()

    def _standing_aside(self) -> bool:
        return self._detached or self._plan.stands_aside

    def _before_accumulate(self, key: int, param, grads):
        if self._standing_aside():
            return None
        if self._plan.slow:
            self._before_backward()
            if self._standing_aside():
                return None
        grad = grads[0]
        if grad is None:
            return None
        plain = (
            grad.layout == torch.strided
            and not grad._is_zerotensor()
            and param.requires_grad
            and not torch.is_grad_enabled()
        )
        user_pre, user_post = self._user_hooks(key)
        if plain and not user_pre:
            if not user_post and not param._post_accumulate_grad_hooks:
                self._arrive(key, grad)
                return (None,)
            if self._fold_hooked(key, grad):
                return (None,)
        if self._plan.hide and param.grad is not None:
            with self._lock:
                self._hidden[key] = param.grad
            param.grad = None
        return None

    def _after_accumulate(self, key: int, param) -> None:
        if self._standing_aside():
            return
        grad = param.grad
        with self._lock:
            param.grad = self._hidden.pop(key, None)
        if grad is None:
            return  # (dropped: the parameter no longer requires grad)
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self._names[key]} received a sparse gradient; sparse gradients are not supported"
            )
        if self._user_hooks(key)[1] and self._fold_hooked(key, grad):
            return
        self._arrive(key, grad)

    def _user_hooks(self, key: int) -> tuple:
        """The user's hooks on slot ``key``'s node, beside ours (hooks.cpp's user_hooks): a
        pre-hook that runs after ours, a post-hook. Python hooks on one node share a dict (one
        for pre-hooks, one for post-hooks), in the order they run."""
        pre, post = self._own[key]
        pre_hooks, post_hooks = pre.hooks_dict_ref(), post.hooks_dict_ref()
        user_pre = pre_hooks is not None and next(reversed(pre_hooks)) != pre.id
        return user_pre, post_hooks is not None and len(post_hooks) > 1

    def arrive_in_place(self, key: int) -> None:
        self._arrive(key, None)

    def _arrive(self, key: int, grad) -> None:
        complete = None
        with self._lock:
            index = self._slot_bucket[key]
            bucket, position = self._buckets[index], self._slot_position[key]
            if grad is not None:
                held = bucket.grads[position]
                bucket.grads[position] = grad if held is None else held + grad
            if not bucket.arrived[position]:
                bucket.arrived[position] = True
                bucket.count += 1
                if bucket.count == len(bucket.arrived):
                    complete = (index, bucket.take())
        if grad is not None:
            self._note_task()  # (in place: the caller already told the window)
        if complete is not None:
            self._bucket_complete(*complete)

    def _note_task(self) -> None:
        task = _current_graph_task_id()
        with self._lock:
            if task == self._last_task:
                return
            self._last_task = task
        self._queue_end()

    def clear(self) -> None:
        with self._lock:
            for bucket in self._buckets:
                bucket.take()
            self._hidden.clear()
            self._last_task = -1

    def _expose(self, views: list, held: list) -> None:
        if self._detached:
            return
        with self._lock:
            for key, node in self._nodes.items():
                param, view = node.variable, views[key]
                if held[key] and view is not None:
                    if param.grad is not view:
                        param.grad = view
                    self._shown[key] = (view, view.data_ptr())
                else:
                    if view is not None and param.grad is view:
                        param.grad = None
                    self._shown.pop(key, None)

    def clear_grads(self) -> bool:
        if self._detached:
            return False
        with self._lock:
            for node in self._nodes.values():
                node.variable.grad = None
            self._shown.clear()
        return True

    def _changed(self) -> tuple:
        with self._lock:
            changed = []
            for key, node in self._nodes.items():
                grad, (view, data) = node.variable.grad, self._shown.get(key, (None, None))
                # (the same tensor re-pointed by `p.grad.data = t` is a change too)
                if grad is not view or grad is not None and grad.data_ptr() != data:
                    changed.append(key)
            return tuple(changed)

    def has_arrivals(self) -> bool:
        with self._lock:
            return any(b.count for b in self._buckets)

    def compile_with(self, compiled_backward: Callable, compiled_first: Callable) -> None:
        pass  # (never called: the pre-hook refuses compiled autograd, see HookTable.compile_with)
