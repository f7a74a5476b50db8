"""FSDP2 (``fully_shard``) with ``offload="cpu"``: bit for bit FSDP2 without offload.

Each rank keeps its local shards of the parameters and their fp32 accumulators on the device
(FSDP2's reduce-scatter adds into ``.grad``, a DTensor over the accumulator slice) and its
shards' masters, state, weight copy and gradient on the host, where the step runs. Under FSDP2
a window's gradient is final only when its last backward ends, so nothing speculates: every
window steps at ``step()``, bucket by bucket on the host (here one parameter per bucket).

One spawn of two gloo ranks runs every case, each twice on identical FSDP2 models (with and
without offload); the parent compares the whole parameters and each rank's state, bit for bit:
every fused algorithm (tests/cases.py, its default case) on bf16 parameters with fp32 masters, clipped by
``max_grad_norm`` through three windows, the second of which has a non-finite gradient and is
skipped (``skip_nonfinite``); AdamW on fp32 parameters; ``master_weights="remainder"``; and a
resume through torch.distributed.checkpoint. Also counted: the device and host bytes per
parameter (docs/offload.md, "On the device" and "On the host").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_fsdp import BF16_COMPUTE, CLIP, K, WORLD, Net, data, full, shard
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import cases  # tests/cases.py: every algorithm, its cases, the modes it runs in
import fused_accum
from fused_accum.backends import ext
from helpers import spawn_ranks  # tests/helpers.py

pytestmark = pytest.mark.skipif(ext._C is None, reason="the offloaded host step runs the C++ CPU kernels")

WINDOWS, SKIPPED = 3, 1  # the window whose gradient is non-finite (rank 0's second micro-batch)
BUCKET_MB = 1e-4  # 26 elements: one parameter per bucket, so the host steps bucket by bucket
ALGORITHMS = {c.algorithm: c for c in cases.cases(cases.OFFLOAD)}  # name: its default case
CASES = {  # name: (algorithm, parameter dtype, master_weights)
    **{name: (name, torch.bfloat16, True) for name in ALGORITHMS},
    "adamw_fp32": ("adamw", torch.float32, True),
    "adamw_remainder": ("adamw", torch.bfloat16, "remainder"),
}


def optimizer(model, case: str, offload):
    algorithm, _, master = CASES[case]
    return ALGORITHMS[algorithm].make(
        model.parameters(),
        accum_steps=K,
        max_grad_norm=CLIP,
        skip_nonfinite=True,
        master_weights=master,
        bucket_cap_mb=BUCKET_MB,
        offload=offload,
    )


def train(model, opt, rank, windows, log=None):
    for window in windows:
        for micro in range(K):
            x, y = data(rank, window, micro)
            loss = ((model(x).float() - y) ** 2).mean() / K
            if window == SKIPPED and micro == 1 and rank == 0:
                loss = loss * math.inf  # (FSDP2's reduce-scatter spreads it to every rank's shards)
            loss.backward()
        grad = model.out.weight.grad
        opt.step()
        if log is not None:  # (.grad's kind, the window's norm and its bits)
            norm = opt.last_grad_norm.float()
            log.append((type(grad).__name__, grad.dtype, float(norm), norm.view(torch.int32).item()))
        opt.zero_grad()


def local_state(opt) -> dict:
    """This rank's optimizer state: every entry of its state_dict, DTensors as their local shards."""
    return {
        key: {name: (v.to_local() if isinstance(v, DTensor) else v).clone() for name, v in entry.items()}
        for key, entry in opt.state_dict()["state"].items()
    }


def run(rank, case: str, offload) -> dict:
    model = shard(Net().to(CASES[case][1]), BF16_COMPUTE)
    opt = optimizer(model, case, offload)
    log, after = [], []
    for window in range(WINDOWS):
        train(model, opt, rank, [window], log)
        after.append(full(model))
    placement = opt._window.placement
    host = None
    if offload:  # (the host placement stepped, on its worker, over FSDP2's layout)
        layouts = {f"{type(f.layout).__name__}({type(f.layout.base).__name__})" for f in opt._window.flat_groups}
        host = dict(
            speculated=(placement.committed, placement.redone), worked=placement.worker.busy_s > 0, layouts=layouts
        )
    return dict(params=after, state=local_state(opt), log=log, host=host)


def resume(rank, path: str, case: str) -> dict:
    """One window, a DCP checkpoint, two more; the same two from the checkpoint, loaded into a
    fresh FSDP2 model and optimizer (both offloaded)."""
    model = shard(Net().to(CASES[case][1]), BF16_COMPUTE)
    opt = optimizer(model, case, "cpu")
    train(model, opt, rank, range(1))
    ckpt = f"{path}.dcp_{case}"
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    train(model, opt, rank, range(1, WINDOWS))
    copy = shard(Net().to(CASES[case][1]), BF16_COMPUTE)
    opt2 = optimizer(copy, case, "cpu")
    template = {"model": copy.state_dict(), "optim": get_optimizer_state_dict(copy, opt2)}
    dcp.load(template, checkpoint_id=ckpt)
    copy.load_state_dict(template["model"])
    set_optimizer_state_dict(copy, opt2, template["optim"])
    train(copy, opt2, rank, range(1, WINDOWS))
    return dict(uninterrupted=full(model), resumed=full(copy))


def bytes_per_param(rank, master) -> dict:
    """bf16 AdamW over two 256 x 256 layers: each rank's device and host bytes, per parameter of
    the whole model, counted from the buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=BF16_COMPUTE)
    fully_shard(model, mesh=mesh, mp_policy=BF16_COMPUTE)
    opt = fused_accum.AdamW(model.parameters(), accum_steps=K, master_weights=master, offload="cpu")
    for _ in range(K):
        model(torch.randn(8, 256, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    device = sum(f.acc.numel() * 4 for f in opt._window.flat_groups)
    device += sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    host = 0
    for flat in opt._window.flat_groups:
        layout = flat.layout
        buffers = [flat.master, *flat.state.values(), layout.host_params, layout.host_acc, *layout.twin.values()]
        host += sum(t.numel() * t.element_size() for t in buffers if t is not None)
    return dict(device=device / n, host=host / n, on_host=all(t.device.type == "cpu" for t in flat.state.values()))


def _worker(rank, path):
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{path}.init", rank=rank, world_size=WORLD)
    try:
        results = {}
        for case in CASES:
            results[case] = {offload: run(rank, case, offload) for offload in (None, "cpu")}
        for case in ("adamw", "adamw_remainder"):
            results[f"resume_{case}"] = resume(rank, path, case)
        results["bytes"] = {str(master): bytes_per_param(rank, master) for master in (True, "remainder")}
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp_offload") / "run")
    return spawn_ranks(_worker, path, WORLD)


def _equal(got, want) -> bool:
    return all(torch.equal(a.view(-1).view(torch.int8), b.view(-1).view(torch.int8)) for a, b in zip(got, want))


@pytest.mark.parametrize("case", list(CASES))
def test_offload_under_fsdp2_is_bit_identical_to_fsdp2_without(ranks, case):
    for rank in ranks:
        got, want = rank[case]["cpu"], rank[case][None]
        assert len(got["params"]) == WINDOWS
        for window, (a, b) in enumerate(zip(got["params"], want["params"])):
            assert _equal(a, b), (case, window)
        assert got["state"].keys() == want["state"].keys()
        for key, entry in want["state"].items():
            assert got["state"][key].keys() == entry.keys()
            for name, value in entry.items():
                assert _equal([got["state"][key][name]], [value]), (case, key, name)
        assert [entry[:2] + entry[3:] for entry in got["log"]] == [entry[:2] + entry[3:] for entry in want["log"]]
        # (a window's gradient is final only at its end: the host steps at step(), nothing speculates)
        assert got["host"] == dict(speculated=(0, 0), worked=True, layouts={"HostLayout(DTensorLayout)"})


@pytest.mark.parametrize("case", list(CASES))
def test_the_clip_binds_and_the_non_finite_window_is_skipped(ranks, case):
    for rank in ranks:
        got = rank[case]["cpu"]
        assert got["log"][0][:2] == ("DTensor", torch.float32)  # .grad: fp32, over the accumulator
        assert not math.isfinite(got["log"][SKIPPED][2])
        assert _equal(got["params"][SKIPPED], got["params"][SKIPPED - 1])  # skipped: nothing moved
        assert not _equal(got["params"][SKIPPED + 1], got["params"][SKIPPED])
        assert got["log"][2][2] > CLIP  # (the clip binds)
        steps = [entry["step"] for entry in got["state"].values() if "step" in entry]
        assert all(float(s) == WINDOWS - 1 for s in steps)  # the skipped window is not counted


@pytest.mark.parametrize("case", ["adamw", "adamw_remainder"])
def test_a_dcp_checkpoint_of_an_offloaded_fsdp2_optimizer_resumes_bit_exactly(ranks, case):
    for rank in ranks:
        got = rank[f"resume_{case}"]
        assert _equal(got["resumed"], got["uninterrupted"])
        assert _equal(got["uninterrupted"], rank[case][None]["params"][-1])  # (and equals no offload)


def test_bytes_per_parameter_on_the_device_and_on_the_host(ranks):
    """bf16 AdamW over 2 ranks: the device keeps each rank's shards of the weight and the fp32
    accumulator, (2 + 4) / 2 = 3 B/param; the host its shards' master, moments, weight copy and
    gradient, (4 + 8 + 2 + 4) / 2 = 9 B/param (no backup: nothing speculates), with the
    remainder (2 B) instead of the master (4 B) 8 B/param. (Slices padded to 64 elements: under
    0.01 B/param here.)"""
    for rank in ranks:
        fp32, remainder = rank["bytes"]["True"], rank["bytes"]["remainder"]
        assert 3.0 <= fp32["device"] < 3.01 and 3.0 <= remainder["device"] < 3.01, (fp32, remainder)
        assert 9.0 <= fp32["host"] < 9.01, fp32
        assert 8.0 <= remainder["host"] < 8.01, remainder
        assert fp32["on_host"] and remainder["on_host"]
