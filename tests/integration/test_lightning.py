"""Lightning with fused_accum.AdamW against the same fit on torch.optim.AdamW.

A tiny regression MLP (a LightningModule whose ``configure_optimizers`` builds the optimizer),
``accumulate_grad_batches=4``, ``gradient_clip_val`` (norm), 11 batches per epoch (windows of
4, 4, 3: Lightning steps the short one at the epoch's end). The grad norm is logged in
``on_before_optimizer_step`` (before clipping), as Lightning documents. Also: the documented
``Tuner(trainer).lr_find(model)`` then ``trainer.fit(model)`` on the same model (two optimizers
on the same parameters, one after the other), and resuming ``fit`` from a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _common import (
    BATCH,
    K,
    OPTIMIZERS,
    SAMPLES,
    Run,
    StepCounter,
    check_reference_sane,
    compare,
    compare_stages,
    param_steps,
    snapshot,
    total_grad_norm,
)

import lightning as L  # noqa: E402  (pinned in requirements-integration.txt)
from lightning.pytorch.tuner import Tuner  # noqa: E402

EPOCHS = 2
STEPS = EPOCHS * 3
CLIP = 1.0
MLP_LR = 0.05


class TinyRegressor(L.LightningModule):
    def __init__(self, kind: str, lr: float = MLP_LR):
        super().__init__()
        self.kind, self.lr = kind, lr
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.grad_norms: list = []
        self.counters: list = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.grad_norms.append(total_grad_norm(self.parameters()))

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.kind](self.parameters(), lr=self.lr)
        self.counters.append(StepCounter(opt))
        return opt


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = (x[:, :1] * 3 - x[:, 1:2] * 2 + 0.5 * torch.randn(SAMPLES, 1, generator=g)) * 2
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def trainer(tmp_path, max_epochs=EPOCHS, precision="32-true") -> "L.Trainer":
    return L.Trainer(
        max_epochs=max_epochs,
        accumulate_grad_batches=K,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        precision=precision,
    )


def result(model: TinyRegressor, t: "L.Trainer", norms=None, **extra) -> Run:
    counter = model.counters[-1]
    return Run(
        step_calls=counter.count,
        param_steps=param_steps(t.optimizers[0]),
        grad_norms=model.grad_norms if norms is None else norms,
        params=snapshot(model),
        extra={"global_step": t.global_step, **extra},
    )


def fit(kind: str, tmp_path, precision="32-true") -> Run:
    model = TinyRegressor(kind)
    t = trainer(tmp_path / kind, precision=precision)
    t.fit(model, train_dataloaders=data())
    return result(model, t)


@pytest.mark.parametrize("kind", ["fused", "fused, accum_steps=None", "fused, accum_steps=8"])
def test_accumulate_grad_batches_clip(tmp_path, kind):
    reference = fit("torch", tmp_path)
    check_reference_sane(reference, STEPS)
    compare(reference, fit(kind, tmp_path), f"Lightning fit(accumulate_grad_batches=4, gradient_clip_val), {kind}")


def test_bf16_mixed_with_gradient_clip_val(tmp_path):
    """The default recipe of many fine-tuning scripts: Lightning refuses gradient_clip_val for an
    optimizer that says it unscales in step() (issue 22 item 11), though bf16-mixed has no
    scaler; ours says so to GradScaler only."""
    reference = fit("torch", tmp_path / "torch", precision="bf16-mixed")
    check_reference_sane(reference, STEPS)
    compare(
        reference,
        fit("fused", tmp_path / "fused", precision="bf16-mixed"),
        "Lightning fit(precision='bf16-mixed', accumulate_grad_batches=4, gradient_clip_val)",
    )


# lr_find's optimizer steps: 10 epochs of 3 windows. Its callback records the loss only at
# windows that end on a multiple of 4 batches (2 per epoch), and its suggestion skips the first
# 10 records and the last: 20 records leave 9 to choose from.
LR_FIND_STEPS = 30


def lr_find_then_fit(kind: str, tmp_path) -> tuple:
    model = TinyRegressor(kind)
    t = trainer(tmp_path / kind, max_epochs=LR_FIND_STEPS // 3)
    finder = Tuner(t).lr_find(
        model, train_dataloaders=data(), min_lr=1e-3, max_lr=0.3, num_training=LR_FIND_STEPS, early_stop_threshold=None
    )
    found = Run(
        step_calls=model.counters[-1].count,
        param_steps=[],
        grad_norms=list(model.grad_norms),
        params={},
        extra={
            "lr_find losses": [float(x) for x in finder.results["loss"]],
            "suggestion": finder.suggestion(),
            "model.lr after lr_find": model.lr,
        },
    )
    model.grad_norms = []
    t.fit(model, train_dataloaders=data())
    return found, result(model, t)


def test_lr_find_then_fit(tmp_path):
    ref_find, ref_fit = lr_find_then_fit("torch", tmp_path)
    assert ref_find.step_calls == LR_FIND_STEPS and ref_find.extra["suggestion"] is not None
    assert ref_fit.extra["global_step"] == ref_fit.step_calls == LR_FIND_STEPS
    fused_find, fused_fit = lr_find_then_fit("fused", tmp_path)
    compare_stages(
        (ref_find, fused_find, "Lightning Tuner.lr_find"),
        (ref_fit, fused_fit, "Lightning fit after lr_find, same model"),
    )


def test_checkpoint_resume(tmp_path):
    """fit one epoch, save_checkpoint, then fit(ckpt_path=...) to two epochs with a fresh model
    and Trainer; the torch run resumed this way equals the uninterrupted one."""
    runs = {}
    for kind in ("torch", "fused"):
        model = TinyRegressor(kind)
        t = trainer(tmp_path / kind, max_epochs=1)
        t.fit(model, train_dataloaders=data())
        first = result(model, t)
        ckpt = tmp_path / f"{kind}.ckpt"
        t.save_checkpoint(str(ckpt))
        fresh = TinyRegressor(kind)
        with torch.no_grad():  # other weights, so the checkpoint must restore them
            for p in fresh.parameters():
                p.add_(1.0)
        t2 = trainer(tmp_path / kind, max_epochs=EPOCHS)
        t2.fit(fresh, train_dataloaders=data(), ckpt_path=str(ckpt))
        runs[kind] = (first, result(fresh, t2))
    uninterrupted = fit("torch", tmp_path / "uninterrupted")
    first, second = runs["torch"]
    assert first.grad_norms + second.grad_norms == pytest.approx(uninterrupted.grad_norms, rel=1e-6)
    for name, p in uninterrupted.params.items():
        torch.testing.assert_close(second.params[name], p, rtol=1e-6, atol=1e-7)
    compare_stages(
        (first, runs["fused"][0], "Lightning, first epoch (then save_checkpoint)"),
        (second, runs["fused"][1], "Lightning, fit(ckpt_path=...) to the second epoch"),
    )
