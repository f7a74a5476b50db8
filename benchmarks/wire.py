"""shard="grads"'s wire modes (issue 38): the exact wire (``reduce_dtype="exact"``: an all-to-all of
the gradients in their own dtype, folded in rank order) against the fp32 and bf16 reduce-scatters.

    python -m fused_accum bench wire ring [--worlds 2 3 4] [--clip 1.0 (0: none)]
    python -m fused_accum bench wire bandwidth [--world 2] [--backend gloo|nccl] [--sizes 1048576 ...]

``ring``: a 2-layer bf16 MLP, k = 4 micro-batches per rank, 3 AdamW windows with
``max_grad_norm=1.0`` (``--clip``), inputs spread over 2^-8 .. 2^8, trained on N gloo ranks with each wire;
each run's largest absolute distance from one process running the N x k micro-batches in the
order (micro-batch j, rank r) (``reduce_dtype="exact"`` without a group, ``num_items=N``), over
the weights, the fp32 masters and the AdamW moments (gathered). The exact wire's is 0.

``bandwidth``: per bucket of ``size`` fp32-sized elements, the time of one collective, the bus
bandwidth (bytes each rank sends, (N-1)/N of the input, over the time) and, for the exact wire,
the fold's share of it (``ops.fold_pieces`` of the N received pieces into an fp32 part). gloo on
the CPU here (small sizes; a loaded machine: compare within one run); ``--backend nccl`` runs
the same on ``cuda:rank`` (one GPU per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fused_accum
from fused_accum import backends, ops
from fused_accum import distributed as fa_dist

K, WINDOWS, WIRES = 4, 3, ("exact", "fp32", "bf16")


class _Mlp(nn.Module):
    def __init__(self, width=64, hidden=256):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.to(torch.bfloat16)

    def forward(self, x):
        return self.net(x)


def _data(rank, window, micro):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * window + micro)
    scale = 2.0 ** torch.randint(-8, 9, (1, 64), generator=gen).float()
    return (torch.randn(8, 64, generator=gen) * scale).bfloat16(), torch.randn(8, 64, generator=gen)


def _loss(model, rank, window, micro):
    x, y = _data(rank, window, micro)
    return ((model(x).float() - y) ** 2).mean()


CLIP = [1.0]  # max_grad_norm (None: no clipping); set by --clip


def _optimizer(model, **extra):
    return fused_accum.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2, max_grad_norm=CLIP[0], **extra)


def _flatten(model, state) -> torch.Tensor:
    """Weights, masters and moments as one fp64 vector (the distance's domain)."""
    parts = [p.detach().double().reshape(-1) for p in model.parameters()]
    for index in sorted(state["state"]):
        entry = state["state"][index]
        parts += [entry[k].double().reshape(-1) for k in ("exp_avg", "exp_avg_sq") if k in entry]
    master = state.get("master")
    if master:
        parts += [m.double().reshape(-1) for _, m in sorted(master.items()) if m is not None]
    return torch.cat(parts)


def _ring_worker(rank, world, path, clip):
    CLIP[0] = clip
    dist.init_process_group("gloo", init_method=f"file://{path}.init", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = {}
        for wire in WIRES:
            reduce_dtype = {"exact": "exact", "fp32": None, "bf16": torch.bfloat16}[wire]
            model = _Mlp()
            opt = _optimizer(model, process_group=dist.group.WORLD, shard="grads", reduce_dtype=reduce_dtype)
            for window in range(WINDOWS):
                for micro in range(K):
                    _loss(model, rank, window, micro).backward()
                opt.step()
                opt.zero_grad()
            out[wire] = _flatten(model, opt.gathered_state_dict())
        if rank == 0:
            torch.save(out, f"{path}.out")
    finally:
        dist.destroy_process_group()


def _one_process(world) -> torch.Tensor:
    model = _Mlp()
    opt = _optimizer(model, reduce_dtype="exact")
    for window in range(WINDOWS):
        for micro in range(K):
            for rank in range(world):
                _loss(model, rank, window, micro).backward()
        opt.step(num_items=world)
        opt.zero_grad()
    return _flatten(model, opt.state_dict())


def ring(worlds, clip=1.0) -> dict:
    """{world: {wire: (max abs distance from one process, the same over the bf16 weights alone)}}."""
    CLIP[0] = clip
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            path = os.path.join(tmp, f"ring{world}")
            mp.spawn(_ring_worker, args=(world, path, clip), nprocs=world, join=True)
            got = torch.load(f"{path}.out", weights_only=True)
            want = _one_process(world)
            weights = sum(p.numel() for p in _Mlp().parameters())  # (the vector's first entries)
            rows[world] = {
                wire: ((got[wire] - want).abs().max().item(), (got[wire] - want)[:weights].abs().max().item())
                for wire in WIRES
            }
    return rows


def _timed(fn, repeats, device):
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bandwidth_worker(rank, args, path):
    dist.init_process_group(args.backend, init_method=f"file://{path}", rank=rank, world_size=args.world)
    device = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backends.resolve("auto", device)
    n, rows = args.world, []
    for size in args.sizes:
        size -= size % n
        fp32 = torch.randn(size, device=device)
        bf16 = fp32.bfloat16()
        part32, part16 = fp32[: size // n].clone(), bf16[: size // n].clone()
        recv = torch.empty(n, size // n, dtype=torch.bfloat16, device=device)
        acc = torch.zeros(size // n, device=device)
        pieces = list(recv.unbind(0))

        def fold():
            ops.fold_pieces(acc, pieces, False, backend)

        cells = {
            "reduce-scatter fp32": (lambda: fa_dist._reduce_scatter(part32, fp32), 4),
            "reduce-scatter bf16": (lambda: fa_dist._reduce_scatter(part16, bf16), 2),
            "exact (all-to-all bf16 + fold)": (lambda: (fa_dist._all_to_all(recv.view(-1), bf16), fold()), 2),
        }
        fold_s = _timed(fold, args.repeats, device)
        for name, (fn, width) in cells.items():
            seconds = _timed(fn, args.repeats, device)
            sent = size * width * (n - 1) / n
            share = fold_s / seconds if name.startswith("exact") else None
            rows.append((size, name, seconds, sent / seconds / 1e9, share))
    if rank == 0:
        print(f"world {n} ({args.backend}, {device.type}, fold backend {backend}); medians of {args.repeats}")
        print(f"{'elements':>10}  {'wire':<32}{'ms':>9}{'bus GB/s':>10}{'fold share':>12}")
        for size, name, seconds, gbps, share in rows:
            share_text = f"{share:>12.2f}" if share is not None else f"{'':>12}"
            print(f"{size:>10}  {name:<32}{seconds * 1e3:>9.3f}{gbps:>10.2f}{share_text}")
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("ring", "bandwidth"))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clip", type=float, default=1.0, help="ring: max_grad_norm (0: no clipping)")
    args = parser.parse_args(argv)
    if args.what == "ring":
        clip = args.clip or None
        rows = ring(args.worlds, clip)
        print(
            "largest |difference| from one process (weights, fp32 masters, AdamW moments), 2-layer bf16 MLP, "
            f"k = {K}, {WINDOWS} AdamW windows, max_grad_norm={clip}"
        )
        print("(all: weights, masters and moments / the bf16 weights alone)")
        print(f"{'N':>3}" + "".join(f"{w:>22}" for w in WIRES))
        for world, row in rows.items():
            print(f"{world:>3}" + "".join(f"{row[w][0]:>12.3g} /{row[w][1]:>8.3g}" for w in WIRES))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_bandwidth_worker, args=(args, os.path.join(tmp, "init")), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    main()
