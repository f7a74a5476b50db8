"""Every fused algorithm, once, for the tests: its drop-in class, what it is held to (its
torch.optim class, or an independent peer), its hyper-parameter cases and the modes it runs in.
The kernel, optimizer and mode tests iterate this table instead of lists of their own, so a new
algorithm is one row here (the checklist: fused_accum/algorithms.py).

A case is torch's keyword arguments, as the drop-in class and the peer take them (``lr``
included). The kernel tests step the op with the records the optimizer would build from a param
group of those keywords (:func:`op_records`), so a kernel case may go where torch's checks do
not (SGD's nesterov with dampening: the op takes it).

Modes, and how the tests iterate the algorithms listed for each (every case, or each one's
default case; where the algorithm does not change what a mode does, a test keeps one algorithm,
for the suite's time):

- ``fp32``: every kernel case in test_kernels (against the reference, and every case of the
  algorithms with a fused torch.optim class against it bit for bit), every case in
  test_optimizer (k micro-batches against one large batch, against the peer);
- ``bf16_masters``: every kernel case on fp32 masters with bf16/fp16 copies (test_kernels,
  test_kernel_values), every case's steady-state step (test_host_cost);
- ``remainder``: every kernel case (test_kernels: 1,000 steps bit for bit) and every case
  (test_remainder: the tie twin);
- ``step_sources``: every kernel case (test_step_sources), and each update rule's widest;
- ``step_in_backward``: each algorithm's default case (test_optimizer);
- ``offload``, ``exact_wire``: each algorithm's default case (test_offload, test_fsdp_offload,
  test_exact_wire); their other scenarios (clips, skips, GradScaler) keep one algorithm;
- ``sharding``: each algorithm's default case in one two-rank scenario, the sharded modes
  against the replicated one (test_sharding); the other scenarios keep AdamW or SGD;
- ``host_cost``: every case in one precision and each default case in the others
  (test_host_cost: a steady-state step never syncs, whatever the update); the window's
  backwards keep a few;
- ``fsdp2``: the default algorithm only (test_fsdp: FSDP2 shards the parameters, not the update).
- ``compiled_window``: each algorithm's default case, in fp32, bf16 + masters and remainder
  (test_compiled_window: one graph per window, bit for bit with eager).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import pytest
import torch

import fused_accum
from fused_accum import ops
from fused_accum.registry import ALGORITHMS as REGISTERED
from fused_accum.registry import state_keys
from lion_reference import LionReference  # tests/lion_reference.py


class AdEMAMixPeer:
    """pytorch-optimizer's AdEMAMix with AdamW's decoupled weight decay (``weight_decouple=True``,
    the paper's), under fused_accum.AdEMAMix's signature: the independent implementation
    fused_accum.AdEMAMix is held to (pytorch-optimizer==4.1.0, requirements-dev.txt; its
    for-loop and foreach paths step the same bits on the CPU)."""

    def __new__(
        cls,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha_beta3=None,
        eps=1e-8,
        weight_decay=0.0,
        *,
        maximize=False,
        foreach=None,
    ):
        from pytorch_optimizer import AdEMAMix

        return AdEMAMix(
            params,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            weight_decouple=True,
            alpha=alpha,
            t_alpha_beta3=t_alpha_beta3,
            eps=eps,
            maximize=maximize,
            foreach=foreach,
        )


FP32, BF16_MASTERS, REMAINDER = "fp32", "bf16_masters", "remainder"
OFFLOAD, SHARDING, EXACT_WIRE, FSDP2 = "offload", "sharding", "exact_wire", "fsdp2"
STEP_IN_BACKWARD, HOST_COST, STEP_SOURCES = "step_in_backward", "host_cost", "step_sources"
COMPILED_WINDOW = "compiled_window"
EVERY_MODE = frozenset(
    {
        FP32,
        BF16_MASTERS,
        REMAINDER,
        OFFLOAD,
        SHARDING,
        EXACT_WIRE,
        STEP_IN_BACKWARD,
        HOST_COST,
        STEP_SOURCES,
        COMPILED_WINDOW,
    }
)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One fused algorithm's row."""

    cls: type  # the drop-in class
    peer: Optional[type]  # what it is held to: its torch.optim class, or an independent implementation
    cases: dict  # case name -> torch's keywords (lr included); the first is the default case
    modes: frozenset  # the modes it runs in (see the module docstring)
    # Step-op cases, by name (torch's keywords, no lr): the kernel tests' matrix. A name is a
    # test id and a seed: keep them.
    kernel_cases: dict = dataclasses.field(default_factory=dict)
    torch_fused: bool = False  # the peer has a fused CPU step: compared bit for bit


TABLE = {
    "sgd": Algorithm(
        fused_accum.SGD,
        torch.optim.SGD,
        {
            "sgd_momentum": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
            "sgd_nesterov_maximize": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
            "sgd_plain": dict(lr=0.05, weight_decay=0.01),
        },
        EVERY_MODE,
        kernel_cases={
            "sgd": dict(momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=True),
            "sgd_plain": dict(momentum=0.0, maximize=True),
        },
        torch_fused=True,
    ),
    "adam": Algorithm(
        fused_accum.Adam,
        torch.optim.Adam,
        {
            "adam": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
            "adam_amsgrad_maximize": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, amsgrad=True, maximize=True),
        },
        EVERY_MODE,
        kernel_cases={"adam": dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)},
        torch_fused=True,
    ),
    "adamw": Algorithm(
        fused_accum.AdamW,
        torch.optim.AdamW,
        {
            "adamw": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
            # amsgrad, and beta1 < 0.5 (exp_avg's lerp from the other end)
            "adamw_amsgrad_beta1_low": dict(lr=1e-2, betas=(0.3, 0.999), weight_decay=0.05, amsgrad=True),
        },
        EVERY_MODE | {FSDP2},
        kernel_cases={
            "adamw": dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, maximize=True),
            # amsgrad, and beta1 < 0.5 (exp_avg's lerp from the other end)
            "adam_amsgrad": dict(betas=(0.3, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True),
        },
        torch_fused=True,
    ),
    "lion": Algorithm(
        fused_accum.Lion,
        LionReference,
        {"lion": dict(lr=1e-3, weight_decay=0.1)},
        EVERY_MODE,
        kernel_cases={"lion": dict(betas=(0.9, 0.99), weight_decay=0.1)},
    ),
    "adagrad": Algorithm(
        fused_accum.Adagrad,
        torch.optim.Adagrad,
        {
            # the sum from initial_accumulator_value, clr decaying with the step count
            "adagrad": dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5, eps=1e-6),
            "adagrad_maximize": dict(lr=1e-2, maximize=True),
        },
        EVERY_MODE,
        kernel_cases={
            "adagrad": dict(lr_decay=0.01, weight_decay=0.1, eps=1e-6),
            "adagrad_plain": dict(maximize=True),
        },
        torch_fused=True,
    ),
    "ademamix": Algorithm(
        fused_accum.AdEMAMix,
        AdEMAMixPeer,
        {
            "ademamix": dict(lr=1e-3, weight_decay=0.1),
            # the warm-up (past its end by the third step), beta1 < 0.5 (m's lerp from the other end)
            "ademamix_warmup_maximize": dict(
                lr=1e-2, betas=(0.3, 0.99, 0.999), alpha=2.0, t_alpha_beta3=2.5, eps=1e-6, maximize=True
            ),
        },
        EVERY_MODE,
        kernel_cases={
            "ademamix": dict(betas=(0.9, 0.999, 0.9999), alpha=5.0, weight_decay=0.1),
            # steps 1 and 5 inside the warm-up, 9 past it (the kernel tests' step counts)
            "ademamix_warmup": dict(betas=(0.3, 0.99, 0.999), alpha=2.0, t_alpha_beta3=7.0, eps=1e-6, maximize=True),
        },
    ),
    # 2-D parameters only, and a middle of bf16 matmuls (torch.optim.Muon's) that turns any
    # last-bit difference of its input into a bf16 ulp of the update: the shared mode tests'
    # models (biases) and tolerances (k micro-batches against one large batch) do not fit it.
    # tests/test_muon.py holds its modes: fp32 bit for bit with torch.optim.Muon, bf16 + fp32
    # masters and the remainder mode (the fp32 run's masters, bit for bit), process_group= and
    # DDP; shard=, FSDP2 and offload= refused; and test_compiled_window its one-graph window (a
    # model of matrices only). Its kernel cases are its split step's two ops' (test_kernels:
    # kernel_cases(split=True)).
    "muon": Algorithm(
        fused_accum.Muon,
        torch.optim.Muon,
        {"muon": dict(lr=0.02)},
        frozenset(),
        kernel_cases={
            # nesterov, both lerps from the buffer's end (momentum 0.95), torch's defaults
            "muon": dict(weight_decay=0.1),
            # both lerps from the other end (momentum < 0.5), the adjusted lr matching AdamW's RMS
            "muon_low_momentum_rms": dict(momentum=0.3, adjust_lr_fn="match_rms_adamw", weight_decay=0.05),
            "muon_plain": dict(momentum=0.9, nesterov=False, weight_decay=0.0),
        },
    ),
}
DEFAULT = "adamw"  # the algorithm of a test where the algorithm does not matter


class Case(NamedTuple):
    """One hyper-parameter case of one algorithm."""

    id: str
    algorithm: str  # the registry's name (FusedAccumOptimizer's optimizer=)
    kwargs: dict  # torch's keywords

    @property
    def cls(self) -> type:
        return TABLE[self.algorithm].cls

    @property
    def peer(self) -> Optional[type]:
        return TABLE[self.algorithm].peer

    def make(self, params, **keywords):
        """The drop-in optimizer over ``params`` with this case's keywords and ``keywords``."""
        return self.cls(params, **{**self.kwargs, **keywords})


def cases(mode: Optional[str] = None, every: bool = False) -> list:
    """The default case of each algorithm that runs in ``mode`` (None: any), or with ``every``
    all its cases."""
    out = []
    for name, row in TABLE.items():
        if mode is None or mode in row.modes:
            items = list(row.cases.items())
            out += [Case(id, name, kwargs) for id, kwargs in (items if every else items[:1])]
    return out


def case(id: str) -> Case:
    """The (optimizer-level) case named ``id``."""
    return next(c for c in cases(every=True) if c.id == id)


def params(mode: Optional[str] = None, every: bool = False) -> list:
    """:func:`cases` as pytest parameters, each with its id."""
    return [pytest.param(c, id=c.id) for c in cases(mode, every)]


def kernel_cases(mode: Optional[str] = None, split: bool = False) -> dict:
    """Every kernel case (of the algorithms that run in ``mode``; None: any), by name: the
    step-op matrix of test_kernels. ``split``: those of the algorithms whose step is split
    around a middle instead (their record's ``middle``: fused_accum.ops.SplitStep, two ops)."""
    return {
        cid: Case(cid, name, kwargs)
        for name, row in TABLE.items()
        if (mode is None or mode in row.modes) and (REGISTERED[name].middle is not None) == split
        for cid, kwargs in row.kernel_cases.items()
    }


def per_update_rule(mode: Optional[str] = None) -> dict:
    """Of each step op (update rule), its kernel case that keeps the most state lists (the most
    operands), by name: where a test runs each rule once. ``mode``: of the algorithms in it."""
    every = kernel_cases(mode)
    widest = {}
    for name, c in every.items():
        op, _, keys = op_records(c)
        if op.name not in widest or len(keys) > len(op_records(every[widest[op.name]])[2]):
            widest[op.name] = name
    return {name: every[name] for name in widest.values()}


def group(c: Case) -> dict:
    """The param group (its hyper-parameters) the optimizer builds from ``c``'s keywords."""
    return {**REGISTERED[c.algorithm].defaults, **c.kwargs}


def op_records(c: Case) -> tuple:
    """(step op, hyper-parameter record, state keys) of ``c``: what the optimizer hands the
    backend for a param group of these keywords (fused_accum.step.Stepper.prepare_step)."""
    g = group(c)
    op = ops.step_op(c.algorithm)
    return op, op.hyper.of(c.algorithm, g), state_keys(c.algorithm, g)


def op_call(module, c: Case, t: ops.StepTensors, states: list, hyper=None) -> None:
    """``module``'s step of ``c``'s op on ``t`` and ``states`` (the lists of the state keys the
    case keeps, in the op's order; the others empty), with ``c``'s hyper-parameters or ``hyper``."""
    op, h, keys = op_records(c)
    lists = iter(states)
    s = op.states(*(next(lists) if key in keys else [] for key in op.state_keys))
    module.step(op, t, s, hyper if hyper is not None else h)


def assert_table_covers_the_registry() -> None:
    assert set(TABLE) == set(REGISTERED), "tests/cases.py lists every registered algorithm, once"
