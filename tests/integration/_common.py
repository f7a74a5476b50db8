"""Shared pieces of the trainer integration tests: tiny models built from configs, synthetic
data, and the comparison of a run on ``fused_accum.AdamW`` with the same run on
``torch.optim.AdamW``.

Every run here uses k = 4 accumulation steps and an epoch of 11 micro-batches (22 samples,
batch size 2): windows of 4, 4 and 3 micro-batches, so each epoch ends with a short window,
where all three trainers step early.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import nn

import fused_accum

K = 4  # micro-batches per window (gradient_accumulation_steps / accumulate_grad_batches)
SAMPLES = 22  # with BATCH = 2: 11 micro-batches per epoch, not a multiple of K
BATCH = 2
SEQ = 16
VOCAB = 64
LR = 1e-2  # large enough that the update, not the initialisation, dominates the parameters
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
PARAM_RTOL = 1e-5  # |p_fused - p_torch| / |p_torch| per parameter tensor (fp32)
NORM_RTOL = 1e-5  # logged gradient norms


def torch_adamw(params, lr=LR):
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)


def fused_adamw(params, lr=LR, accum_steps=K):
    # The one line a user changes: accum_steps matches the trainer's accumulation.
    return fused_accum.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, accum_steps=accum_steps)


OPTIMIZERS = {
    "torch": torch_adamw,
    "fused": fused_adamw,
    # accum_steps only enables fusions: unknown, or not the trainer's, it must step as torch does
    "fused, accum_steps=None": lambda params, lr=LR: fused_adamw(params, lr, accum_steps=None),
    "fused, accum_steps=8": lambda params, lr=LR: fused_adamw(params, lr, accum_steps=2 * K),
}


# --- a tiny GPT-2 and its synthetic data -------------------------------------------------------


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT-2 with 32-wide embeddings, built from a config (no download). Its input
    embedding and LM head are one tied parameter. Dropout is off so that the run is a pure
    function of the optimizer.

    The attention's qkv bias (``c_attn.bias``) is frozen: softmax is invariant to the key bias,
    so its gradient is pure roundoff (~1e-9), and Adam with eps=1e-8 turns roundoff into steps
    of order lr. Two correct implementations then differ there by O(lr): torch's own
    ``AdamW(fused=True)`` ends 3.7e-2 (relative) away from its for-loop on that tensor in the
    Accelerate test below, and 3.5e-7 on every other parameter. Frozen, the comparison is
    well-posed (and the trainers see a partly frozen model, a common case)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_inner=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.2,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT-2 is
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(False)
    return model


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with a learnable pattern (each token is the previous plus one,
    with noise), as dicts of ``input_ids`` and ``labels``, as HF models take them."""

    def __init__(self, n: int = SAMPLES, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        ids = (start + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(n, SEQ, generator=g) < 0.2
        ids = torch.where(noise, torch.randint(0, VOCAB, (n, SEQ), generator=g), ids)
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# --- what a run leaves, and the comparison --------------------------------------------------


@dataclasses.dataclass
class Run:
    """What one training run leaves for comparison."""

    step_calls: int  # optimizer.step() calls that the trainer made
    param_steps: list  # per parameter: the step count in the optimizer's state (torch's "step")
    grad_norms: list  # the gradient norms the trainer logged, one per optimizer step
    params: dict  # name -> fp32 copy of the trained parameter
    extra: dict = dataclasses.field(default_factory=dict)  # test-specific quantities to compare


class StepCounter:
    """Counts ``step()`` calls through torch's step hooks (which fused_accum keeps)."""

    def __init__(self, optimizer):
        self.count = 0
        self.handle = optimizer.register_step_post_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def param_steps(optimizer) -> list:
    """Per-parameter step counts from the optimizer's state_dict, in param_groups order
    (0 for a parameter without state, as torch has none before its first update)."""
    sd = optimizer.state_dict()
    out = []
    for group in sd["param_groups"]:
        for pid in group["params"]:
            step = sd["state"].get(pid, {}).get("step", 0)
            out.append(float(step))
    return out


def snapshot(model: nn.Module) -> dict:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def total_grad_norm(parameters) -> float:
    """The global 2-norm of the ``.grad`` tensors that exist, as ``clip_grad_norm_`` computes
    it (0.0 when none exists): what a logger sees."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def _close(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def compare(reference: Run, fused: Run, what: str = "") -> None:
    """Assert that ``fused`` is the ``reference`` (torch.optim.AdamW) run (see ``differences``)."""
    problems = differences(reference, fused)
    assert not problems, f"{what}: fused_accum.AdamW differs from torch.optim.AdamW:\n  " + "\n  ".join(problems)


def compare_stages(*stages) -> None:
    """``compare`` for several ``(reference, fused, what)`` stages of one test (e.g. before a
    checkpoint and after resuming from it), reporting all that differ."""
    report = []
    for reference, fused, what in stages:
        problems = differences(reference, fused)
        if problems:
            report.append(f"{what}:\n  " + "\n  ".join(problems))
    assert not report, "fused_accum.AdamW differs from torch.optim.AdamW:\n" + "\n".join(report)


def differences(reference: Run, fused: Run) -> list:
    """How ``fused`` differs from the ``reference`` (torch.optim.AdamW) run, one line each:
    the number of step() calls, the optimizer step count of each parameter, the logged grad
    norms (relative NORM_RTOL; the first that differs), the parameters (PARAM_RTOL relative,
    per tensor, in norm; the worst one), and the test-specific extras."""
    problems = []
    if fused.step_calls != reference.step_calls:
        problems.append(f"step() calls: torch {reference.step_calls}, fused {fused.step_calls}")
    if fused.param_steps != reference.param_steps:
        diffs = [(i, r, f) for i, (r, f) in enumerate(zip(reference.param_steps, fused.param_steps)) if r != f]
        first = diffs[0] if diffs else None
        problems.append(
            f"optimizer step count per parameter: torch {sorted(set(reference.param_steps))}, "
            f"fused {sorted(set(fused.param_steps))} (first differing parameter index {first[0]}: "
            f"torch {first[1]}, fused {first[2]})"
            if first
            else f"optimizer step counts: {len(reference.param_steps)} params in torch, {len(fused.param_steps)} in fused"
        )
    if len(fused.grad_norms) != len(reference.grad_norms):
        problems.append(f"logged grad norms: torch logged {len(reference.grad_norms)}, fused {len(fused.grad_norms)}")
    for i, (r, f) in enumerate(zip(reference.grad_norms, fused.grad_norms)):
        if not _close(f, r, NORM_RTOL):
            problems.append(
                f"logged grad norm of optimizer step {i + 1} (first difference): torch {r:.7g}, fused {f:.7g} "
                f"(relative difference {abs(f - r) / max(abs(r), 1e-12):.2e}); all torch "
                f"{[round(x, 5) for x in reference.grad_norms]}, all fused {[round(x, 5) for x in fused.grad_norms]}"
            )
            break
    worst_name, worst = None, 0.0
    for name, ref in reference.params.items():
        got = fused.params[name]
        rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-12))
        if math.isnan(rel) or rel > worst and not math.isnan(worst):
            worst_name, worst = name, rel
    if not worst <= PARAM_RTOL:  # also nan
        problems.append(
            f"parameters: worst relative difference {worst:.2e} in {worst_name!r} (tolerance {PARAM_RTOL:g})"
        )
    for key, ref in reference.extra.items():
        got = fused.extra.get(key)
        if isinstance(ref, (list, tuple)) and ref and isinstance(ref[0], float):
            ok = got is not None and len(got) == len(ref) and all(_close(g, r, NORM_RTOL) for g, r in zip(got, ref))
        elif isinstance(ref, float):
            ok = got is not None and _close(got, ref, NORM_RTOL)
        else:
            ok = got == ref
        if not ok:
            problems.append(f"{key}: torch {ref!r}, fused {got!r}")
    return problems


def check_reference_sane(run: Run, expected_steps: int) -> None:
    """The torch run itself did what the test means: every trained parameter stepped
    ``expected_steps`` times (frozen ones: none) and clipping was active at least once (so the
    test exercises it)."""
    assert run.step_calls == expected_steps, (run.step_calls, expected_steps)
    assert {s for s in run.param_steps if s} == {float(expected_steps)}, run.param_steps
    assert any(n > MAX_GRAD_NORM for n in run.grad_norms), f"clipping never active: {run.grad_norms}"
