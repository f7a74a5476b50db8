"""The operations of fused_accum, each declared once, and called here.

Adding an algorithm: the checklist is at the top of :mod:`fused_accum.algorithms`.

**The declarations.** An op's arguments are written once, as typed records (``NamedTuple`` classes):

- ``accumulate``: :class:`Accumulate`;
- ``fold_pieces``: :class:`FoldPieces` (several same-sized pieces summed into one accumulator,
  in order: the receive side of issue 38's reduce-scatter);
- every step op: :class:`StepTensors` (the tensor lists and device scalars all steps take),
  then its own state lists (a record of one list per :class:`~fused_accum.registry.State` of
  its algorithm, named for its torch state key plus "s": ``op.states``), then its
  hyper-parameter record (the algorithm's ``hyper``, built from a param group: ``op.hyper``);
  :class:`StepOp` puts the three together. :func:`declare_step` makes one from an algorithm's
  record when :mod:`fused_accum.registry` registers it (:data:`STEP_OPS`; each is also
  ``ops.<name>``, its custom op ``ops.<name>_``).

From them follow, in field order, with ``Written`` fields marked ``(x!)`` (what the op mutates):

- the custom ops ``fused_accum::<op>_`` (their schema plus ``str backend``): what
  ``torch.compile`` traces;
- the C++ extension's ``fused_accum_ext::<op>_``: :mod:`fused_accum.backends.ext` defines them
  from :func:`ext_schemas` once ``_C`` has registered its kernels, and the dispatcher then
  checks each C++ kernel's parameter types against the declaration (a mismatch is refused with
  both signatures, naming the first differing argument);
- the backend contract: each backend's ``step(op, t, s, h)`` takes the op and its three records
  (contracts and conventions in :mod:`fused_accum.backends.reference`, which specifies each
  op in a function of its name); ``accumulate`` keeps its flat
  arguments (its call is the per-micro-batch hot path, and ``csrc/hooks.cpp`` calls
  ``fused_accum_ext::accumulate_`` with that typed signature).

``tests/test_ops.py`` checks the registered schemas of both namespaces, and the signatures of
``accumulate`` here and in every backend, against the declarations.

**The calls.** Callers use the plain names (``accumulate``, a step op): they go
through the custom op while torch.compile traces, and straight to the backend in eager mode,
where the custom-op wrapper costs ~30 us per call plus ~0.2 us per tensor (accumulate on the cpu
backend, one thread, warm caches, ``ops.accumulate_`` timed against ``ops.accumulate`` on the
same arguments: 36 us against 3.4 us for one tensor, 0.80 ms against 0.37 ms for 2,048 tensors
of 256), more than a GPU spends on a bucket's kernel. Each op takes the name of an
already-resolved backend (see :mod:`fused_accum.backends`).

Optional tensor lists (``lp_params``, ``remainders``, the fused step's ``grads``, amsgrad's
running max) are empty when absent: custom-op schemas have no optional list type.

``plan=`` (eager calls of accumulate and the steps only): an optional hashable the caller never
reuses for other parameters, promising that the calls with it pass the same parameters' tensors
(what exactly it promises: ``fused_accum.backends.triton.accumulate`` and ``_step``). It lets
the triton backend skip re-reading what cannot have changed (issue 10 item 5: 2,048 tensors
read for 1.5 ms per accumulate, 4 ms per AdamW step without it); backends that need no such hint
never see it, and torch.compile traces the op without it (a host-side cache key, nothing to
trace).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import backends

# --- the argument types ----------------------------------------------------------------------

WRITTEN = "written"  # the mark of an argument the op writes in place
Lists = List[Tensor]  # one tensor per parameter (or per gradient)
WrittenLists = Annotated[List[Tensor], WRITTEN]
WrittenTensor = Annotated[Tensor, WRITTEN]
WrittenOptional = Annotated[Optional[Tensor], WRITTEN]

_SCHEMA_TYPES = {
    Tensor: "Tensor",
    List[Tensor]: "Tensor[]",
    Optional[Tensor]: "Tensor?",
    float: "float",
    Optional[float]: "float?",  # a hyper-parameter that may be None (AdEMAMix's t_alpha_beta3)
    bool: "bool",
}


class Argument(NamedTuple):
    """One argument of an op's schema, from a record's field."""

    name: str
    type: str  # the schema's type: Tensor, Tensor[], Tensor?, float, float?, bool
    written: bool


def arguments(*records: type) -> tuple:
    """The schema arguments of ``records``' fields, in order."""
    out = []
    for record in records:
        hints = typing.get_type_hints(record, include_extras=True)
        for name in record._fields:
            hint = hints[name]
            written = typing.get_origin(hint) is Annotated and WRITTEN in hint.__metadata__
            if typing.get_origin(hint) is Annotated:
                hint = typing.get_args(hint)[0]
            out.append(Argument(name, _SCHEMA_TYPES[hint], written))
    return tuple(out)


def schema(name: str, args: Sequence[Argument]) -> str:
    """``name(<args>) -> ()``, each written argument with an alias set of its own: Tensor(a!)[]."""
    parts, letters = [], iter("abcdefghijklmnopqrstuvwxyz")
    for arg in args:
        kind = arg.type
        if arg.written:
            base, suffix = kind.split("Tensor")  # "", "[]" or "?"
            kind = f"{base}Tensor({next(letters)}!){suffix}"
        parts.append(f"{kind} {arg.name}")
    return f"{name}({', '.join(parts)}) -> ()"


def _custom_op(name: str, args: Sequence[Argument], body):
    """The custom op ``fused_accum::<name>`` of ``args`` plus the backend's name, which calls
    ``body(*args, backend)``; its fake implementation does nothing (the ops only mutate)."""
    op = torch.library.custom_op(
        f"fused_accum::{name}",
        body,
        mutates_args=tuple(a.name for a in args if a.written),
        schema=schema(name, (*args, Argument("backend", "str", False)))[len(name) :],
    )
    op.register_fake(lambda *args: None)
    return op


def _hint(backend: str, plan) -> dict:
    # only a backend whose functions take ``plan=`` is passed it (the registry says which)
    return {"plan": plan} if plan is not None and backends.takes_plan(backend) else {}


# --- accumulate ------------------------------------------------------------------------------


class Accumulate(NamedTuple):
    """accumulate's arguments: ``acc[slice i] = alpha * grads[i] + (0 if overwrite else
    acc[slice i])``, and the window's norm terms (contract: ``reference.accumulate``)."""

    acc: WrittenTensor  # the flat fp32 accumulator
    offsets: Tensor  # int64, CPU: where each gradient's slice of acc starts
    grads: Lists
    alpha: float
    overwrite: bool
    found_inf: WrittenOptional = None
    sumsq: WrittenOptional = None


def _accumulate(*args) -> None:  # the custom op's body: Accumulate's fields, then the backend
    *args, backend = args
    backends.get(backend).accumulate(*args)


accumulate_ = _custom_op("accumulate_", arguments(Accumulate), _accumulate)


def accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor],
    sumsq: Optional[Tensor],
    backend: str,
    plan=None,
) -> None:
    """Run accumulate_: the custom op under torch.compile, the backend directly otherwise
    (the arguments of :class:`Accumulate`, then the backend's name)."""
    if torch.compiler.is_compiling():
        return accumulate_(acc, offsets, grads, alpha, overwrite, found_inf, sumsq, backend)
    backends.get(backend).accumulate(acc, offsets, grads, alpha, overwrite, found_inf, sumsq, **_hint(backend, plan))


# --- fold_pieces -----------------------------------------------------------------------------


class FoldPieces(NamedTuple):
    """fold_pieces' arguments: ``acc = (((acc + f32(pieces[0])) + f32(pieces[1])) + ...)``, one
    fp32 add per piece in list order, or with ``overwrite`` ``acc = ((f32(pieces[0]) +
    f32(pieces[1])) + ...)``, starting from ``pieces[0]`` itself (a -0.0 stays -0.0). The
    receive side of a reduce-scatter by all-to-all: the pieces are the ranks' contributions to
    this rank's shard, in rank order, so every backend gives the same bits (issue 38; contract:
    ``reference.fold_pieces``)."""

    acc: WrittenTensor  # 1-D contiguous fp32
    pieces: Lists  # >= 1 tensors of acc's numel, all bf16, all fp16 or all fp32
    overwrite: bool


def _fold_pieces(*args) -> None:  # the custom op's body: FoldPieces' fields, then the backend
    *args, backend = args
    backends.get(backend).fold_pieces(*args)


fold_pieces_ = _custom_op("fold_pieces_", arguments(FoldPieces), _fold_pieces)


def fold_pieces(acc: Tensor, pieces: List[Tensor], overwrite: bool, backend: str) -> None:
    """Run fold_pieces_: the custom op under torch.compile, the backend directly otherwise (the
    arguments of :class:`FoldPieces`, then the backend's name). One kernel launch on the GPU
    backends when the pieces are the rows of one [N, n] buffer (see each backend's
    ``fold_pieces``)."""
    if torch.compiler.is_compiling():
        return fold_pieces_(acc, pieces, overwrite, backend)
    backends.get(backend).fold_pieces(acc, pieces, overwrite)


# --- the steps -------------------------------------------------------------------------------


class StepTensors(NamedTuple):
    """What every step op takes first: the tensor lists (one tensor per parameter, in the same
    order), the device scalars, and how a fused last micro-batch folds in (contracts:
    :mod:`fused_accum.backends.reference`). Pass the fields that have a default by name: a new
    one may be declared among them (as issue 28's int16 remainders were, after ``lp_params``)."""

    params: WrittenLists  # what the step updates: fp32 masters, or the parameters themselves
    accs: Lists  # fp32 views of the accumulator
    steps: Tensor  # fp32, one step count per tensor, counting this step
    lr: Tensor  # one element, fp64 (or fp32)
    coef: Tensor  # one fp32 element: multiplies the accumulated gradient
    lp_params: WrittenLists = ()  # the low-precision parameters that receive params rounded
    # int16, one per param: with bf16 params (the parameters themselves) the low halves of
    # their fp32 masters, rebuilt and split again by the step (reference.split_master); then
    # lp_params is empty (issue 28)
    remainders: WrittenLists = ()
    grads: Lists = ()  # the window's last micro-batch, fused into this step
    found_inf: Optional[Tensor] = None  # one fp32 element: non-zero skips the whole step
    grad_alpha: float = 1.0  # grads' weight
    grads_overwrite: bool = False  # the gradient is grad_alpha * grads alone, not acc + it
    # Empty, or where the step READS the old values of everything it changes (issue 37:
    # offload's double-buffered host state, an out-of-place step from the live buffers into
    # their twins): one tensor per tensor of each list the step writes, the lists in this order:
    # params, lp_params (if any), remainders (if any), then the op's state lists that it writes
    # (its states record's non-empty lists in field order; SGD's momentum_buffers only with
    # momentum), so sources[k * len(params) + i] holds the old values of the k-th written list's
    # tensor i: same dtype and numel, any shape, overlapping nothing the step writes. The step
    # then writes every element of every written tensor (a skipped step, found_inf, copies the
    # sources over) and leaves the sources as they were. Host (CPU) backends only: cuda and
    # triton refuse it (contract: reference.take_sources).
    sources: Lists = ()


def _plain(x):
    """A record's field as the schema takes it: a tuple of tensors (a default ``()``) as a list."""
    return list(x) if isinstance(x, tuple) else x


class StepOp:
    """One fused step op: :class:`StepTensors`, then its ``states`` record, then its ``hyper``
    record. ``op(t, s, h, backend, plan=None)`` runs it (``plan``: see the module docstring);
    ``op.custom_op`` is ``fused_accum::<name>_``."""

    def __init__(self, name: str, states: type, hyper: type) -> None:
        self.name = name  # the reference's spec function of it, and "<name>_" its custom ops
        self.states = states
        self.hyper = hyper
        self.arguments = arguments(StepTensors, states, hyper)
        # torch's state key of each list: exp_avgs -> exp_avg (opt.state[p][key])
        self.state_keys = tuple(field[:-1] for field in states._fields)
        self._sizes = (len(StepTensors._fields), len(states._fields))
        self.custom_op = _custom_op(f"{name}_", self.arguments, self._traced)

    def __repr__(self) -> str:
        return f"StepOp({self.name!r}, {self.states.__name__}, {self.hyper.__name__})"

    def __call__(self, t: StepTensors, s, h, backend: str, plan=None) -> None:
        if torch.compiler.is_compiling():
            return self.custom_op(*self.flatten(t, s, h), backend)
        backends.get(backend).step(self, t, s, h, **_hint(backend, plan))

    def _traced(self, *args) -> None:  # the custom op's body
        *flat, backend = args
        backends.get(backend).step(self, *self.unflatten(flat))

    def flatten(self, t: StepTensors, s, h) -> list:
        """The three records as the schema's positional arguments (lists as lists)."""
        return [*map(_plain, t), *map(_plain, s), *h]

    def unflatten(self, args: Sequence) -> tuple:
        """The schema's positional arguments as (StepTensors, states, hyper)."""
        n_t, n_s = self._sizes
        return StepTensors(*args[:n_t]), self.states(*args[n_t : n_t + n_s]), self.hyper(*args[n_t + n_s :])

    def records(self, **fields) -> tuple:
        """(StepTensors, states, hyper) from their fields by name, the defaults for the rest:
        the flat keyword form of this op's arguments (tests and benchmarks)."""
        records = (StepTensors, self.states, self.hyper)
        unknown = set(fields).difference(*(record._fields for record in records))
        if unknown:
            raise TypeError(f"{self.name}: unexpected arguments {sorted(unknown)}")
        return tuple(record(**{k: fields[k] for k in record._fields if k in fields}) for record in records)

    def states_of(self, slot_states: Sequence[dict], keys: Sequence[str]):
        """The states record for slots whose state buffers are ``slot_states`` (torch's key ->
        tensor, one dict per slot): a list for each key in ``keys`` (what the param group keeps
        now: :func:`fused_accum.registry.state_keys`), empty for the others."""
        return self.states(*([st[key] for st in slot_states] if key in keys else [] for key in self.state_keys))


STEP_OPS: dict = {}  # op name -> StepOp, as the registered algorithms declare them
_OF_ALGORITHM: dict = {}  # algorithm name -> its StepOp


def _states_record(op_name: str, states: Sequence) -> type:
    """The op's optimizer-state lists as a record (``AdamStates`` for ``adam_step``): one written
    list of fp32 tensors per ``State`` (one tensor per parameter), named for its torch state
    key plus "s", in the kernels' column order; an optional one (``State.when``) defaults to
    ``()``, absent (SGD's momentum buffers without momentum, Adam's running max without amsgrad)."""
    name = "".join(part.title() for part in op_name.removesuffix("_step").split("_")) + "States"
    body = {"__module__": __name__, "__annotations__": {f"{s.key}s": WrittenLists for s in states}}
    body.update({f"{s.key}s": () for s in states if s.when is not None})
    return types.new_class(name, (NamedTuple,), exec_body=lambda namespace: namespace.update(body))


def declare_step(algorithm) -> StepOp:
    """The step op of ``algorithm`` (a :class:`fused_accum.registry.Algorithm`), declared now or,
    for an algorithm that shares another's update rule (adamw, adam's), the one declared then,
    which must take the same states and hyper-parameter record."""
    if algorithm.middle is not None:
        split = _OF_ALGORITHM[algorithm.name] = SplitStep(algorithm)
        return split
    op = STEP_OPS.get(algorithm.op)
    keys = tuple(s.key for s in algorithm.states)
    if op is None:
        op = STEP_OPS[algorithm.op] = StepOp(
            algorithm.op, _states_record(algorithm.op, algorithm.states), algorithm.hyper
        )
    elif (op.state_keys, op.hyper) != (keys, algorithm.hyper):
        raise ValueError(
            f"{algorithm.name}: {algorithm.op} is declared with states {op.state_keys} and {op.hyper.__name__}, "
            f"not {keys} and {algorithm.hyper.__name__}"
        )
    _OF_ALGORITHM[algorithm.name] = op
    return op


def _lists_record(name: str, fields: dict) -> type:
    """A record of tensor lists (``fields``: name -> ``Lists`` or ``WrittenLists``)."""
    body = {"__module__": __name__, "__annotations__": dict(fields)}
    return types.new_class(name, (NamedTuple,), exec_body=lambda namespace: namespace.update(body))


class SplitStep:
    """The step of an algorithm whose middle is not elementwise (its record's ``middle``:
    :class:`fused_accum.registry.Middle`), called as a :class:`StepOp` is, ``step(t, s, h,
    backend)``, on the same records: two elementwise ops around the middle.

    - ``<rule>_prologue`` (:class:`StepTensors`, the algorithm's state lists and ``updates``,
      written, then ``hyper``): the window's gradient read once, the state updated, the
      middle's input written into ``updates`` (fp32, one tensor per parameter, shaped as the
      weight: a matrix for the middle);
    - the middle, ``middle.run(updates, h)``: torch ops over each whole tensor;
    - ``<rule>_epilogue`` (:class:`StepTensors`, ``updates`` read: the middle's output, then
      ``hyper``): the update applied to the masters and the weights, in the formats every step
      writes (fp32 params, fp32 masters and their low-precision copies, remainders).

    Both are custom ops (``fused_accum::<rule>_prologue_``...) that ``torch.compile`` traces,
    specified in the reference as every step op is and run on the step's backend as every step
    op is (the C++ operators ``fused_accum_ext::<rule>_prologue_``...: :func:`kernel_ops`), one
    launch each per call. ``updates`` is allocated per step (as torch.optim allocates its
    update): 4 B/param, freed after the step."""

    def __init__(self, algorithm) -> None:
        rule = algorithm.op.removesuffix("_step")
        self.name = algorithm.op
        self.middle = algorithm.middle
        self.states = _states_record(algorithm.op, algorithm.states)
        self.state_keys = tuple(s.key for s in algorithm.states)
        self.hyper = algorithm.hyper
        title = rule.title()
        lists = {f"{s.key}s": WrittenLists for s in algorithm.states}
        self.prologue = StepOp(
            f"{rule}_prologue", _lists_record(f"{title}PrologueLists", {**lists, "updates": WrittenLists}), self.hyper
        )
        self.epilogue = StepOp(
            f"{rule}_epilogue", _lists_record(f"{title}EpilogueLists", {"updates": Lists}), self.hyper
        )

    def __repr__(self) -> str:
        return f"SplitStep({self.prologue.name!r}, middle, {self.epilogue.name!r})"

    states_of = StepOp.states_of

    def __call__(self, t: StepTensors, s, h, backend: str, plan=None) -> None:
        weights = t.lp_params or t.params  # (fp32 masters are 1-D: their weights have the shape)
        updates = [torch.empty(w.shape, dtype=torch.float32, device=w.device) for w in weights]
        self.prologue(t, self.prologue.states(*s, updates), h, backend)
        self.epilogue(t, self.epilogue.states(self.middle.run(updates, h)), h, backend)


def step_op(algorithm: str) -> StepOp:
    """The step op of fused algorithm ``algorithm`` (its hyper-parameters: ``op.hyper.of``)."""
    return _OF_ALGORITHM[algorithm]


def kernel_ops() -> list:
    """Every op a backend implements in its ``step``: each step op (:data:`STEP_OPS`), and each
    split step's prologue and epilogue (:class:`SplitStep`)."""
    split = [(op.prologue, op.epilogue) for op in _OF_ALGORITHM.values() if isinstance(op, SplitStep)]
    return [*STEP_OPS.values(), *(op for pair in split for op in pair)]


def __getattr__(name: str):
    """``ops.<op name>``, a declared step op (or a split step's prologue or epilogue), and
    ``ops.<op name>_``, its custom op."""
    op = next((op for op in kernel_ops() if op.name == name.removesuffix("_")), None)
    if op is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return op.custom_op if name.endswith("_") else op


def ext_schemas() -> dict:
    """The schemas of the C++ extension's operators (``fused_accum_ext::<name>``): the
    declarations, without the backend's name."""
    declared = {
        "accumulate_": arguments(Accumulate),
        "fold_pieces_": arguments(FoldPieces),
        **{f"{op.name}_": op.arguments for op in kernel_ops()},
    }
    return {name: schema(name, args) for name, args in declared.items()}


# --- the weight-gradient GEMM (fused_accum.nn) -----------------------------------------------


def _wgrad_accumulate(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool, backend: str) -> None:
    # acc[N, K] = (0 if overwrite else acc) + grad_output[..., N]^T @ input[..., K], fp32
    # accumulation: the weight gradient of a Linear written into its fp32 accumulator slice
    # (contract in fused_accum.backends.wgrad; each backend's function: the registry's).
    backends.wgrad_kernel(backend, acc.device)(acc, grad_output, input, overwrite)


wgrad_accumulate_ = torch.library.custom_op("fused_accum::wgrad_accumulate_", mutates_args=("acc",))(_wgrad_accumulate)


@wgrad_accumulate_.register_fake
def _(acc, grad_output, input, overwrite, backend):
    return None


def wgrad_accumulate(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool, backend: str) -> None:
    """Run wgrad_accumulate_: the custom op under torch.compile, the backend directly otherwise."""
    op = wgrad_accumulate_ if torch.compiler.is_compiling() else _wgrad_accumulate
    op(acc, grad_output, input, overwrite, backend)
