"""Two NCCL ranks on two GPUs (``pytest -m gpu`` on a machine with at least two): what gloo on
the CPU cannot show.

With ``ReduceOp.AVG`` (NCCL's, which gloo lacks) the all-reduce writes the accumulators in a way
that moves no version counter, so a norm computed from the local sums before the reduction and
never invalidated would still be used: with every backward under ``opt.no_sync()`` the window is
reduced at ``step()``, and the clip's norm must be the averaged gradient's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_accum
from helpers import spawn_ranks  # tests/helpers.py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL across them)"),
]
WORLD, K, CLIP = 2, 2, 0.05


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def _batch(rank, micro, device):
    gen = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(5, 8, generator=gen).to(device), torch.randn(5, 4, generator=gen).to(device)


def _worker(rank, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}.init", rank=rank, world_size=WORLD)
    try:
        device = torch.device("cuda", rank)
        model = _model(device)
        opt = fused_accum.AdamW(
            model.parameters(), lr=1e-2, accum_steps=K, max_grad_norm=CLIP, process_group=dist.group.WORLD
        )
        for micro in range(K):
            with opt.no_sync():
                x, y = _batch(rank, micro, device)
                (((model(x) - y) ** 2).mean() / K).backward()
        opt.step()
        torch.save(
            {"norm": opt.last_grad_norm.cpu(), "params": [p.detach().cpu() for p in model.parameters()]},
            f"{path}.rank{rank}",
        )
    finally:
        dist.destroy_process_group()


def test_every_backward_under_no_sync_clips_by_the_averaged_gradients_norm(tmp_path):
    path = str(tmp_path / "run")
    ranks = spawn_ranks(_worker, path, WORLD, weights_only=True)
    model = _model("cpu")
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for rank in range(WORLD):
        for micro in range(K):
            x, y = _batch(rank, micro, "cpu")
            (((model(x) - y) ** 2).mean() / K / WORLD).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    ref.step()
    for result in ranks:
        # fp32 sums in another order across two devices: 1e-5 relative, far below a stale local
        # norm (the ranks' own gradients differ by tens of percent)
        torch.testing.assert_close(result["norm"], norm, rtol=1e-5, atol=0)
        for got, want in zip(result["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


# --- shard="grads", reduce_dtype="exact" (issue 38) on NCCL -------------------------------------


def _bf16_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(29, 67), nn.GELU(), nn.Linear(67, 5)).to(device, torch.bfloat16)


def _spread_batch(rank, window, micro, device):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * window + micro)
    scale = 2.0 ** torch.randint(-8, 9, (1, 29), generator=gen).float()
    x = (torch.randn(3 + rank, 29, generator=gen) * scale).bfloat16()
    return x.to(device), torch.randn(3 + rank, 5, generator=gen).to(device)


def _exact_optimizer(model, **extra):
    return fused_accum.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5, bucket_cap_mb=2e-3, **extra)


def _exact_loss(model, rank, window, micro, device):
    x, y = _spread_batch(rank, window, micro, device)
    return ((model(x).float() - y) ** 2).mean()


def _exact_worker(rank, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}.init", rank=rank, world_size=WORLD)
    try:
        device = torch.device("cuda", rank)
        model = _bf16_model(device)
        opt = _exact_optimizer(model, process_group=dist.group.WORLD, shard="grads", reduce_dtype="exact")
        norms = []
        for window in range(3):
            for micro in range(K):
                _exact_loss(model, rank, window, micro, device).backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.last_grad_norm.cpu())
        state = opt.gathered_state_dict()
        torch.save(
            {
                "params": [p.detach().cpu() for p in model.parameters()],
                "norms": norms,
                "state": {i: {k: v.cpu() for k, v in s.items()} for i, s in state["state"].items()},
            },
            f"{path}.rank{rank}",
        )
    finally:
        dist.destroy_process_group()


def test_exact_wire_on_nccl_equals_one_process_bit_for_bit(tmp_path):
    path = str(tmp_path / "exact")
    ranks = spawn_ranks(_exact_worker, path, WORLD, weights_only=True)
    device = torch.device("cuda", 0)
    model = _bf16_model(device)
    opt = _exact_optimizer(model, reduce_dtype="exact")  # one process, the same norm
    norms = []
    for window in range(3):
        for micro in range(K):
            for rank in range(WORLD):
                _exact_loss(model, rank, window, micro, device).backward()
        opt.step(num_items=WORLD)
        opt.zero_grad()
        norms.append(opt.last_grad_norm.cpu())
    state = opt.state_dict()["state"]
    for result in ranks:
        for got, want in zip(result["params"], model.parameters()):
            assert torch.equal(got.view(torch.int16), want.detach().cpu().view(torch.int16))
        assert all(torch.equal(a, b) for a, b in zip(result["norms"], norms)), (result["norms"], norms)
        for i, entry in state.items():
            for key, value in entry.items():
                assert torch.equal(result["state"][i][key], value.cpu()), (i, key)
