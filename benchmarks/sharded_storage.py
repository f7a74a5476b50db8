"""shard="state": the step with the parameters bound into the layout's buffer (their storage
moved there: nothing else held it) against loose (a ``model.state_dict()`` taken before the
optimizer holds every one, so each stays where it is and is copied in and out at every step):
aten ops per step (the profiler's CPU events) and time per step, the two measured interleaved.

    python -m fused_accum bench sharded-storage [--params 64,1024] [--numel 4096] [--steps 30]

Spawns 2 gloo processes on the CPU, one thread each; bf16 parameters with fp32 masters (AdamW).
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

import fused_accum


def _ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _build(n, numel, hold):
    gen = torch.Generator().manual_seed(n)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel, generator=gen).bfloat16()) for _ in range(n))
    saved = model.state_dict() if hold else None  # (aliases every parameter's storage)
    opt = fused_accum.AdamW(
        model.parameters(), lr=1e-3, process_group=dist.group.WORLD, shard="state", bucket_cap_mb=64
    )
    params = list(model.parameters())
    grads = [torch.randn(numel, generator=gen).bfloat16() * 1e-2 for _ in params]
    return opt, (lambda: torch.autograd.backward(params, grads)), saved


def _worker(rank, args, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for n in args.params:
        runs = {hold: _build(n, args.numel, hold) for hold in (False, True)}
        ops, bound, times = {}, {}, {False: [], True: []}
        for hold, (opt, backward, _) in runs.items():
            for _ in range(2):  # (the first step allocates the state)
                backward()
                opt.step()
                opt.zero_grad()
            backward()
            ops[hold] = _ops(opt.step)
            opt.zero_grad()
            bound[hold] = sum(p is not None for p in opt._window.flat_groups[0].layout.bound)
        for _ in range(args.steps):
            for hold in (False, True):
                opt, backward, _ = runs[hold]
                backward()
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                times[hold].append(time.perf_counter() - start)
                opt.zero_grad()
        if rank == 0:
            ms = {hold: statistics.median(t) * 1e3 for hold, t in times.items()}
            print(
                f"{n:5d} params x {args.numel}: bound {bound[False]}/{n}: {ops[False]} ops, {ms[False]:.2f} ms | "
                f"loose {bound[True]}/{n}: {ops[True]} ops, {ms[True]:.2f} ms | loose/bound {ms[True] / ms[False]:.2f}x",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=lambda s: [int(x) for x in s.split(",")], default=[64, 1024])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, f"file://{os.path.join(tmp, 'init')}"), nprocs=2)


if __name__ == "__main__":
    main()
