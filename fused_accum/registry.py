"""What a fused algorithm is, and the registered ones: the layers ask here, by name, and never
name one themselves.

An algorithm is one :class:`Algorithm` record: torch's defaults and checks, the state buffers it
keeps per parameter (:class:`State`), the hyper-parameter record its step op takes, read from a
param group. :mod:`fused_accum.algorithms` registers each (:func:`register`) when the package is
imported; registering declares its step op in :mod:`fused_accum.ops`. The optimizer, the stepper
and the members read the records through the functions below; the backends find an algorithm's
update rule by its op's name.

Pure: no buffers, no kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import ops


@dataclasses.dataclass(frozen=True)
class State:
    """One optimizer-state buffer of an algorithm: fp32, one per parameter, shown as
    ``opt.state[p][key]``; its step op takes it as the list ``key + "s"``."""

    key: str
    # The param-group key that turns the buffer on (when true: SGD's momentum, Adam's amsgrad);
    # None: always kept. A buffer turned on after construction is allocated at the next step.
    when: Optional[str] = None
    # Its value before the first step: a number, or the param-group key that holds one.
    init: Union[float, str] = 0.0
    # The kernels set it from the first gradient (at a step count of 1: SGD's momentum buffer),
    # so the step counts restart when the buffer is turned on after construction.
    from_first_gradient: bool = False

    def initial(self, group: dict) -> float:
        """The buffer's value before its first step, for param group ``group``."""
        return scalar(group[self.init] if isinstance(self.init, str) else self.init)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A fused algorithm, as the layers see it (the checklist for adding one: the docstring of
    :mod:`fused_accum.algorithms`)."""

    name: str  # what optimizer= takes (lower case)
    defaults: dict  # the param groups' keys and torch's defaults, in torch's order
    states: tuple  # its State buffers, in the order its step op takes them (optional ones last)
    # the step op's scalar record: a NamedTuple of float, bool and Optional[float] fields (one
    # that may be None, AdEMAMix's t_alpha_beta3: the schema's float?), read by `reads`
    hyper: type
    check: Callable[[dict, bool], None]  # torch's checks of a group: check(group, constructor)
    has_step: bool  # torch keeps a ``step`` entry in its state
    # Its step op (fused_accum.ops.STEP_OPS): "<rule>_step", one update rule in each backend.
    # Algorithms that share one (adam, adamw) share its states and hyper-parameter record.
    # With a middle, its rule names the two ops around it: "<rule>_prologue", "<rule>_epilogue".
    op: str
    # Where a field of ``hyper`` comes from when the param group names it otherwise: a group
    # key, (key, index) into a tuple (``betas``), or a function of the group (Muon's
    # ``adjust_lr_fn`` as a flag). Every other field is the group's value of
    # its own name. Floats are read as Python floats (a tensor once, on the host: as torch's
    # fused optimizers read a tensor beta), bools as bools.
    reads: dict = dataclasses.field(default_factory=dict)
    # A step whose middle is not elementwise (Muon's orthogonalization of each matrix, a
    # LAMB-like per-tensor trust ratio): None for an elementwise algorithm, which this package
    # steps in one op. With one, the step is an elementwise prologue op, this middle over
    # whole tensors and an elementwise epilogue op, each declared from this record
    # (fused_accum.ops.SplitStep; the design document's "Steps that are not elementwise").
    middle: Optional["Middle"] = None

    def state(self, key: str) -> State:
        return next(s for s in self.states if s.key == key)


@dataclasses.dataclass(frozen=True)
class Middle:
    """The part of a step that is not elementwise, between its two elementwise ops: the
    prologue ``<rule>_prologue`` (reads the window's gradient once, updates the state, writes
    the middle's input, one fp32 tensor per parameter shaped as the weight) and the epilogue
    ``<rule>_epilogue`` (reads the middle's output, writes the masters and the weights). It needs
    each parameter whole, so the modes that hand the step pieces of one are refused
    (:func:`check_whole_tensors`)."""

    # run(inputs, h) -> outputs: torch ops over whole tensors (the prologue's outputs, shaped
    # as the weights), on their device; ``h`` the algorithm's hyper-parameter record
    run: Callable
    # check_param(p): torch's refusal of a parameter the middle cannot take (Muon's: not 2-D)
    check_param: Callable


ALGORITHMS: dict = {}  # name -> Algorithm, in registration order (error messages list them so)


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` and declare its step op (fused_accum.ops); returns it."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered")
    optional = [s.when is not None for s in algorithm.states]
    if optional != sorted(optional):
        raise ValueError(f"{algorithm.name}: optional states (State.when) must come after the others")
    unread = set(algorithm.reads).difference(algorithm.hyper._fields)
    if unread:
        raise ValueError(f"{algorithm.name}: reads names no field of {algorithm.hyper.__name__}: {sorted(unread)}")
    _HYPER_FIELDS[algorithm.hyper] = hyper_fields(algorithm.hyper)
    ops.declare_step(algorithm)
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def fused_names() -> str:
    """The registered algorithms, as error messages list them: "sgd, adam, ..."."""
    return ", ".join(ALGORITHMS)


# --- what the layers ask -------------------------------------------------------------------


def parse_algorithm(optimizer, hyperparameters: dict) -> tuple:
    """``optimizer=`` and the hyper-parameter keywords -> (fused algorithm name or None, torch.optim
    class or None, the param groups' defaults). The caller refuses its own classes first."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer= takes an optimizer class (e.g. torch.optim.RMSprop) or a name, "
            f"not an instance of {type(optimizer).__name__}"
        )
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return None, optimizer, dict(hyperparameters)
    if not isinstance(optimizer, str) or optimizer.lower() not in ALGORITHMS:
        raise ValueError(
            f"optimizer must be one of {sorted(ALGORITHMS)} or a torch.optim.Optimizer subclass, got {optimizer!r}"
        )
    name = optimizer.lower()
    defaults = dict(ALGORITHMS[name].defaults)
    for key, value in hyperparameters.items():
        if key not in defaults:
            raise TypeError(f"unexpected keyword {key!r} for optimizer {name!r}; expected one of {sorted(defaults)}")
        defaults[key] = value
    validate_hyperparameters(name, defaults, constructor=True)
    return name, None, defaults


def validate_hyperparameters(algorithm: str, group: dict, constructor: bool = False) -> None:
    """torch's checks of ``algorithm``'s hyper-parameters, in torch's order and with torch's
    messages. ``constructor``: also those torch makes of its constructor's arguments only (not
    of a group added later)."""
    ALGORITHMS[algorithm].check(group, constructor)


def check_after_groups(algorithm, defaults: dict) -> None:
    """The check torch's optimizers with ``fused`` and ``foreach`` make once their groups are
    accepted (before any hook is attached here: a constructor that fails changes nothing)."""
    if algorithm is not None and defaults.get("fused") and defaults.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_whole_tensors(algorithm, shard=None, offload=None, params=()) -> None:
    """Refuse what would hand an algorithm whose step has a middle (:class:`Middle`) pieces of
    a parameter, or a place its middle does not run: ``shard=`` (each rank steps a slice of the
    flat buffers), ``offload=`` (the host steps bucket by bucket), DTensor parameters (FSDP2,
    tensor parallelism: a rank holds a shard); and each parameter its middle refuses."""
    record = ALGORITHMS.get(algorithm) if algorithm is not None else None
    if record is None or record.middle is None:
        return
    whole = f"{record.name}'s step takes each parameter whole (its middle is not elementwise)"
    data_parallel = (
        "use process_group= without shard=, or DDP: each rank steps every parameter whole, from the averaged gradient"
    )
    if shard is not None:
        raise ValueError(f"shard={shard!r} steps a slice of each parameter on each rank, and {whole}: {data_parallel}")
    if offload is not None:
        raise ValueError(
            f"offload={offload!r} steps on the host bucket by bucket, and {whole}, in torch ops on the "
            "parameters' device: leave offload=None"
        )
    from .distributed import is_dtensor

    for p in params:
        if is_dtensor(p):
            raise ValueError(
                f"DTensor parameters (FSDP2's fully_shard, tensor parallelism) hold shards, and {whole}: {data_parallel}"
            )
        record.middle.check_param(p)


def state_keys(algorithm, group: dict) -> tuple:
    """The state buffers ``group``'s hyper-parameters ask of ``algorithm`` now (None: the generic
    path, whose torch.optim optimizer keeps its own state)."""
    if algorithm is None:
        return ()
    return tuple(s.key for s in ALGORITHMS[algorithm].states if s.when is None or bool(group[s.when]))


def initial_states(algorithm, group: dict) -> dict:
    """The state buffers ``group`` asks of ``algorithm`` now, each with its value before the
    first step (:meth:`State.initial`)."""
    if algorithm is None:
        return {}
    record = ALGORITHMS[algorithm]
    return {key: record.state(key).initial(group) for key in state_keys(algorithm, group)}


def read_hyper(cls: type, algorithm: str, group: dict) -> NamedTuple:
    """``algorithm``'s hyper-parameter record ``cls`` from param group ``group`` (each record's
    ``of``; where each field comes from: :attr:`Algorithm.reads`). Once per step."""
    reads = ALGORITHMS[algorithm].reads
    values = []
    fields = _HYPER_FIELDS.get(cls)
    if fields is None:  # (a record not registered: the tests' own)
        fields = hyper_fields(cls)
    for name, kind in fields:
        source = reads.get(name, name)
        if callable(source):  # (a function of the group: Muon's adjust_lr_fn read as a flag)
            value = source(group)
        else:
            value = group[source[0]][source[1]] if isinstance(source, tuple) else group[source]
        if kind == "bool":
            values.append(bool(value))
        else:  # a float, or an Optional[float] that is None
            values.append(None if value is None and kind == "float?" else scalar(value))
    return cls(*values)


# Each registered hyper-parameter record's fields, (name, schema type), found
# once at registration: the compiled step traces read_hyper, and Dynamo cannot trace
# typing.get_type_hints (a mappingproxy's get).
_HYPER_FIELDS: dict = {}


def hyper_fields(cls: type) -> tuple:
    """(name, schema type) of each field of a hyper-parameter record: "float", "bool" or "float?"
    (an Optional[float]), as its op's schema declares them (:func:`fused_accum.ops.arguments`)."""
    return tuple((arg.name, arg.type) for arg in ops.arguments(cls))


def scalar(value) -> float:
    """A hyper-parameter or a saved step as a Python float (a 1-element tensor read once)."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


# --- torch's checks, shared by the records (each record composes its own, in torch's order) --


def check_tensor_lr(group: dict, constructor: bool, foreach_refuses_tensors: bool = False) -> None:
    """A tensor lr: one element (and, where torch refuses it, not with ``foreach=True``)."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and constructor and foreach_refuses_tensors and _foreach_refuses_tensors(group):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")


def check_at_least_zero(group: dict, key: str, what: str) -> None:
    """``Invalid <what>: <value>`` unless ``0.0 <= group[key]`` (a NaN fails, as in torch)."""
    if not 0.0 <= group[key]:
        raise ValueError(f"Invalid {what}: {group[key]}")


def check_beta_ranges(group: dict) -> None:
    """``Invalid beta parameter at index <i>: <value>`` unless each of ``betas`` is in [0, 1)."""
    for i, b in enumerate(group["betas"]):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")


def check_beta_types(group: dict, constructor: bool, foreach_refuses_tensors: bool = False) -> None:
    """``betas`` all floats or all tensors, a tensor of one element (and, where torch refuses
    it, not with ``foreach=True``)."""
    betas = group["betas"]
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    refuses = constructor and foreach_refuses_tensors and _foreach_refuses_tensors(group)
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and refuses:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")


def check_not_differentiable(group: dict) -> None:
    if group.get("differentiable"):
        raise NotImplementedError("differentiable=True is not supported by fused_accum's optimizers")


def _foreach_refuses_tensors(group: dict) -> bool:
    return bool(group.get("foreach")) and not group.get("capturable")
