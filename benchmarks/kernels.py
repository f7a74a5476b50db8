"""Kernel microbenchmarks: accumulate and the optimizer steps, ours against PyTorch's best.

A *group* is one operation on one workload (a list of parameter shapes) with one gradient
dtype; every provider in a group runs on the same rotated random buffers, and yields one row.

Providers:
  accumulate (``acc = grad`` on the window's first micro-batch, ``acc += grad`` later):
    torch_loop     per-parameter ``acc.copy_(g)`` / ``acc.add_(g)``: what ``.grad`` does
    torch_foreach  ``torch._foreach_copy_`` / ``torch._foreach_add_``
  steps (SGD-momentum, AdamW, Lion, Adagrad, AdEMAMix from the fp32 accumulator, fp32 master,
  bf16 param write):
    torch_fused / torch_foreach  ``torch.optim.SGD`` / ``AdamW`` / ``Adagrad`` with ``fused=True`` /
                   ``foreach=True`` on the fp32 masters with the accumulator as ``.grad``, then
                   the two passes torch needs that our step does not: copy the masters into the
                   bf16 params and zero the accumulator for the next window. torch has no Lion;
                   torch_foreach Lion is the update written with ``torch._foreach_*`` ops.
                   torch has no AdEMAMix: its rows are our backends' only.
    For the fused last micro-batch torch first adds the gradient (``_foreach_add_``).
  and each fused_accum backend available on the device (reference, triton, cpu, cuda), called
  through ``fused_accum.backends.get(name)`` directly, not through the custom-op wrapper.
  ``adamw_remainder`` and ``adamw_fused_last_remainder``: the same AdamW steps with exact 2-byte
  masters (bf16 params + int16 remainders, issue 28; 28 and 30 bytes per element instead of 32
  and 34), our backends only (torch has no such mode): next to the fp32-master rows, with
  ``speedup_vs_fp32_master`` (the same provider's fp32-master row of the same run over this
  one) and ``speedup_vs_torch`` against torch's best fp32-master AdamW of the same workload.

Before timing, each provider runs once on a separate check set and its fp32 output is compared
with an fp32 oracle (for accumulate, torch's fp32 add; for steps, the reference backend's fp32
masters), and a step's bf16 params with the provider's own masters rounded to bf16 (see
CHECK_TOL and LP_MISMATCH_TOL): a fast wrong kernel shows up as ``ok=False`` in the row.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from benchmarks import common
from fused_accum import backends, ops
from fused_accum.backends import reference

Shape = Tuple[int, ...]

# Hyper-parameters of the timed steps: torch's defaults, with weight decay on so that its term
# is computed (and therefore timed) by every provider.
SGD_HP = dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=False)
ADAMW_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
LION_HP = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=1e-2)
ADAGRAD_HP = dict(lr=1e-2, lr_decay=0.0, weight_decay=1e-2, eps=1e-10)
ADEMAMIX_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, eps=1e-8, weight_decay=1e-2)
MUON_HP = dict(lr=2e-2, momentum=0.95, nesterov=True, weight_decay=0.1)

# The check's tolerance on the fp32 outputs (the accumulator, the step's fp32 masters) against
# the oracle: fp32 arithmetic on O(1) values, so a correct provider lands under 1e-6 (one
# rounding per element, torch's slightly different operation order, or torch's CUDA fused AdamW,
# which computes the step in double); 1e-5 leaves room for that and still catches any real
# error (a missed term moves the result by 1e-3 or more).
CHECK_TOL = 1e-5
# The step's bf16 params are not compared with the oracle's: a master 1e-7 away from the
# oracle's rounds to the other bf16 value whenever it sits that close to a rounding boundary
# (an emulation of torch's double-precision CUDA step failed 11.5% of the smoke checks, ~60% at
# 1M elements). Each provider's bf16 param is instead held to its own fp32 master: it must be
# that master rounded to nearest even, bit for bit (what torch's copy_ and every backend's store
# do), so the number of elements that differ must be 0. A stale or unwritten bf16 copy differs
# in most elements.
LP_MISMATCH_TOL = 0

STEP_OPS = (
    "sgd",
    "adamw",
    "lion",
    "adagrad",
    "ademamix",
    "adamw_fused_last",
    "adamw_remainder",
    "adamw_fused_last_remainder",
    "muon_prologue",
    "muon_epilogue",
)
# Muon's split step's elementwise ops (its Newton-Schulz middle, torch matmuls, is not timed):
# the prologue reads acc and the momentum and writes the momentum and the middle's fp32 input
# (16 bytes per element: no weight is read or written); the epilogue reads the middle's bf16
# output and the master and bf16 weight, and writes them (14). Torch has neither half alone.
MUON_OPS = {"muon_prologue": 16, "muon_epilogue": 14}
# The exact 2-byte master's ops (bf16 params + int16 remainders), each with its fp32-master twin.
REMAINDER_OPS = {"adamw_remainder": "adamw", "adamw_fused_last_remainder": "adamw_fused_last"}
FUSED_LAST_OPS = ("adamw_fused_last", "adamw_fused_last_remainder")


def remainder_step_bytes(grad_dtype: Optional[torch.dtype] = None) -> int:
    """AdamW with an int16 remainder instead of the fp32 master: read acc, bf16 param, remainder,
    m, v (16), write param, remainder, m, v (12) = 28; the fused last micro-batch adds its bf16
    gradient (30). The fp32-master step's master read and write (8) and bf16 copy read and
    write (4) become the param and remainder read and written (8): 4 bytes fewer."""
    return common.step_bytes("adamw", grad_dtype=grad_dtype) - 4


ACC_OPS = ("accumulate_first", "accumulate_add")


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: Tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def padded_numel(self) -> int:
        return common.padded_offsets([math.prod(s) for s in self.shapes])[1]


def flat(n: int) -> Workload:
    """One flat gradient of ``n`` elements."""
    return Workload("flat", ((n,),))


def gpt2(d: int = 768, layers: int = 12, vocab: int = 50257, ctx: int = 1024, name="gpt2") -> Workload:
    """GPT-2 small's parameters with the defaults: 148 tensors, 124.4M elements (lm head tied)."""
    shapes: List[Shape] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),  # ln_1, attention
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]  # ln_2, MLP
    shapes += [(d,), (d,)]  # ln_f
    return Workload(name, tuple(shapes))


def llama(hidden: int = 4096, intermediate: int = 11008, blocks: int = 2, name="llama") -> Workload:
    """Llama-style decoder blocks (7B shapes by default: 202M elements per block, 9 tensors)."""
    block = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    block += [(hidden,), (hidden,)]  # the two RMSNorm weights
    return Workload(name, tuple(block * blocks))


def uniform(count: int = 2048, numel: int = 256) -> Workload:
    """``count`` equal tensors: 2048 x 256 is the launch- and loop-overhead-bound case (2 MB of
    bf16 gradients) where a per-tensor ``add_`` loop pays ~2 us of dispatch per tensor."""
    return Workload(f"uniform_{count}x{numel}", ((numel,),) * count)


def many_small(count: int = 2048, max_numel: int = 65536, seed: int = 0, name="many_small") -> Workload:
    """``count`` tensors of 1..max_numel elements, log-uniform (so many bias-sized ones), from
    a fixed seed so every run times the same list. 2048 x up to 64K is about 10M elements."""
    rng = random.Random(seed)
    sizes = [max(1, int(round(math.exp(rng.uniform(0.0, math.log(max_numel)))))) for _ in range(count)]
    return Workload(name, tuple((n,) for n in sizes))


# ---------------------------------------------------------------------------------------------
# Groups and context
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    op: str  # one of ACC_OPS or STEP_OPS
    workload: Workload
    grad_dtype: Optional[torch.dtype]  # None for steps that read only the accumulator
    providers: Tuple[str, ...]

    @property
    def section(self) -> str:
        return "accumulate" if self.op in ACC_OPS else "step"

    @property
    def bytes_per_elem(self) -> int:
        if self.op in ACC_OPS:
            return common.accumulate_bytes(self.grad_dtype, overwrite=self.op == "accumulate_first")
        if self.op in REMAINDER_OPS:
            return remainder_step_bytes(self.grad_dtype)
        if self.op == "adamw_fused_last":
            return common.step_bytes("adamw", grad_dtype=self.grad_dtype)
        if self.op in MUON_OPS:
            return MUON_OPS[self.op]
        return common.step_bytes(self.op)

    @property
    def label(self) -> str:
        dt = common.dtype_name(self.grad_dtype) if self.grad_dtype is not None else "-"
        return f"{self.op} {self.workload.name} {common.fmt_numel(self.workload.numel)} {dt}"


@dataclass
class Context:
    device: torch.device
    timing: common.TimingConfig
    cache_bytes: int
    copy_gbps: float
    seed: int = 0
    max_rotations: int = 256
    generator: torch.Generator = field(init=False)

    def __post_init__(self):
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)


def our_backends(device: torch.device) -> List[str]:
    """fused_accum backends that run here, by name, so new ones are picked up unchanged.

    Triton on CPU tensors only runs under TRITON_INTERPRET=1, a test mode thousands of times
    slower than the reference: timing it would say nothing and take minutes, so it is left out.
    """
    names = []
    for name in backends.NAMES:
        if backends.availability(name, device.type) == "":
            if name == "triton" and device.type != "cuda":
                continue
            names.append(name)
    return names


def default_providers(op: str, device: torch.device) -> Tuple[str, ...]:
    if op in REMAINDER_OPS or op == "ademamix" or op in MUON_OPS:  # torch has no remainder mode (its
        return tuple(our_backends(device))  # fp32-master rows are the twin's), no AdEMAMix, no half of Muon
    if op in ACC_OPS:
        torch_side = ("torch_loop", "torch_foreach")
    elif op == "lion":
        torch_side = ("torch_foreach",)
    else:
        torch_side = ("torch_fused", "torch_foreach")
    return torch_side + tuple(our_backends(device))


# ---------------------------------------------------------------------------------------------
# Accumulate
# ---------------------------------------------------------------------------------------------


@dataclass
class AccSet:
    flat: torch.Tensor  # the fp32 accumulator, as the ops take it
    offsets: torch.Tensor  # int64 on the CPU: where each gradient's slice starts, as the ops take them
    accs_nd: List[torch.Tensor]  # views shaped like the params, as torch's .grad is
    grads: List[torch.Tensor]


def _acc_set(flat_acc: torch.Tensor, grads: List[torch.Tensor]) -> AccSet:
    shapes = [tuple(g.shape) for g in grads]
    offsets = torch.tensor(common.padded_offsets([g.numel() for g in grads])[0], dtype=torch.int64)
    return AccSet(flat_acc, offsets, common.flat_views(flat_acc, shapes, shaped=True), grads)


def _make_acc_set(workload: Workload, grad_dtype: torch.dtype, ctx: Context) -> AccSet:
    flat_acc = common.random_tensor((workload.padded_numel,), torch.float32, ctx.device, ctx.generator)
    grads = [common.random_tensor(s, grad_dtype, ctx.device, ctx.generator) for s in workload.shapes]
    return _acc_set(flat_acc, grads)


def _torch_loop_copy(s: AccSet) -> None:
    for acc, grad in zip(s.accs_nd, s.grads):
        acc.copy_(grad)


def _torch_loop_add(s: AccSet) -> None:
    for acc, grad in zip(s.accs_nd, s.grads):
        acc.add_(grad)


def _acc_provider(name: str, overwrite: bool) -> Callable[[AccSet], None]:
    if name == "torch_loop":
        return _torch_loop_copy if overwrite else _torch_loop_add
    if name == "torch_foreach":
        if overwrite:
            return lambda s: torch._foreach_copy_(s.accs_nd, s.grads)
        return lambda s: torch._foreach_add_(s.accs_nd, s.grads)
    accumulate = backends.get(name).accumulate
    return lambda s: accumulate(s.flat, s.offsets, s.grads, 1.0, overwrite)


def _check_accumulate(fn, check_set: AccSet, overwrite: bool) -> float:
    """Run ``fn`` once and compare with the same sum done in fp32 by torch on a copy."""
    expected = check_set.flat.clone()
    for e, g in zip(common.flat_views(expected, [tuple(g.shape) for g in check_set.grads]), check_set.grads):
        e.copy_(g.reshape(-1).float()) if overwrite else e.add_(g.reshape(-1).float())
    fn(check_set)
    common.synchronize(check_set.flat.device)
    return common.rel_error(check_set.flat, expected)


def _run_accumulate(group: Group, ctx: Context) -> Iterator[Dict]:
    overwrite = group.op == "accumulate_first"
    set_bytes = group.workload.numel * (common.FP32_BYTES + common.elem_size(group.grad_dtype))
    n_sets = common.rotation_count(set_bytes, ctx.cache_bytes, ctx.max_rotations)
    sets = [_make_acc_set(group.workload, group.grad_dtype, ctx) for _ in range(n_sets)]
    check_set = _make_acc_set(group.workload, group.grad_dtype, ctx)
    for provider in group.providers:

        def prepare():
            fn = _acc_provider(provider, overwrite)
            return _check_accumulate(fn, _make_acc_set_copy(check_set), overwrite), sets, fn

        yield _time_provider(group, provider, ctx, prepare)


def _make_acc_set_copy(s: AccSet) -> AccSet:
    """A fresh copy, so every provider's check starts from the same random accumulator."""
    return _acc_set(s.flat.clone(), s.grads)


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


@dataclass
class StepSet:
    shapes: Tuple[Shape, ...]
    acc: torch.Tensor  # flat fp32
    master: torch.Tensor  # flat fp32 (remainder ops: unused, the masters are lp + rem)
    state: List[torch.Tensor]  # flat fp32: [momentum] / [exp_avg, exp_avg_sq] / [exp_avg]
    lp: List[torch.Tensor]  # bf16 params, shaped
    grads: List[torch.Tensor]  # the last micro-batch's gradients, for the fused step; else []
    steps: torch.Tensor  # per-tensor step count, fp32
    lr: torch.Tensor
    coef: torch.Tensor
    rem: Optional[torch.Tensor] = None  # remainder ops: flat int16, the low halves of the masters
    # Muon's ops: the middle's input (the prologue's fp32 output) or output (the epilogue's bf16
    # input), one matrix per shape (a 1-D shape as one row)
    updates: List[torch.Tensor] = field(default_factory=list)

    def views(self, flat_buf: torch.Tensor, shaped: bool = False) -> List[torch.Tensor]:
        return common.flat_views(flat_buf, self.shapes, shaped=shaped)

    def masters(self) -> torch.Tensor:
        """The fp32 masters, flat without padding: the master buffer, or rebuilt from the bf16
        params and their remainders."""
        if self.rem is None:
            return torch.cat(self.views(self.master))
        return torch.cat([reference.rebuild_master(p.reshape(-1), r) for p, r in zip(self.lp, self.views(self.rem))])

    def clone(self) -> "StepSet":
        return StepSet(
            self.shapes,
            self.acc.clone(),
            self.master.clone(),
            [s.clone() for s in self.state],
            [p.clone() for p in self.lp],
            self.grads,
            self.steps.clone(),
            self.lr,
            self.coef,
            None if self.rem is None else self.rem.clone(),
            [u.clone() for u in self.updates],
        )


def _optimizer_of(op: str) -> str:
    if op in MUON_OPS:
        return "muon"
    return "adamw" if op in FUSED_LAST_OPS or op in REMAINDER_OPS else op


def _matrix(shape: Shape) -> Shape:
    return tuple(shape) if len(shape) == 2 else (1, math.prod(shape))


def _make_step_set(group: Group, ctx: Context, first_step: bool) -> StepSet:
    """Random accumulator, master, bf16 params and gradients. The timed sets get random state
    too (Adam's v positive); a check set starts as torch's optimizers do, with zero state on
    step 1, so torch's lazily created state and ours begin equal."""
    w, dev, gen = group.workload, ctx.device, ctx.generator
    n = w.padded_numel
    opt = _optimizer_of(group.op)
    state = []
    for i in range(common.STATE_TENSORS[opt]):
        if first_step:
            state.append(torch.zeros(n, device=dev))
        else:
            positive = (opt, i) in (("adamw", 1), ("ademamix", 1), ("adagrad", 0))  # v, Adagrad's sum
            state.append(common.random_tensor((n,), torch.float32, dev, gen, positive=positive))
    grads = [common.random_tensor(s, group.grad_dtype, dev, gen) for s in w.shapes] if group.grad_dtype else []
    hp = {"sgd": SGD_HP, "adamw": ADAMW_HP, "lion": LION_HP, "adagrad": ADAGRAD_HP, "ademamix": ADEMAMIX_HP}.get(
        opt, MUON_HP
    )
    out = StepSet(
        shapes=w.shapes,
        acc=common.random_tensor((n,), torch.float32, dev, gen),
        master=common.random_tensor((n,), torch.float32, dev, gen),
        state=state,
        lp=[common.random_tensor(s, torch.bfloat16, dev, gen) for s in w.shapes],
        grads=grads,
        steps=torch.full((len(w.shapes),), 1.0 if first_step else 10.0, device=dev),
        lr=torch.tensor(hp["lr"], device=dev),
        coef=torch.tensor(1.0, device=dev),  # torch has no such scalar: 1 keeps the math equal
    )
    if group.op == "muon_prologue":  # its output, poisoned: the check compares it
        out.updates = [torch.full(_matrix(s), math.nan, device=dev) for s in w.shapes]
    elif group.op == "muon_epilogue":  # the middle's output, bf16 as torch's Newton-Schulz gives it
        out.updates = [common.random_tensor(_matrix(s), torch.bfloat16, dev, gen) for s in w.shapes]
    if group.op not in REMAINDER_OPS:  # the bf16 params are their masters' rounding, as in the optimizer
        for p, master in zip(out.lp, out.views(out.master)):  # (the step adopts any element that is not)
            p.copy_(master.view(p.shape))
    else:  # the random masters, split into the bf16 params and remainders
        out.rem = torch.zeros(n, dtype=torch.int16, device=dev)
        for p, r, master in zip(out.lp, out.views(out.rem), out.views(out.master)):
            weight, remainder = reference.split_master(master)
            p.copy_(weight.view(p.shape))
            r.copy_(remainder)
        out.master = torch.empty(0, device=dev)  # not part of the remainder mode: never timed
    return out


def _lion_foreach(params, exp_avgs, grads, lr, beta1, beta2, weight_decay):
    """Lion with torch's multi-tensor ops: the best a PyTorch user can write without a kernel."""
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, grads, alpha=1 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)


def _torch_step_provider(op: str, mode: str, s: StepSet) -> Callable[[], None]:
    """torch's optimizer on fp32 masters whose .grad is the accumulator, + copy + zero.

    The zeroing pass is what a persistent torch buffer needs before the next window, so it is
    timed; it leaves torch's later calls reading a zero accumulator. That can only flatter
    torch (zeros toggle fewer bits), so the speedups stay conservative; the accumulators are
    refilled with random values before the next provider runs (see :func:`_run_step`).
    """
    masters, accs = s.views(s.master, shaped=True), s.views(s.acc, shaped=True)
    opt_name = _optimizer_of(op)
    torch_opt = None
    if opt_name == "lion":
        if mode != "foreach":
            raise ValueError(f"torch has no {mode} Lion")
        exp_avgs = s.views(s.state[0], shaped=True)
        hp = LION_HP
        update = lambda: _lion_foreach(masters, exp_avgs, accs, hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"])
    else:
        for p, a in zip(masters, accs):
            p.grad = a
        flag = {mode: True}
        if opt_name == "sgd":
            hp = SGD_HP
            torch_opt = torch.optim.SGD(
                masters,
                lr=hp["lr"],
                momentum=hp["momentum"],
                dampening=hp["dampening"],
                weight_decay=hp["weight_decay"],
                nesterov=hp["nesterov"],
                **flag,
            )
        elif opt_name == "adagrad":
            hp = ADAGRAD_HP
            torch_opt = torch.optim.Adagrad(
                masters, lr=hp["lr"], lr_decay=hp["lr_decay"], weight_decay=hp["weight_decay"], eps=hp["eps"], **flag
            )
        else:
            hp = ADAMW_HP
            torch_opt = torch.optim.AdamW(
                masters,
                lr=hp["lr"],
                betas=(hp["beta1"], hp["beta2"]),
                eps=hp["eps"],
                weight_decay=hp["weight_decay"],
                **flag,
            )
        update = torch_opt.step
    grads = s.grads

    def call():
        if grads:
            torch._foreach_add_(accs, grads)
        update()
        torch._foreach_copy_(s.lp, masters)
        s.acc.zero_()

    return call


def _our_step_provider(op: str, backend: str, s: StepSet) -> Callable[[], None]:
    module = backends.get(backend)
    # the step op's records (fused_accum.ops), made once: the timed call is the op alone
    if s.rem is not None:  # the bf16 params are the masters' high halves, rem their low halves
        tensors = ops.StepTensors(s.lp, s.views(s.acc), s.steps, s.lr, s.coef, remainders=s.views(s.rem), grads=s.grads)
    else:
        tensors = ops.StepTensors(
            s.views(s.master), s.views(s.acc), s.steps, s.lr, s.coef, lp_params=s.lp, grads=s.grads
        )
    state = [s.views(buf) for buf in s.state]
    if op in MUON_OPS:
        hp = MUON_HP
        split = ops.step_op("muon")
        hyper = split.hyper(hp["momentum"], hp["nesterov"], hp["weight_decay"], 3.4445, -4.775, 2.0315, 1e-7, 5, False)
        if op == "muon_prologue":
            records = (tensors, split.prologue.states(state[0], s.updates), hyper)
            return lambda: module.step(split.prologue, *records)
        records = (tensors, split.epilogue.states(s.updates), hyper)
        return lambda: module.step(split.epilogue, *records)
    if op == "sgd":
        hp = SGD_HP
        hyper = ops.sgd_step.hyper(hp["momentum"], hp["dampening"], hp["weight_decay"], hp["nesterov"], False)
        records = (tensors, ops.sgd_step.states(state[0]), hyper)
        return lambda: module.step(ops.sgd_step, *records)
    if op == "lion":
        hp = LION_HP
        hyper = ops.lion_step.hyper(hp["beta1"], hp["beta2"], hp["weight_decay"], False)
        records = (tensors, ops.lion_step.states(state[0]), hyper)
        return lambda: module.step(ops.lion_step, *records)
    if op == "adagrad":
        hp = ADAGRAD_HP
        hyper = ops.adagrad_step.hyper(hp["lr_decay"], hp["weight_decay"], hp["eps"], False)
        records = (tensors, ops.adagrad_step.states(state[0]), hyper)
        return lambda: module.step(ops.adagrad_step, *records)
    if op == "ademamix":
        hp = ADEMAMIX_HP
        betas = (hp["beta1"], hp["beta2"], hp["beta3"])
        hyper = ops.ademamix_step.hyper(*betas, hp["alpha"], None, hp["eps"], hp["weight_decay"], False)
        records = (tensors, ops.ademamix_step.states(*state), hyper)
        return lambda: module.step(ops.ademamix_step, *records)
    hp = ADAMW_HP
    hyper = ops.adam_step.hyper(hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], True, False)
    records = (tensors, ops.adam_step.states(state[0], state[1]), hyper)
    return lambda: module.step(ops.adam_step, *records)


def _step_provider(op: str, provider: str, s: StepSet) -> Callable[[], None]:
    if provider.startswith("torch_"):
        return _torch_step_provider(op, provider[len("torch_") :], s)
    return _our_step_provider(op, provider, s)


def _step_check(out: StepSet, ref: StepSet) -> Dict:
    """The fp32 masters' relative error against the oracle's (``max_rel_err``), and how many
    bf16 params differ from their own master rounded to bf16 (``lp_mismatch``, bitwise; with
    remainders: from their master's split_master weight, which rounds ties away from zero)."""
    lp = torch.cat([p.reshape(-1) for p in out.lp])
    masters = out.masters()
    own = masters.to(lp.dtype) if out.rem is None else reference.split_master(masters)[0]
    mismatch = int((lp.view(torch.int16) != own.view(torch.int16)).sum())
    err = common.rel_error(masters, ref.masters())
    if out.updates:  # (Muon: its state, and the prologue's output: what it writes)
        got = torch.cat([x.reshape(-1) for x in out.state + out.updates])
        want = torch.cat([x.reshape(-1) for x in ref.state + ref.updates])
        err = max(err, common.rel_error(got.float(), want.float()))
    return {"max_rel_err": err, "lp_mismatch": mismatch}


def _run_step(group: Group, ctx: Context) -> Iterator[Dict]:
    w = group.workload
    n_state = common.STATE_TENSORS[_optimizer_of(group.op)]
    grad_bytes = common.elem_size(group.grad_dtype) if group.grad_dtype else 0
    master_bytes = 2 if group.op in REMAINDER_OPS else common.FP32_BYTES  # the remainder, or the master
    set_bytes = w.numel * (common.FP32_BYTES * (1 + n_state) + master_bytes + 2 + grad_bytes)
    n_sets = common.rotation_count(set_bytes, ctx.cache_bytes, ctx.max_rotations)
    sets = [_make_step_set(group, ctx, first_step=False) for _ in range(n_sets)]
    check_base = _make_step_set(group, ctx, first_step=True)
    oracle = check_base.clone()
    _our_step_provider(group.op, "reference", oracle)()

    for provider in group.providers:

        def prepare():
            checked = check_base.clone()
            _step_provider(group.op, provider, checked)()
            common.synchronize(ctx.device)
            err = _step_check(checked, oracle)
            del checked
            # One callable per rotated set (torch's optimizers keep their own state per set).
            return err, [_step_provider(group.op, provider, s) for s in sets], lambda call: call()

        yield _time_provider(group, provider, ctx, prepare)
        if provider.startswith("torch_"):
            for s in sets:  # undo torch's zeroing: never time the next provider on zeros
                s.acc.copy_(common.random_tensor(s.acc.shape, torch.float32, ctx.device, ctx.generator))


# ---------------------------------------------------------------------------------------------
# Timing one provider, and a group's rows
# ---------------------------------------------------------------------------------------------


def _time_provider(group: Group, provider: str, ctx: Context, prepare) -> Dict:
    """One row. ``prepare()`` checks the provider once and returns (the check: its relative
    error, or a dict of ``max_rel_err`` and, for steps, ``lp_mismatch``; argument sets; fn) to
    time ``fn(arg_set)`` with. An exception becomes a row with the error in ``note`` and no
    timing, so one broken backend does not stop the suite."""
    row = {
        "section": group.section,
        "op": group.op,
        "workload": group.workload.name,
        "n_tensors": len(group.workload.shapes),
        "numel": group.workload.numel,
        "grad_dtype": common.dtype_name(group.grad_dtype) if group.grad_dtype is not None else "-",
        "provider": provider,
        "kind": "torch" if provider.startswith("torch_") else "fused_accum",
        "bytes_per_elem": group.bytes_per_elem,
    }
    try:
        err, arg_sets, fn = prepare()
        timing = common.measure(fn, arg_sets, ctx.device, ctx.timing)
        del arg_sets  # drop per-set torch optimizers (and their state) before the next provider
    except Exception as exc:  # noqa: BLE001 - reported in the row and the log
        row.update(
            ms=math.nan,
            gbps=math.nan,
            pct_of_copy=math.nan,
            max_rel_err=math.nan,
            ok=False,
            note=f"{type(exc).__name__}: {exc}"[:300],
        )
        return row
    check = err if isinstance(err, dict) else {"max_rel_err": err}
    rate = common.gbps(group.bytes_per_elem * group.workload.numel, timing.median_ms)
    row.update(
        ms=timing.median_ms,
        ms_min=timing.min_ms,
        ms_max=timing.max_ms,
        spread_pct=timing.spread_pct,
        samples=len(timing.samples_ms),
        calls_per_sample=timing.calls_per_sample,
        rotations=timing.rotations,
        gbps=rate,
        pct_of_copy=100.0 * rate / ctx.copy_gbps,
        **check,
        ok=check["max_rel_err"] <= CHECK_TOL and check.get("lp_mismatch", 0) <= LP_MISMATCH_TOL,
        note="",
    )
    return row


def run_group(group: Group, ctx: Context) -> Iterator[Dict]:
    """Yield one row per provider (speedups are filled in by :func:`add_speedups`)."""
    runner = _run_accumulate if group.section == "accumulate" else _run_step
    yield from runner(group, ctx)


# Every row add_speedups was given in this process, by (op, workload, numel, grad dtype,
# provider): benchmarks/run.py calls it once per group, and a remainder group's speedups are
# read off its fp32-master twin's group, which the plan runs before it.
_seen_rows: Dict[tuple, Dict] = {}


def add_speedups(rows: List[Dict]) -> None:
    """Per group: ``speedup_vs_torch`` = best torch provider's median / this row's median (for
    a remainder op: torch's best on its fp32-master twin, the only way torch has); remainder
    rows also get ``speedup_vs_fp32_master`` = the same provider's twin row's median / theirs
    (NaN in every other row, and where the twin was not measured)."""
    key = lambda r, op=None: (op or r["op"], r["workload"], r["numel"], r["grad_dtype"])  # noqa: E731
    for r in rows:
        _seen_rows[(*key(r), r["provider"])] = r
    for r in rows:
        group = key(r, REMAINDER_OPS.get(r["op"]))
        torch_rows = [
            x
            for (*k, _), x in _seen_rows.items()
            if tuple(k) == group and x["kind"] == "torch" and math.isfinite(x["ms"])
        ]
        fastest = min(torch_rows, key=lambda x: x["ms"], default=None)
        r["best_torch"] = fastest["provider"] if fastest else ""
        ms_best = fastest["ms"] if fastest else math.nan
        r["speedup_vs_torch"] = ms_best / r["ms"] if math.isfinite(r["ms"]) else math.nan
        r["speedup_vs_fp32_master"] = math.nan
        if r["op"] in REMAINDER_OPS:
            twin = _seen_rows.get((*group, r["provider"]), {}).get("ms", math.nan)
            r["speedup_vs_fp32_master"] = twin / r["ms"] if math.isfinite(r["ms"]) else math.nan


def format_row(r: Dict) -> str:
    head = (
        f"{r['op']:<17} {r['workload']:<10} {common.fmt_numel(r['numel']):>7} {r['grad_dtype']:<4} {r['provider']:<14}"
    )
    if not math.isfinite(r["ms"]):
        return f"{head} FAILED {r['note']}"
    speed = r.get("speedup_vs_torch", math.nan)
    speed_txt = f"{speed:6.2f}x" if math.isfinite(speed) else "      -"
    twin = r.get("speedup_vs_fp32_master")
    if twin is not None and math.isfinite(twin):
        speed_txt += f" ({twin:.2f}x the fp32-master step)"
    flag = ""
    if not r["ok"]:
        flag = f"  WRONG (rel err {r['max_rel_err']:.1e}"
        if r.get("lp_mismatch"):
            flag += f", {r['lp_mismatch']} bf16 params not their own master rounded"
        flag += ")"
    return (
        f"{head} {r['ms']:9.4f} ms  {r['gbps']:8.1f} GB/s  {r['pct_of_copy']:5.1f}% copy  "
        f"{speed_txt}  ±{r['spread_pct']:.0f}%{flag}"
    )


def plan(
    device: torch.device,
    flat_sizes: Sequence[int],
    lists: Sequence[Workload],
    grad_dtypes: Sequence[torch.dtype],
    step_workloads: Sequence[Workload],
    ops: Sequence[str] = ACC_OPS + STEP_OPS,
) -> List[Group]:
    """The groups to run, most important first, so a time budget that cuts the run short cuts
    the least useful part: the goal groups (:func:`is_goal_group`: the GPU goals' bf16
    accumulate and AdamW on one flat tensor of >= GOAL_MIN_NUMEL elements, largest first), then
    bf16 accumulate, the steps, and the other gradient dtypes."""
    groups: List[Group] = []
    acc_workloads = [flat(n) for n in flat_sizes] + list(lists)
    for i, dt in enumerate(grad_dtypes):
        for op in (o for o in ACC_OPS if o in ops):
            groups += [Group(op, w, dt, default_providers(op, device)) for w in acc_workloads]
        if i == 0:
            for op in (o for o in STEP_OPS if o in ops):
                gd = dt if op in FUSED_LAST_OPS else None
                groups += [Group(op, w, gd, default_providers(op, device)) for w in step_workloads]
    goal = sorted((g for g in groups if is_goal_group(g)), key=lambda g: -g.workload.numel)  # stable
    # then what scripts/device_goals.py reports beside the goals: the remainder mode's AdamW on
    # the same large flat tensors (and its twin, the fp32-master fused last micro-batch)
    report = [g for g in groups if is_report_group(g) and not is_goal_group(g)]
    report.sort(key=lambda g: -g.workload.numel)
    return goal + report + [g for g in groups if not is_goal_group(g) and not is_report_group(g)]


# The GPU goals' "% of a copy" verdicts (scripts/device_goals.py) are given only from this many
# elements: a 16M-element bf16 accumulate moves 168 MB (~40 us at 4.3 TB/s), far above a
# launch's few microseconds, so the number is bandwidth; at 1M it is mostly launch latency.
GOAL_MIN_NUMEL = 2**24
GOAL_OPS = ("accumulate_add", "adamw")


def is_report_group(group: Group) -> bool:
    """Whether ``group`` is one scripts/device_goals.py reports the remainder mode from: a large
    flat tensor's remainder AdamW or fused last micro-batch, or its fp32-master twin."""
    return (
        (group.op in REMAINDER_OPS or group.op in REMAINDER_OPS.values())
        and group.workload.name == "flat"
        and group.workload.numel >= GOAL_MIN_NUMEL
    )


def is_goal_group(group: Group) -> bool:
    """Whether ``group`` is one a GPU goal reads: a bandwidth-bound flat tensor, bf16 grads."""
    return (
        group.op in GOAL_OPS
        and group.workload.name == "flat"
        and group.workload.numel >= GOAL_MIN_NUMEL
        and group.grad_dtype in (torch.bfloat16, None)
    )


# ---------------------------------------------------------------------------------------------
# CPU AdamW against DeepSpeed and torch, providers interleaved, at 1 and 2 threads
# ---------------------------------------------------------------------------------------------
#
# The question issue 11 asks of the CPU kernels: is our AdamW step as fast as DeepSpeed's
# DeepSpeedCPUAdam (what ZeRO-Offload runs) and torch's AdamW(fused=True), one thread and two,
# on one big tensor and on GPT-2 small's 148? Each round times every provider once, in a fresh
# random order, so load that comes and goes on a shared machine lands on all of them alike
# (timing one provider after another lets a burst of other work fall on one). The same process
# runs 1 and 2 threads, so thread scaling is read off one run.
#
# Providers, each on its own copy of the params and state (gradients are shared, read-only):
#   cpu          fused_accum's C++ kernel: ext.step(ops.adam_step, ...) from the fp32 gradient, coef 1
#   torch_fused  torch.optim.AdamW(fused=True), .grad = the gradient
#   deepspeed    deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), when deepspeed is
#                installed (optional: it builds its C++ op with ninja on first use)
# "adamw_bf16_master": fp32 master + bf16 param copy, ours writing the bf16 copy in the step,
# the others followed by torch._foreach_copy_ into the bf16 params. There, wherever "cpu" runs,
# "cpu_remainder" runs too, in the same rounds: the same kernel with exact 2-byte masters (bf16
# params + int16 remainders, issue 28: 28 bytes per element against the fp32 master's 32),
# whose rows carry speedup_vs_fp32_master (the "cpu" row's median over theirs, same threads):
# issue 28 asks this mode to be no slower than the fp32-master step, measured interleaved.

CPU_ADAM_PROVIDERS = ("cpu", "torch_fused", "deepspeed")
CPU_ADAM_OPS = ("adamw", "adamw_bf16_master")


def deepspeed_unavailable() -> str:
    """ "" when DeepSpeedCPUAdam can be used here, else why not."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or its op does not build here
        return f"{type(exc).__name__}: {exc}"[:200]
    return ""


def deepspeed_status(providers: Sequence[str], why_not: str) -> str:
    """What a cpu_adam row says of DeepSpeed: "ran", "not installed", "not run" (not among the
    providers asked for: the smoke run leaves it out) or "unavailable (why)"."""
    if "deepspeed" not in providers:
        return "not run"
    if not why_not:
        return "ran"
    if why_not.startswith(("ModuleNotFoundError", "ImportError: No module")):
        return "not installed"
    return f"unavailable ({why_not})"


def _cpu_adam_step(provider: str, params, grads, lp, hp) -> Callable[[], None]:
    """A zero-argument AdamW step on fp32 ``params`` (state created here), writing ``lp`` (bf16
    copies) too when it is not empty."""
    lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
    if provider == "cpu_remainder":  # params: the fp32 masters, split here; rebuilt by the caller
        weights, remainders = [], []
        for p in params:
            w, r = reference.split_master(p.view(-1))
            weights.append(w)
            remainders.append(r)
        m = [torch.zeros_like(p).view(-1) for p in params]
        v = [torch.zeros_like(p).view(-1) for p in params]
        records = (
            ops.StepTensors(
                weights,
                [g.view(-1) for g in grads],
                torch.ones(len(params)),
                torch.tensor(lr),
                torch.tensor(1.0),
                remainders=remainders,
            ),
            ops.adam_step.states(m, v),
            ops.adam_step.hyper(b1, b2, eps, wd, True, False),
        )
        ours = backends.get("cpu")

        def call():
            ours.step(ops.adam_step, *records)

        call.masters = lambda: [  # the fp32 masters the step holds now
            reference.rebuild_master(w, r).view(p.shape) for w, r, p in zip(weights, remainders, params)
        ]
        return call
    if provider == "cpu":
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        accs = [g.view(-1) for g in grads]
        flat_params = [p.view(-1) for p in params]
        steps = torch.ones(len(params))
        lr_t, coef = torch.tensor(lr), torch.tensor(1.0)
        ours = backends.get("cpu")
        lp_flat = [x.view(-1) for x in lp]
        records = (
            ops.StepTensors(flat_params, accs, steps, lr_t, coef, lp_params=lp_flat),
            ops.adam_step.states(m, v),
            ops.adam_step.hyper(b1, b2, eps, wd, True, False),
        )
        return lambda: ours.step(ops.adam_step, *records)
    leaves = [torch.nn.Parameter(p, requires_grad=True) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g
    if provider == "torch_fused":
        opt = torch.optim.AdamW(leaves, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
    elif provider == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(leaves, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adamw_mode=True)
    else:
        raise ValueError(f"unknown provider {provider!r}")

    def call():
        opt.step()
        if lp:
            torch._foreach_copy_(lp, params)

    return call


def run_cpu_adam(
    workload: Workload,
    op: str,
    threads: Sequence[int],
    timing: common.TimingConfig,
    providers: Sequence[str] = CPU_ADAM_PROVIDERS,
    seed: int = 0,
) -> List[Dict]:
    """Rows for one workload and op: every provider at every thread count, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen) for s in workload.shapes]
    init = [torch.randn(s, generator=gen) for s in workload.shapes]
    hp = dict(ADAMW_HP)
    runnable, rows = [], []
    base = {
        "section": "cpu_adam",
        "op": op,
        "workload": workload.name,
        "n_tensors": len(workload.shapes),
        # read grad, param, m, v; write param, m, v (28), and the bf16 copy read and written (4)
        "numel": workload.numel,
        "bytes_per_elem": common.step_bytes("adamw") - (4 if op == "adamw" else 0),
    }
    if op == "adamw_bf16_master" and "cpu" in providers and "cpu_remainder" not in providers:
        providers = (*providers, "cpu_remainder")
    why_not = {"deepspeed": deepspeed_unavailable()} if "deepspeed" in providers else {}
    base["deepspeed"] = deepspeed_status(providers, why_not.get("deepspeed", ""))
    steps: Dict[str, Callable[[], None]] = {}
    outputs: Dict[str, List[torch.Tensor]] = {}
    for provider in providers:
        if why_not.get(provider):
            rows.append(
                {
                    **base,
                    "provider": provider,
                    "threads": "-",
                    "ms": math.nan,
                    "ok": False,
                    "note": f"unavailable: {why_not[provider]}",
                }
            )
            continue
        params = [p.clone() for p in init]
        # the bf16 copies start as their masters' rounding, as in the optimizer (the step adopts
        # any element that is not: a weight written from outside)
        lp = [p.to(torch.bfloat16) for p in init] if op != "adamw" else []
        steps[provider] = _cpu_adam_step(provider, params, grads, lp, hp)
        steps[provider]()  # one step from the same start: the check (and lazy state creation)
        held = getattr(steps[provider], "masters", lambda: params)()  # (cpu_remainder: rebuilt)
        outputs[provider] = [p.clone() for p in held]
        runnable.append(provider)
    # The check: one step of each provider against torch's, from the same params and gradient.
    want = torch.cat([p.view(-1) for p in outputs.get("torch_fused", [])]) if "torch_fused" in outputs else None
    errors = {
        p: (common.rel_error(torch.cat([x.view(-1) for x in outputs[p]]), want) if want is not None else math.nan)
        for p in runnable
    }
    del outputs
    threads_before = torch.get_num_threads()
    per_thread: Dict[int, Dict[str, common.Timing]] = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            per_thread[n] = common.measure_interleaved({p: steps[p] for p in runnable}, timing, seed=seed + n)
    finally:
        torch.set_num_threads(threads_before)
    for n in threads:
        for p in runnable:
            t = per_thread[n][p]
            row_bytes = remainder_step_bytes() if p == "cpu_remainder" else base["bytes_per_elem"]
            rows.append(
                {
                    **base,
                    "bytes_per_elem": row_bytes,
                    "provider": p,
                    "threads": n,
                    "ms": t.median_ms,
                    "ms_min": t.min_ms,
                    "ms_max": t.max_ms,
                    "spread_pct": t.spread_pct,
                    "samples": len(t.samples_ms),
                    "calls_per_sample": t.calls_per_sample,
                    "gbps": common.gbps(row_bytes * workload.numel, t.median_ms),
                    "max_rel_err_vs_torch": errors[p],
                    "ok": not errors[p] > CHECK_TOL,
                    "note": "",
                }
            )
    by = {(r["provider"], r["threads"]): r["ms"] for r in rows if math.isfinite(r["ms"])}
    for r in rows:
        if not math.isfinite(r["ms"]):
            continue
        n = r["threads"]
        r["speedup_vs_deepspeed"] = by.get(("deepspeed", n), math.nan) / r["ms"]
        r["speedup_vs_torch"] = by.get(("torch_fused", n), math.nan) / r["ms"]
        r["thread_scaling"] = by.get((r["provider"], min(threads)), math.nan) / r["ms"]  # vs fewest threads
        r["speedup_vs_fp32_master"] = math.nan  # (every row has the column)
        if r["provider"] == "cpu_remainder":
            r["speedup_vs_fp32_master"] = by.get(("cpu", n), math.nan) / r["ms"]
    return rows


def format_cpu_adam_row(r: Dict) -> str:
    head = f"{r['op']:<17} {r['workload']:<10} {common.fmt_numel(r['numel']):>7} {r['provider']:<13} threads={r['threads']}"
    if not math.isfinite(r["ms"]):
        return f"{head} {r['note']}"
    flag = "" if r["ok"] else f"  WRONG (rel err vs torch {r['max_rel_err_vs_torch']:.1e})"
    vs_ds = r.get("speedup_vs_deepspeed")  # NaN (or null, read back from results.json) without DeepSpeed
    ds = f"{vs_ds:5.2f}x" if vs_ds is not None and math.isfinite(vs_ds) else r.get("deepspeed", "not run")
    twin = r.get("speedup_vs_fp32_master")
    twin_txt = f"  vs fp32 master {twin:5.2f}x" if twin is not None and math.isfinite(twin) else ""
    return (
        f"{head} {r['ms']:9.3f} ms ±{r['spread_pct']:3.0f}%  {r['gbps']:6.1f} GB/s  "
        f"vs deepspeed {ds}  vs torch {r['speedup_vs_torch']:5.2f}x{twin_txt}  "
        f"thread scaling {r['thread_scaling']:4.2f}x{flag}"
    )


# --- out-of-place steps (issue 37) ----------------------------------------------------------
#
# The host step out of place (issue 37): what offload's double-buffered step costs over a plain one.
#
# For one bucket of B MB of parameters, AdamW on the C++ CPU backend, three ways, interleaved:
#
# - ``plain``: the step in place;
# - ``sources``: the step out of place, reading the old values of everything it changes from
#   ``sources`` (ops.StepTensors.sources: offload's live buffers) and writing the new ones into
#   the written lists (their twins);
# - ``copy+step``: the naive way, each written buffer copied over from its source (``copy_``) and
#   then the step in place.
#
# Formats: ``fp32`` (fp32 params stepped in place: params, exp_avg, exp_avg_sq written; B MB of
# fp32 params) and ``bf16+master`` (fp32 masters with bf16 copies: masters, bf16 copy, exp_avg,
# exp_avg_sq written; B MB of bf16 params, so twice the elements). Prints the median time of each
# and the ratios to ``plain``, per thread count.
#
#     .venv/bin/python -m benchmarks.kernels [--sizes-mb 4 25] [--threads 1 2] [--repeats 15] [--cold]


STEP_SOURCES_HYPER = ops.adam_step.hyper(
    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False
)


def _sources_bucket(fmt: str, mb: float):
    """(StepTensors in place, AdamStates, the written tensors in the sources' order)."""
    elsize = 4 if fmt == "fp32" else 2
    n = int(mb * 2**20) // elsize
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    acc = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    lp = [master.bfloat16()] if fmt == "bf16+master" else []
    t = ops.StepTensors(
        [master], [acc], torch.ones(1), torch.tensor(1e-4, dtype=torch.float64), torch.ones(()), lp_params=lp
    )
    written = [master, *lp, m, v]
    return n, t, ops.adam_step.states([m], [v]), written


def run_step_sources(sizes_mb, threads, repeats: int, backend: str = "cpu", cold: bool = False) -> list:
    """Median seconds per way. ``cold``: a 128 MB buffer is written between calls (not timed),
    so a bucket's buffers come from memory, as in offload, where the other buckets' steps have
    passed through the caches since this one's last step; else the bucket steps again and again,
    from L3 where it fits."""
    rows = []
    scratch = torch.empty(32 * 2**20) if cold else None
    for fmt in ("fp32", "bf16+master"):
        for mb in sizes_mb:
            n, t, s, written = _sources_bucket(fmt, mb)
            sources = [x.clone() for x in written]  # (the live buffers: read, never written)
            out_of_place = t._replace(sources=sources)

            def plain():
                ops.adam_step(t, s, STEP_SOURCES_HYPER, backend)

            def sourced():
                ops.adam_step(out_of_place, s, STEP_SOURCES_HYPER, backend)

            def copy_then_step():
                for dst, src in zip(written, sources):
                    dst.copy_(src)
                ops.adam_step(t, s, STEP_SOURCES_HYPER, backend)

            ways = {"plain": plain, "sources": sourced, "copy+step": copy_then_step}
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                times = {name: [] for name in ways}
                cpu = {name: [] for name in ways}
                for f in ways.values():  # warm: pages touched, clones resolved
                    f()
                for _ in range(repeats):
                    for name, f in ways.items():  # interleaved: drift hits every way alike
                        if scratch is not None:
                            scratch.fill_(float(len(times[name])))
                        start, start_cpu = time.perf_counter(), time.process_time()
                        f()
                        times[name].append(time.perf_counter() - start)
                        cpu[name].append(time.process_time() - start_cpu)
                med = {name: statistics.median(x) for name, x in times.items()}
                med.update({f"cpu {name}": statistics.median(x) for name, x in cpu.items()})
                rows.append((fmt, mb, n, n_threads, med))
    return rows


def step_sources_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="the host step out of place against in place (issue 37)")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 25])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--cold", action="store_true", help="evict the caches between calls (128 MB written)")
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, AdamW, backend {args.backend}, median of {args.repeats} interleaved runs, "
        f"{'cold (caches evicted between calls)' if args.cold else 'warm (the bucket steps again and again)'}"
    )
    print("wall: median wall-clock ms; cpu: median process CPU ms (all threads; on a shared machine the")
    print("one-thread cpu ratios leave out the time the thread waited for a core)")
    print(f"{'format':>12} {'MB':>5} {'elements':>10} {'thr':>3} {'plain ms':>9} {'sources':>9} {'copy+step':>10}"
          f" {'sources/plain':>14} {'copy+step/plain':>16} {'cpu: s/p':>9} {'cpu: c/p':>9}")  # fmt: skip
    for fmt, mb, n, n_threads, med in run_step_sources(
        args.sizes_mb, args.threads, args.repeats, args.backend, args.cold
    ):
        p, b, c = (med[k] * 1e3 for k in ("plain", "sources", "copy+step"))
        cp, cb, cc = (med[f"cpu {k}"] for k in ("plain", "sources", "copy+step"))
        print(
            f"{fmt:>12} {mb:>5g} {n:>10} {n_threads:>3} {p:>9.2f} {b:>9.2f} {c:>10.2f} {b / p:>14.2f} {c / p:>16.2f}"
            f" {cb / cp:>9.2f} {cc / cp:>9.2f}"
        )


if __name__ == "__main__":  # python -m benchmarks.kernels [--cold] ...: the out-of-place step's table
    step_sources_main()
