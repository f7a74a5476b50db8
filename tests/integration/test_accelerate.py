"""Accelerate with fused_accum.AdamW against the same loop on torch.optim.AdamW.

The loop Accelerate documents for gradient accumulation: ``accelerator.accumulate(model)``,
``accelerator.backward``, ``accelerator.clip_grad_norm_`` when ``sync_gradients``, then
``step``/``zero_grad`` every micro-batch (the prepared optimizer and scheduler act only at a
window's end). A tiny GPT-2, gradient_accumulation_steps=4, 11 micro-batches per epoch (the
last window of each epoch has 3, and Accelerate steps it at the end of the data loader),
two epochs: 6 optimizer steps. The resume test saves with ``save_state`` after the first epoch
and continues in a fresh model, optimizer and Accelerator with ``load_state``.
"""

from __future__ import annotations

import pytest
import torch

from _common import (
    BATCH,
    K,
    MAX_GRAD_NORM,
    OPTIMIZERS,
    Run,
    StepCounter,
    TokenDataset,
    check_reference_sane,
    compare,
    compare_stages,
    param_steps,
    snapshot,
    tiny_gpt2,
)

import accelerate  # noqa: E402,F401  (pinned in requirements-integration.txt)
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

EPOCHS = 2
STEPS = EPOCHS * 3


def new_accelerator(tmp_path) -> Accelerator:
    # Accelerate's state is a per-process singleton; start each run from a clean one, as a new
    # process would (the HF Trainer tests in this session create Accelerators too).
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=K, cpu=True, project_dir=str(tmp_path))


def train(kind: str, tmp_path, epochs=range(EPOCHS), save_to=None, resume_from=None) -> Run:
    """Train ``epochs`` of the loop; ``save_to``: save_state there after the last of them;
    ``resume_from``: load_state from there first (a fresh model and optimizer, as after a
    restart)."""
    accelerator = new_accelerator(tmp_path)
    model = tiny_gpt2(seed=0 if resume_from is None else 123)  # resumed: the weights come from the checkpoint
    opt = OPTIMIZERS[kind](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.2 * step))
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=BATCH, shuffle=False)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
    counter = StepCounter(opt.optimizer)
    norms, lrs = [], []
    model.train()
    for _ in epochs:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
                    lrs.append(float(sched.get_last_lr()[0]))
                opt.step()
                sched.step()
                opt.zero_grad()
    if save_to is not None:
        accelerator.save_state(str(save_to))
    unwrapped = accelerator.unwrap_model(model)
    return Run(
        step_calls=counter.count,
        param_steps=param_steps(opt.optimizer),
        grad_norms=norms,
        params=snapshot(unwrapped),
        extra={"learning_rates": lrs},
    )


_references: dict = {}  # the torch run, shared by the parametrized test


@pytest.mark.parametrize("kind", ["fused", "fused, accum_steps=None"])
def test_accumulate_clip(tmp_path, kind):
    if "torch" not in _references:
        _references["torch"] = train("torch", tmp_path)
    reference = _references["torch"]
    check_reference_sane(reference, STEPS)
    compare(reference, train(kind, tmp_path), f"Accelerate accumulate() + clip_grad_norm_, {kind}")


def test_save_state_load_state_resume(tmp_path):
    # The torch run, resumed, is the uninterrupted one (the test's own premise).
    reference = train("torch", tmp_path)
    first = train("torch", tmp_path, epochs=range(1), save_to=tmp_path / "torch_ckpt")
    second = train("torch", tmp_path, epochs=range(1, EPOCHS), resume_from=tmp_path / "torch_ckpt")
    assert first.grad_norms + second.grad_norms == pytest.approx(reference.grad_norms, rel=1e-6)
    for name, p in reference.params.items():
        torch.testing.assert_close(second.params[name], p, rtol=1e-6, atol=1e-7)

    fused_first = train("fused", tmp_path, epochs=range(1), save_to=tmp_path / "fused_ckpt")
    fused_second = train("fused", tmp_path, epochs=range(1, EPOCHS), resume_from=tmp_path / "fused_ckpt")
    compare_stages(
        (first, fused_first, "Accelerate, first epoch (then save_state)"),
        (second, fused_second, "Accelerate, second epoch (after load_state into a fresh model and optimizer)"),
    )
