"""Each algorithm's update rule in the Triton step kernel: a ``prepare`` and an ``update``
(@triton.jit, passed to :func:`.kernels.step_kernel` as constexprs) and the host's
``arguments``, one :class:`.kernels.Update` per step op in :data:`UPDATES`. Each follows its
spec in :mod:`fused_accum.backends.reference_updates` term by term, as the kernels follow the
reference (see :mod:`.kernels`: the table's columns, ``STATE0..STATE2`` an update's states).
"""
from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from .bits import _double, _pow_whole, packed_double
from .kernels import NUMEL, ROWS, STATE0, STATE1, STATE2, Update, _address, _at, _step_count


# --- SGD: reference.sgd_step -------------------------------------------------------------------


@triton.jit
def _sgd_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    neg_lr = (-tl.load(lr_ptr)).to(tl.float32)  # torch's fused SGD: its double -lr, in fp32
    return neg_lr, _step_count(steps, row) == 1.0


@triton.jit
def _sgd_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    neg_lr, first_step = per
    momentum, one_minus_dampening, weight_decay = hyper
    HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV = SWITCHES
    if HAS_WEIGHT_DECAY:
        g = tl.fma(p, weight_decay, g)
    if HAS_MOMENTUM:
        # torch starts the buffer as a copy of the first gradient, without dampening
        buf = _address(row, STATE0, tl.float32)
        new_buf = tl.where(
            first_step, g,
            tl.fma(g, one_minus_dampening, tl.load(_at(buf, idx, ALIGNED), mask=mask, other=0.0) * momentum),
        )  # fmt: skip
        tl.store(_at(buf, idx, ALIGNED), new_buf, mask=mask)
        if NESTEROV:
            g = tl.fma(new_buf, momentum, g)
        else:
            g = new_buf
    return tl.fma(g, neg_lr, p)


def _sgd_arguments(h, s) -> tuple:
    hyper = (float(h.momentum), 1.0 - float(h.dampening), float(h.weight_decay))
    return hyper, (h.weight_decay != 0, h.momentum != 0, bool(h.nesterov))


# --- Adam and AdamW: reference.adam_step -------------------------------------------------------


@triton.jit
def _adam_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    beta1_high, beta1_low, beta2_high, beta2_low, decay_high, decay_low, _, _, _, _, _ = hyper
    lr64 = tl.load(lr_ptr)
    step = _step_count(steps, row)
    # The per-tensor scalars in double, as torch's fused Adam computes them (from the double lr,
    # betas and weight decay and the step count), rounded to fp32 once: -lr / (1 - beta1**step),
    # sqrt(1 - beta2**step), 1 - lr * weight_decay. Once per program: fp64 speed does not matter.
    neg_step_size = (-(lr64 / (1.0 - _pow_whole(_double(beta1_high, beta1_low), step)))).to(tl.float32)
    # fp64 tl.sqrt is IEEE-rounded (sqrt.rn.f64); only fp32's is approximate
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow_whole(_double(beta2_high, beta2_low), step)).to(tl.float32)
    decay = (1.0 - lr64 * _double(decay_high, decay_low)).to(tl.float32)
    return neg_step_size, bias_correction2_sqrt, decay


@triton.jit
def _adam_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    neg_step_size, bias_correction2_sqrt, decay = per
    _, _, _, _, _, _, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay = hyper
    HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD = SWITCHES
    exp_avg = _address(row, STATE0, tl.float32)
    exp_avg_sq = _address(row, STATE1, tl.float32)
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay
        else:
            g = tl.fma(p, weight_decay, g)
    # exp_avg.lerp_(g, 1 - beta1) as torch computes a lerp: from the nearer end, one FMA
    m = tl.load(_at(exp_avg, idx, ALIGNED), mask=mask, other=0.0)
    m = tl.where(one_minus_beta1 < 0.5, tl.fma(one_minus_beta1, g - m, m),
                 tl.fma(one_minus_beta1 - 1.0, g - m, g))
    v = tl.fma(g * one_minus_beta2, g, tl.load(_at(exp_avg_sq, idx, ALIGNED), mask=mask, other=0.0) * beta2)
    tl.store(_at(exp_avg, idx, ALIGNED), m, mask=mask)
    tl.store(_at(exp_avg_sq, idx, ALIGNED), v, mask=mask)
    if AMSGRAD:
        # torch.maximum: a NaN in either operand gives NaN (PTX max.f32 would drop it)
        max_exp_avg_sq = _address(row, STATE2, tl.float32)
        v = tl.maximum(tl.load(_at(max_exp_avg_sq, idx, ALIGNED), mask=mask, other=0.0), v,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(_at(max_exp_avg_sq, idx, ALIGNED), v, mask=mask)
    # IEEE-rounded sqrt and division, as torch's: tl.sqrt and / compile to sqrt.approx.ftz and
    # div.full (~2 ulp, denormal v flushed to 0) and would save nothing here: at 30 bytes per
    # element an H200 (4.8 TB/s, 67 fp32 TFLOP/s) has ~200 instructions per element to spare.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    return p + tl.div_rn(neg_step_size * m, denom)


def _adam_arguments(h, s) -> tuple:
    beta1, beta2, weight_decay = float(h.beta1), float(h.beta2), float(h.weight_decay)
    doubles = (*packed_double(beta1), *packed_double(beta2), *packed_double(weight_decay))
    hyper = (*doubles, beta2, 1.0 - beta1, 1.0 - beta2, float(h.eps), weight_decay)
    return hyper, (weight_decay != 0, bool(h.decoupled), bool(s.max_exp_avg_sqs))


# --- Lion: reference.lion_step (no step count: Lion has no bias correction) --------------------


@triton.jit
def _lion_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    decay_high, decay_low, _, _, _, _ = hyper
    lr64 = tl.load(lr_ptr)
    # as the reference (lucidrains' ops with a Python float lr): lr rounded to fp32, the decay
    # factor formed in double
    return lr64.to(tl.float32), (1.0 - lr64 * _double(decay_high, decay_low)).to(tl.float32)


@triton.jit
def _lion_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    lr, decay = per
    _, _, beta1, beta2, one_minus_beta1, one_minus_beta2 = hyper
    exp_avg = _address(row, STATE0, tl.float32)
    p = p * decay
    m = tl.load(_at(exp_avg, idx, ALIGNED), mask=mask, other=0.0)
    c = tl.fma(g, one_minus_beta1, m * beta1)
    # torch.sign: -1, 0 or 1, and 0 for nan (both comparisons are false)
    direction = (c > 0).to(tl.float32) - (c < 0).to(tl.float32)
    tl.store(_at(exp_avg, idx, ALIGNED), tl.fma(g, one_minus_beta2, m * beta2), mask=mask)
    return p - lr * direction  # direction is -1, 0 or 1: the product is exact


def _lion_arguments(h, s) -> tuple:
    beta1, beta2 = float(h.beta1), float(h.beta2)
    return (*packed_double(h.weight_decay), beta1, beta2, 1.0 - beta1, 1.0 - beta2), ()


# --- Adagrad: reference.adagrad_step -----------------------------------------------------------


@triton.jit
def _adagrad_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    lr_decay_high, lr_decay_low, _, _ = hyper
    # clr = lr / (1 + (step - 1) * lr_decay) in double, rounded to fp32 once (torch's fused kernel)
    step = _step_count(steps, row).to(tl.float64)
    return (tl.load(lr_ptr) / (1.0 + (step - 1.0) * _double(lr_decay_high, lr_decay_low))).to(tl.float32)


@triton.jit
def _adagrad_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    clr = per
    _, _, weight_decay, eps = hyper
    (HAS_WEIGHT_DECAY,) = SWITCHES
    state_sum = _address(row, STATE0, tl.float32)
    if HAS_WEIGHT_DECAY:
        g = tl.fma(p, weight_decay, g)
    total = tl.fma(g, g, tl.load(_at(state_sum, idx, ALIGNED), mask=mask, other=0.0))
    tl.store(_at(state_sum, idx, ALIGNED), total, mask=mask)
    # IEEE-rounded sqrt and division, as torch's (see _adam_update)
    return p - tl.div_rn(clr * g, tl.sqrt_rn(total) + eps)


def _adagrad_arguments(h, s) -> tuple:
    weight_decay = float(h.weight_decay)
    return (*packed_double(h.lr_decay), weight_decay, float(h.eps)), (weight_decay != 0,)


# --- AdEMAMix: reference.ademamix_step ---------------------------------------------------------


@triton.jit
def _ademamix_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    (beta1_high, beta1_low, beta2_high, beta2_low, beta3_high, beta3_low, alpha_high, alpha_low, t_high, t_low,
     log_beta1_high, log_beta1_low, log_beta3_high, log_beta3_low, decay_high, decay_low, _, _, _, _) = hyper  # fmt: skip
    _, WARMUP = SWITCHES
    lr64 = tl.load(lr_ptr)
    step = _step_count(steps, row)
    # in double, rounded to fp32 once (see _adam_prepare): the bias corrections, the decay factor,
    # and alpha and 1 - beta3 at this step, warmed up over t_alpha_beta3 steps where there is one
    bias_correction1 = (1.0 - _pow_whole(_double(beta1_high, beta1_low), step)).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow_whole(_double(beta2_high, beta2_low), step)).to(tl.float32)
    alpha = _double(alpha_high, alpha_low)
    beta3 = _double(beta3_high, beta3_low)
    if WARMUP:
        t = _double(t_high, t_low)
        log_beta1, log_beta3 = _double(log_beta1_high, log_beta1_low), _double(log_beta3_high, log_beta3_low)
        ratio = step.to(tl.float64) / t
        alpha = tl.minimum(step.to(tl.float64) * alpha / t, alpha)
        beta3 = tl.minimum(tl.exp(log_beta1 * log_beta3 / ((1.0 - ratio) * log_beta3 + ratio * log_beta1)), beta3)
    decay = (1.0 - lr64 * _double(decay_high, decay_low)).to(tl.float32)
    return ((-lr64).to(tl.float32), decay, bias_correction1, bias_correction2_sqrt, alpha.to(tl.float32),
            (1.0 - beta3).to(tl.float32))


@triton.jit
def _lerp(a, b, w):
    """torch.lerp(a, b, w) as torch computes it (w in [0, 1]): from the nearer end, one FMA."""
    return tl.where(w < 0.5, tl.fma(w, b - a, a), tl.fma(w - 1.0, b - a, b))


@triton.jit
def _ademamix_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    neg_lr, decay, bias_correction1, bias_correction2_sqrt, alpha, one_minus_beta3 = per
    beta2, one_minus_beta1, one_minus_beta2, eps = hyper[16], hyper[17], hyper[18], hyper[19]
    HAS_WEIGHT_DECAY, _ = SWITCHES
    exp_avg = _address(row, STATE0, tl.float32)
    exp_avg_sq = _address(row, STATE1, tl.float32)
    exp_avg_slow = _address(row, STATE2, tl.float32)
    if HAS_WEIGHT_DECAY:
        p = p * decay
    m = _lerp(tl.load(_at(exp_avg, idx, ALIGNED), mask=mask, other=0.0), g, one_minus_beta1)
    v = tl.fma(g * one_minus_beta2, g, tl.load(_at(exp_avg_sq, idx, ALIGNED), mask=mask, other=0.0) * beta2)
    slow = _lerp(tl.load(_at(exp_avg_slow, idx, ALIGNED), mask=mask, other=0.0), g, one_minus_beta3)
    tl.store(_at(exp_avg, idx, ALIGNED), m, mask=mask)
    tl.store(_at(exp_avg_sq, idx, ALIGNED), v, mask=mask)
    tl.store(_at(exp_avg_slow, idx, ALIGNED), slow, mask=mask)
    # IEEE-rounded sqrt and divisions, as torch's (see _adam_update)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    update = tl.fma(slow, alpha, tl.div_rn(m, bias_correction1))
    return p + tl.div_rn(neg_lr * update, denom)


def _ademamix_arguments(h, s) -> tuple:
    beta1, beta2, beta3 = float(h.beta1), float(h.beta2), float(h.beta3)
    warmup = h.t_alpha_beta3 is not None
    # the logs on the host, as pytorch-optimizer takes them (math.log); unused without a warm-up
    t, logs = (float(h.t_alpha_beta3), (math.log(beta1), math.log(beta3))) if warmup else (1.0, (0.0, 0.0))
    doubles = (beta1, beta2, beta3, float(h.alpha), t, *logs, float(h.weight_decay))
    hyper = (*(x for d in doubles for x in packed_double(d)), beta2, 1.0 - beta1, 1.0 - beta2, float(h.eps))
    return hyper, (h.weight_decay != 0, warmup)


# --- Muon's prologue and epilogue: reference.muon_prologue, reference.muon_epilogue ------------


@triton.jit
def _muon_prologue_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    return 0.0  # (no per-tensor scalar)


@triton.jit
def _lerp_either(a, b, w, w_minus_1):
    """torch.lerp(a, b, w) for any weight: from the nearer end, one FMA (``w_minus_1``: w - 1
    in fp32, from the host: the interpreter would form it from w in double)."""
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, b - a, a), tl.fma(w_minus_1, b - a, b))


@triton.jit
def _muon_prologue_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    momentum, momentum_minus_1, one_minus_momentum, minus_momentum = hyper
    (NESTEROV,) = SWITCHES
    buf_ptr = _at(_address(row, STATE0, tl.float32), idx, ALIGNED)
    buf = _lerp_either(tl.load(buf_ptr, mask=mask, other=0.0), g, one_minus_momentum, minus_momentum)
    tl.store(buf_ptr, buf, mask=mask)
    update = buf
    if NESTEROV:
        update = _lerp_either(g, buf, momentum, momentum_minus_1)
    tl.store(_at(_address(row, STATE1, tl.float32), idx, ALIGNED), update, mask=mask)
    return p


def _muon_prologue_arguments(h, s) -> tuple:
    # torch.lerp's fp32 weights (momentum, 1 - momentum formed in double) and each less 1 in fp32
    momentum, one_minus = np.float32(h.momentum), np.float32(1.0 - float(h.momentum))
    weights = (momentum, momentum - np.float32(1), one_minus, one_minus - np.float32(1))
    return tuple(map(float, weights)), (bool(h.nesterov),)


@triton.jit
def _muon_epilogue_prepare(row, steps, lr_ptr, hyper, SWITCHES: tl.constexpr):
    decay_high, decay_low, fifth_high, fifth_low = hyper
    (MATCH_RMS_ADAMW,) = SWITCHES
    lr64 = tl.load(lr_ptr)
    rows = tl.load(row + ROWS)
    columns = tl.load(row + NUMEL) // rows
    # in double, as torch.optim.Muon's Python floats: sqrt(max(1, rows / columns)), or
    # 0.2 * sqrt(max(rows, columns)); fp64 tl.sqrt is IEEE-rounded
    if MATCH_RMS_ADAMW:
        ratio = _double(fifth_high, fifth_low) * tl.sqrt(tl.maximum(rows, columns).to(tl.float64))
    else:
        ratio = tl.sqrt(tl.maximum(rows.to(tl.float64) / columns.to(tl.float64), 1.0))
    return (1.0 - lr64 * _double(decay_high, decay_low)).to(tl.float32), (-(lr64 * ratio)).to(tl.float32)


@triton.jit
def _muon_epilogue_update(row, idx, mask, g, p, per, hyper, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr):
    decay, neg_lr = per
    return tl.fma(g, neg_lr, p * decay)  # g: the middle's output (the op's input)


def _muon_epilogue_arguments(h, s) -> tuple:
    return (*packed_double(h.weight_decay), *packed_double(0.2)), (bool(h.match_rms_adamw),)


# Each step op's update rule, by the op's name (fused_accum.ops.kernel_ops).
UPDATES = {
    "sgd_step": Update(_sgd_prepare, _sgd_update, _sgd_arguments),
    "adam_step": Update(_adam_prepare, _adam_update, _adam_arguments, wide_in_place_16bit=True),
    "lion_step": Update(_lion_prepare, _lion_update, _lion_arguments, reads_steps=False),
    "adagrad_step": Update(_adagrad_prepare, _adagrad_update, _adagrad_arguments),
    # (16-bit params without a master spill 8 bytes at 4 warps, triton 3.9, sm_90: as Adam, twice the warps)
    "ademamix_step": Update(_ademamix_prepare, _ademamix_update, _ademamix_arguments, wide_in_place_16bit=True),
    "muon_prologue": Update(
        _muon_prologue_prepare, _muon_prologue_update, _muon_prologue_arguments, reads_steps=False, writes_param=False
    ),
    "muon_epilogue": Update(
        _muon_epilogue_prepare,
        _muon_epilogue_update,
        _muon_epilogue_arguments,
        reads_steps=False,
        reads_input=True,
        shaped=True,
    ),
}
