"""fp16 mixed precision with ``torch.amp.GradScaler``, as a training script writes it, on
``fused_accum.AdamW`` against the same loop on ``torch.optim.AdamW`` (issue 22).

A tiny GPT-2 under ``torch.autocast("cpu", dtype=torch.float16)``, k = 4 accumulation steps
over 11 micro-batches per epoch (windows of 4, 4, 3), and per window the recipe of the AMP
docs: ``scaler.unscale_(opt)``, ``clip_grad_norm_``, ``scaler.step(opt)``, ``scaler.update()``.
The initial scale is large enough that the first windows overflow in fp16: those steps are
skipped and the scale backs off, then grows again every 2 good steps, so every path of the
scaler (skip, unscaled step, growth) runs. Compared: the scale after each window, which steps
were skipped, the clip's norms and the trained parameters.
"""

from __future__ import annotations

import math

import torch

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
    compare,
    param_steps,
    snapshot,
    tiny_gpt2,
)

EPOCHS = 3
INIT_SCALE = 2.0**20  # fp16 overflows at it in the first windows (checked below)


def torch_fused_adamw(params):
    # torch's AdamW that, like ours, tells GradScaler it unscales in step(): GradScaler then
    # calls step() on a window with an inf too (the step skips itself), so both run the same
    # step hooks. The for-loop AdamW is not called at all on such a window.
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def train(kind: str) -> Run:
    model = tiny_gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch_fused_adamw(params) if kind == "torch" else OPTIMIZERS[kind](params)
    counter = StepCounter(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=BATCH, shuffle=False)
    norms, scales, overflowed = [], [], []
    for _ in range(EPOCHS):
        batches = list(loader)
        for start in range(0, len(batches), K):
            for batch in batches[start : start + K]:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(**batch).loss / K
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
            overflowed.append(not math.isfinite(norm))
            if not overflowed[-1]:
                norms.append(norm)  # (compared relatively: an inf norm is compared as overflowed)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
    return Run(
        step_calls=counter.count,
        param_steps=param_steps(opt),
        grad_norms=norms,
        params=snapshot(model),
        extra={"scales": scales, "overflowed": overflowed},
    )


def test_fp16_grad_scaler_unscale_clip_step_matches_torch_adamw():
    reference = train("torch")
    scales = reference.extra["scales"]
    assert scales[0] < INIT_SCALE and max(scales[1:]) > min(scales), f"the scaler did not back off and grow: {scales}"
    assert any(reference.extra["overflowed"]) and not all(reference.extra["overflowed"]), reference.extra
    compare(reference, train("fused"), "GradScaler fp16: unscale_, clip_grad_norm_, step, update (k=4)")
