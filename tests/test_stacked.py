"""Loop B (fused_accum.stacked) against one large batch, and loop A where it does and does not
match; plus the demo, run at its quickest settings.

Gradients are compared as one flat vector by relative error ||g - g_ref|| / ||g_ref||. In fp32
the forms differ only in summation order (a matmul over 32 rows against 4 of 8, a sum of 4
chunk gradients), about 1e-7 relative; FP32_TOL = 1e-5 leaves two orders of margin and still
fails any real mistake (a missing chunk or an unscaled loss is an error of 0.1 or more).
"""

from __future__ import annotations

import copy
import re


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fused_accum.stacked import (
    SavedActivationMeter,
    cached_backward,
    concat_outputs,
    split_batch,
    stacked_backward,
)
from helpers import norm_rel_err  # tests/helpers.py

FP32_TOL = 1e-5  # see the module docstring
K = 4  # micro-batches per window
N = 32  # samples per window (8 per micro-batch)


# The tensors here are tiny (at most 32 x 256): one intra-op thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_thread")


def flat_grad(params) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in params])


# ---------------------------------------------------------------- contrastive (InfoNCE) setup


class RecordedDropout(nn.Module):
    """Dropout drawing its mask from the global RNG exactly as nn.Dropout does, that logs each
    mask (so a test can check the replay) or applies a given one (so a full-batch forward can use
    the masks the chunked forwards drew: a full batch draws its masks in another order)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.log, self.replay = p, [], None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replay is not None:
            return x * self.replay
        mask = F.dropout(torch.ones_like(x), self.p, self.training)
        self.log.append(mask)
        return x * mask


def tower(p_drop: float, d_in: int = 12, hidden: int = 48, d_out: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), RecordedDropout(p_drop), nn.Linear(hidden, d_out))


class DualEncoder(nn.Module):
    """Query and document towers; returns a tuple or a dict (both output kinds are supported)."""

    def __init__(self, p_drop: float, as_dict: bool = False) -> None:
        super().__init__()
        self.q, self.d, self.as_dict = tower(p_drop), tower(p_drop), as_dict

    def forward(self, queries: torch.Tensor, docs: torch.Tensor):
        q, d = self.q(queries), self.d(docs)
        return {"q": q, "d": d} if self.as_dict else (q, d)

    def dropouts(self) -> list[RecordedDropout]:
        return [m for m in self.modules() if isinstance(m, RecordedDropout)]


def info_nce(out, tau: float = 0.1) -> torch.Tensor:
    """InfoNCE with in-batch negatives: query i's positive is document i, every other document
    of the batch is a negative, so the loss of one sample depends on the whole batch."""
    q, d = (out["q"], out["d"]) if isinstance(out, dict) else out
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / tau
    return F.cross_entropy(logits.float(), torch.arange(len(q), device=q.device))


def pair_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(N, 12, generator=g)
    return queries, queries + 0.5 * torch.randn(N, 12, generator=g)  # related positives


def run_contrastive(model: DualEncoder, how: str, seed: int = 1) -> tuple[float, torch.Tensor]:
    """Loss and flat gradient of one window; ``how`` is full, stacked, cached or loop_a."""
    model.zero_grad(set_to_none=True)
    batch = pair_batch()
    torch.manual_seed(seed)  # the same dropout stream for every form
    if how == "full":
        loss = info_nce(model(*batch))
        loss.backward()
    elif how == "stacked":
        loss = stacked_backward(model, split_batch(batch, K), info_nce)
    elif how == "cached":
        loss = cached_backward(model, split_batch(batch, K), info_nce)
    elif how == "loop_a":  # the normal accumulation loop, normalised: each chunk's own negatives
        loss = 0.0
        for chunk in split_batch(batch, K):
            part = info_nce(model(*chunk)) / K
            part.backward()
            loss = loss + part.detach()
    else:
        raise ValueError(how)
    return float(loss.detach()), flat_grad(model.parameters())


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple-out", "dict-out"])
def test_infonce_cached_equals_stacked_equals_full_without_dropout(as_dict):
    torch.manual_seed(0)
    model = DualEncoder(p_drop=0.0, as_dict=as_dict)
    loss_full, g_full = run_contrastive(model, "full")
    for how in ("stacked", "cached"):
        loss, g = run_contrastive(model, how)
        assert loss == pytest.approx(loss_full, rel=FP32_TOL), how
        assert norm_rel_err(g, g_full) < FP32_TOL, how


def test_infonce_with_dropout_replays_masks_and_matches_full_batch():
    torch.manual_seed(0)
    model = DualEncoder(p_drop=0.3)
    drops = model.dropouts()

    _, g_stacked = run_contrastive(model, "stacked")
    stacked_masks = [list(m.log) for m in drops]
    for m in drops:
        m.log.clear()
    loss_cached, g_cached = run_contrastive(model, "cached")
    for m, masks in zip(drops, stacked_masks):
        assert len(m.log) == 2 * K  # k no-grad forwards, then k replays
        for j in range(K):
            # Replay: chunk j's re-forward draws exactly the mask of its first forward, and the
            # same as the stacked form's chunk j (same seed, same draw order): bit-equal.
            assert torch.equal(m.log[K + j], m.log[j])
            assert torch.equal(m.log[j], masks[j])
    assert norm_rel_err(g_cached, g_stacked) < FP32_TOL

    # The full batch with the same masks (a full batch draws its masks in a different order:
    # all queries, then all documents), applied through replay.
    for m, masks in zip(drops, stacked_masks):
        m.replay = torch.cat(masks)
    loss_full, g_full = run_contrastive(model, "full")
    assert loss_cached == pytest.approx(loss_full, rel=FP32_TOL)
    assert norm_rel_err(g_cached, g_full) < FP32_TOL

    # And dropout really mattered: without it the gradient is another one (measured 0.75 apart
    # at p = 0.3; 0.05 is far above fp32 noise and far below that).
    for m in drops:
        m.replay, m.p = None, 0.0
    _, g_plain = run_contrastive(model, "full")
    assert norm_rel_err(g_plain, g_full) > 0.05


def test_infonce_loop_a_is_not_the_large_batch():
    torch.manual_seed(0)
    model = DualEncoder(p_drop=0.0)
    loss_full, g_full = run_contrastive(model, "full")
    loss_a, g_a = run_contrastive(model, "loop_a")
    # Loop A gives each query 7 in-batch negatives instead of 31: a lower loss (measured 4.0
    # against 5.4) and another gradient (measured 0.32 apart). The thresholds, 10% and 0.1, are
    # far above fp32 noise (1e-7) and below the measured gaps.
    assert loss_a < 0.9 * loss_full
    assert norm_rel_err(g_a, g_full) > 0.1


def test_autocast_cached_matches_stacked_and_fp32():
    """Under bf16 autocast both forms run the same bf16 forwards; the stacked form then sums the
    k chunks' weight gradients in bf16 inside one graph, the cached form in the fp32 .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Dropout(0.1), nn.Linear(48, 16))
    model_fn = lambda q, d: (model(q), model(d))  # noqa: E731 - a shared (siamese) tower
    batch = pair_batch()
    grads = {}
    for how, fn, amp in [
        ("stacked", stacked_backward, True),
        ("cached", cached_backward, True),
        ("fp32", cached_backward, False),
    ]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = fn(model_fn, split_batch(batch, K), info_nce)
        assert loss.dtype == torch.float32  # info_nce upcasts the logits
        grads[how] = flat_grad(model.parameters())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%); a few roundings deep the
    # gradient is off the fp32 one by measured 1.4% for both forms: 5e-2 bounds that, while a
    # dropped chunk (25% of the batch) moves it far more. Cached and stacked share every bf16
    # forward and differ only in where the k chunks' weight gradients are summed (bf16 in the
    # graph, fp32 in .grad): measured 0.4% apart, bounded by 2e-2.
    assert norm_rel_err(grads["cached"], grads["fp32"]) < 5e-2
    assert norm_rel_err(grads["stacked"], grads["fp32"]) < 5e-2
    assert norm_rel_err(grads["cached"], grads["stacked"]) < 2e-2


# ---------------------------------------------------------------- saved-activation memory


def test_saved_activation_bytes_cached_one_chunk_stacked_k_chunks():
    torch.manual_seed(0)
    # Wide hidden layers (256) and narrow outputs (8) so one chunk's activations (8 rows x 3
    # layers x 256 fp32 = 24 KiB, plus masks) dwarf the loss graph over the outputs (32 x 8).
    enc = nn.Sequential(
        nn.Linear(12, 256),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 8),
    )
    model_fn = lambda q, d: (enc(q), enc(d))  # noqa: E731
    chunks = split_batch(pair_batch(), K)

    def peak(fn) -> int:
        enc.zero_grad(set_to_none=True)
        with SavedActivationMeter(exclude=enc.parameters()) as meter:
            fn()
        assert meter.live == 0  # every saved tensor was released by the backward(s) / graph
        return meter.peak

    one_chunk = peak(lambda: model_fn(*chunks[0]))  # one chunk's forward graph, then dropped
    cached = peak(lambda: cached_backward(model_fn, chunks, info_nce))
    stacked = peak(lambda: stacked_backward(model_fn, chunks, info_nce))
    full = peak(lambda: info_nce(model_fn(*pair_batch())).backward())
    # Cached holds one chunk's graph at a time (plus the loss graph, ~2% here): within 10%.
    assert one_chunk <= cached < 1.10 * one_chunk
    # Stacked holds all k graphs at once, as much as the full batch (to 10%: the loss graph over
    # 32 rows instead of 8 is the only difference from k x one chunk).
    assert stacked > 0.9 * K * one_chunk
    assert 0.9 * full < stacked < 1.1 * full


# ---------------------------------------------------------------- per-sample loss


def classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5))


def class_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_per_sample_loss_loop_a_normalised_equals_loop_b_equals_full():
    torch.manual_seed(0)
    model = classifier()
    x, y = class_batch(N)
    ce = lambda out: F.cross_entropy(out[0], out[1])  # noqa: E731 - labels ride along as output
    model_fn = lambda x, y: (model(x), y)  # noqa: E731

    F.cross_entropy(model(x), y).backward()
    g_full = flat_grad(model.parameters())

    grads = {}
    for how in ("loop_a", "loop_a_unnormalised", "stacked", "cached"):
        model.zero_grad(set_to_none=True)
        if how.startswith("loop_a"):
            scale = 1.0 if how == "loop_a_unnormalised" else 1.0 / K
            for xc, yc in split_batch((x, y), K):
                (F.cross_entropy(model(xc), yc) * scale).backward()
        else:
            fn = stacked_backward if how == "stacked" else cached_backward
            fn(model_fn, split_batch((x, y), K), ce)
        grads[how] = flat_grad(model.parameters())
    for how in ("loop_a", "stacked", "cached"):
        assert norm_rel_err(grads[how], g_full) < FP32_TOL, how
    # Not divided by k: exactly k times the large-batch gradient (to fp32 rounding).
    assert norm_rel_err(grads["loop_a_unnormalised"], K * g_full) < FP32_TOL


def test_unequal_micro_batches_need_num_items():
    """Micro-batches of 3, 13, 5 and 11 items: the mean of per-micro-batch means weights an item
    of the 3-item batch 13/3 times more than one of the 13-item batch; dividing summed losses by
    the total count (32) is the large-batch mean."""
    from fused_accum import FusedAccumOptimizer

    torch.manual_seed(0)
    model = classifier()
    x, y = class_batch(N)
    sizes = [3, 13, 5, 11]
    parts = list(zip(torch.split(x, sizes), torch.split(y, sizes)))

    F.cross_entropy(model(x), y).backward()
    g_full = flat_grad(model.parameters())

    model.zero_grad(set_to_none=True)
    for xc, yc in parts:
        (F.cross_entropy(model(xc), yc) / len(sizes)).backward()
    g_mean_of_means = flat_grad(model.parameters())
    # The gap depends on the data (measured 0.49 here); 0.05 is far above fp32 noise.
    assert norm_rel_err(g_mean_of_means, g_full) > 0.05

    model.zero_grad(set_to_none=True)
    for xc, yc in parts:
        (F.cross_entropy(model(xc), yc, reduction="sum") / N).backward()
    assert norm_rel_err(flat_grad(model.parameters()), g_full) < FP32_TOL

    # Through FusedAccumOptimizer: sum-reduced losses, step(num_items=N). Plain SGD with lr = 1
    # moves each parameter by exactly minus its normalised gradient.
    model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = FusedAccumOptimizer(model.parameters(), "sgd", lr=1.0, accum_steps=len(sizes))
    for xc, yc in parts:
        F.cross_entropy(model(xc), yc, reduction="sum").backward()
    summed = torch.cat([opt.accumulated_grad(p).flatten() for p in model.parameters()])
    assert norm_rel_err(summed, N * g_full) < FP32_TOL  # fp32 buffers hold the plain sum
    opt.step(num_items=N)
    opt.zero_grad()
    step = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    # Recovering the step as before - after rounds it to fp32 at the parameters' scale (~0.14,
    # steps ~0.02: ~3 bits of the step's precision lost); measured 2e-7, so FP32_TOL holds.
    assert norm_rel_err(step, g_full) < FP32_TOL


def test_cached_backward_feeds_fused_accum_optimizer():
    """Loop B's gradients reach FusedAccumOptimizer's fp32 buffers like loop A's do."""
    from fused_accum import FusedAccumOptimizer

    torch.manual_seed(0)
    model = DualEncoder(p_drop=0.0)
    _, g_full = run_contrastive(model, "full")
    model.zero_grad(set_to_none=True)
    opt = FusedAccumOptimizer(model.parameters(), "adamw", lr=1e-3, accum_steps=K)
    torch.manual_seed(1)
    cached_backward(model, split_batch(pair_batch(), K), info_nce)
    assert opt.microbatches == K  # one backward per chunk: accum_steps=K closes the window
    acc = torch.cat([opt.accumulated_grad(p).flatten() for p in model.parameters()])
    assert norm_rel_err(acc, g_full) < FP32_TOL


def test_cached_backward_with_a_learnable_temperature_is_still_k_backwards():
    """A loss that owns a parameter must not add a backward pass (a micro-batch) of its own:
    with step_in_backward the update would then come one backward early."""
    from fused_accum import FusedAccumOptimizer

    torch.manual_seed(0)
    model = DualEncoder(p_drop=0.0)
    log_tau = nn.Parameter(torch.tensor(-2.0))
    twin, twin_tau = copy.deepcopy(model), nn.Parameter(log_tau.detach().clone())

    def loss_with(tau):
        return lambda out: info_nce(out, tau=tau.exp())

    opt = FusedAccumOptimizer([*model.parameters(), log_tau], "adamw", lr=1e-2, accum_steps=K, step_in_backward=True)
    ref = torch.optim.AdamW([*twin.parameters(), twin_tau], lr=1e-2)
    batch = pair_batch()
    cached_backward(model, split_batch(batch, K), loss_with(log_tau))
    assert opt.microbatches == K
    opt.step()
    stacked_backward(twin, [batch], loss_with(twin_tau))
    ref.step()
    for p, q in zip([*model.parameters(), log_tau], [*twin.parameters(), twin_tau]):
        # one AdamW step of lr 1e-2 from equal gradients (fp32, summation order): ~1e-7 apart;
        # a step taken one backward early misses the last chunk and lands ~1e-2 away
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- helpers and validation


def test_split_and_concat_round_trip_nested():
    batch = {"a": torch.arange(10.0), "b": (torch.ones(10, 2), torch.zeros(10, 3, 1))}
    chunks = split_batch(batch, 3)
    assert [c["a"].shape[0] for c in chunks] == [4, 3, 3]  # tensor_split: sizes differ by <= 1
    back = concat_outputs(chunks)
    assert torch.equal(back["a"], batch["a"]) and torch.equal(back["b"][1], batch["b"][1])


def test_validation_messages():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="chunks"):
        cached_backward(model, [], lambda out: out.sum())
    with pytest.raises(ValueError, match="one-element"):
        cached_backward(model, [torch.ones(2, 3)], lambda out: out)
    with pytest.raises(TypeError, match="batch dim"):
        cached_backward(lambda x: x.sum(), [torch.ones(2, 3)], lambda out: out)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        split_batch(torch.ones(4), 0)


def test_rng_ends_where_stacked_leaves_it_when_the_loss_draws_too():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
    chunks = split_batch(torch.randn(8, 4), 2)

    def noisy_loss(out):  # draws from the RNG after the forwards
        return (F.dropout(out, 0.5) * torch.rand_like(out)).sum()

    torch.manual_seed(3)
    stacked_backward(model, chunks, noisy_loss)
    after_stacked = torch.rand(4)
    torch.manual_seed(3)
    cached_backward(model, chunks, noisy_loss)
    assert torch.equal(torch.rand(4), after_stacked)


def test_rng_ends_where_k_plain_forwards_leave_it():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
    chunks = split_batch(torch.randn(8, 4), 2)
    torch.manual_seed(3)
    stacked_backward(model, chunks, lambda out: out.sum())
    after_stacked = torch.rand(4)
    torch.manual_seed(3)
    cached_backward(model, chunks, lambda out: out.sum())
    assert torch.equal(torch.rand(4), after_stacked)


# ---------------------------------------------------------------- the demo


def test_demo_quick(capsys, tmp_path):
    from fused_accum import demo

    png = tmp_path / "curves.png"
    assert demo.main(["--quick", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\n\n")  # tables are separated by blank lines, titled "1. ", "2. ", ...
    tables = {b.split(".", 1)[0]: b for b in blocks if b[:2] in ("1.", "2.", "3.", "4.")}
    assert sorted(tables) == ["1", "2", "3", "4"]

    def row(table: str, label: str) -> list[float]:
        """The figures of the row starting with ``label`` (the label itself may hold numbers)."""
        line = next(ln for ln in tables[table].splitlines() if ln.startswith(label + "  "))
        return [float(cell) for cell in line[len(label) :].split()]

    # Table 1 (error, KiB, x large batch, ms). Not divided by k the gradient is k times the
    # large batch's: error k - 1 (to fp32 rounding, 1e-3 is ample). The others are the large
    # batch to FP32_TOL. Activations: loop A and cached hold one of k micro-batches (x 1/k, to
    # 10% for the small loss graphs), stacked holds them all (x 1, same margin).
    k = int(re.search(r"k = (\d+)", tables["1"]).group(1))
    assert row("1", "A, loss not divided")[0] == pytest.approx(k - 1, rel=1e-3)
    for label in ("A, loss / k", "A, FusedAccumOptimizer", "B, stacked", "B, cached"):
        assert row("1", label)[0] < FP32_TOL, label
    for label in ("A, loss / k", "B, cached"):
        assert row("1", label)[2] == pytest.approx(1 / k, rel=0.1), label
    assert row("1", "B, stacked")[2] == pytest.approx(1.0, rel=0.1)
    # Table 2 (error, weight ratio): only num_items is the large batch.
    assert row("2", "loss_j.mean() / k, step()")[0] > 0.05  # measured 0.69
    assert row("2", "loss_j.sum(), step(num_items=N)")[0] < FP32_TOL
    # Table 3 (negatives, loss, error, KiB, ms): A is not the large batch (measured error 0.3).
    assert row("3", "A, loss / k")[2] > 0.1
    assert row("3", "B, stacked")[2] < FP32_TOL and row("3", "B, cached")[2] < FP32_TOL
    assert row("3", "B, cached")[3] < 0.5 * row("3", "B, stacked")[3]  # 1/k of it, to margin
    # Table 4 (lr, final loss, drift). Normalised accumulation follows the large batch to fp32
    # rounding (measured 1e-7, accumulated over the steps: 1e-5 bound); not normalised, SGD
    # follows another trajectory (measured drift ~1), AdamW nearly the same one (eps only:
    # measured 4e-5, bound 1e-3).
    assert row("4", "SGD, k, loss / k")[2] < 1e-5 and row("4", "AdamW, k, loss / k")[2] < 1e-5
    assert row("4", "SGD, k, loss not divided")[2] > 0.1
    assert row("4", "AdamW, k, loss not divided")[2] < 1e-3
    assert "Answer" in out and "Which learning rate?" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
