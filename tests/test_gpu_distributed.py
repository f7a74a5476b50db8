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
import torch.multiprocessing as mp
from torch import nn

import fused_accum

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
    mp.spawn(_worker, args=(path,), nprocs=WORLD, join=True)
    ranks = [torch.load(f"{path}.rank{r}", weights_only=True) for r in range(WORLD)]
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
