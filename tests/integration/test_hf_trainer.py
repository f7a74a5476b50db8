"""HF Trainer with fused_accum.AdamW against the same run on torch.optim.AdamW.

A tiny GPT-2 (from a config) on synthetic tokens, gradient_accumulation_steps=4, an epoch of 11
micro-batches (windows of 4, 4, 3), max_grad_norm=1.0, two epochs: 6 optimizer steps. The
optimizer reaches the Trainer in both documented ways: ``optimizers=(opt, sched)`` and
``optimizer_cls_and_kwargs``.
"""

from __future__ import annotations

import pytest
import torch

import fused_accum
from _common import (
    BATCH,
    K,
    LR,
    MAX_GRAD_NORM,
    OPTIMIZERS,
    WEIGHT_DECAY,
    Run,
    StepCounter,
    TokenDataset,
    check_reference_sane,
    compare,
    param_steps,
    snapshot,
    tiny_gpt2,
)

import transformers  # noqa: E402  (pinned in requirements-integration.txt)
from transformers import Trainer, TrainingArguments  # noqa: E402

EPOCHS = 2
STEPS = EPOCHS * 3  # windows of 4, 4 and 3 micro-batches per epoch


def training_args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=K,
        max_grad_norm=MAX_GRAD_NORM,
        num_train_epochs=EPOCHS,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        logging_strategy="steps",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def finish(trainer: Trainer, counter: StepCounter) -> Run:
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    lrs = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return Run(
        step_calls=counter.count,
        param_steps=param_steps(trainer.optimizer),
        grad_norms=[float(n) for n in logged],
        params=snapshot(trainer.model),
        extra={
            "global_step": trainer.state.global_step,
            "learning_rates": [float(x) for x in lrs],
            "logged_losses": [float(x) for x in losses],
        },
    )


def run_with_optimizers(kind: str, tmp_path) -> Run:
    """``Trainer(optimizers=(opt, sched))``: the user builds the optimizer and the schedule."""
    model = tiny_gpt2()
    opt = OPTIMIZERS[kind](model.parameters())
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=STEPS)
    counter = StepCounter(opt)
    trainer = Trainer(
        model=model, args=training_args(tmp_path / kind), train_dataset=TokenDataset(), optimizers=(opt, sched)
    )
    trainer.train()
    return finish(trainer, counter)


def run_with_cls_and_kwargs(kind: str, tmp_path) -> Run:
    """``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))``: the Trainer builds the optimizer
    (its two param groups: with and without weight decay) and its own linear schedule."""
    cls, kwargs = {
        "torch": (torch.optim.AdamW, {"lr": LR}),
        "fused": (fused_accum.AdamW, {"lr": LR, "accum_steps": K}),
        "fused, accum_steps=None": (fused_accum.AdamW, {"lr": LR}),  # accum_steps unset (docs/trainers.md)
    }[kind]
    model = tiny_gpt2()
    counters = []

    class CountingTrainer(Trainer):
        def create_optimizer(self, model=None):
            opt = super().create_optimizer(model)
            counters.append(StepCounter(opt))
            return opt

    trainer = CountingTrainer(
        model=model,
        args=training_args(tmp_path / kind.replace(", ", "_")),
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=(cls, kwargs),
    )
    trainer.train()
    assert isinstance(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer, cls
    )
    assert len(counters) == 1
    return finish(trainer, counters[0])


def test_trainer_optimizers_tuple(tmp_path):
    reference = run_with_optimizers("torch", tmp_path)
    check_reference_sane(reference, STEPS)
    compare(reference, run_with_optimizers("fused", tmp_path), "HF Trainer(optimizers=(opt, sched))")


_references: dict = {}  # the torch run, shared by the parametrized test


@pytest.mark.parametrize("kind", ["fused", "fused, accum_steps=None"])
def test_trainer_optimizer_cls_and_kwargs(tmp_path, kind):
    if "torch" not in _references:
        _references["torch"] = run_with_cls_and_kwargs("torch", tmp_path)
    reference = _references["torch"]
    check_reference_sane(reference, STEPS)
    compare(reference, run_with_cls_and_kwargs(kind, tmp_path), f"HF Trainer(optimizer_cls_and_kwargs=...), {kind}")
