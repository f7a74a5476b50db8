"""Data parallel and sharded modes, per window: bytes on the wire, time in collectives, fp32
bytes per parameter held, for replicated / shard="state" / shard="grads" against DDP + torch
AdamW (with ``no_sync()`` on all but the last micro-batch), and FSDP2 (``fully_shard`` on every
Linear, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) with torch's AdamW and
with ours.

    python benchmarks/distributed.py [--world 2] [--width 512] [--layers 4] [--accum 4] [--dtype bf16]

Spawns ``--world`` gloo processes on the CPU (NCCL needs a multi-GPU machine: ``--backend nccl``
runs the same code on ``cuda:rank``). Wire bytes are counted at the collective calls the
optimizer issues (a ring collective moves (N-1)/N of its buffer per rank); DDP's come from its
bucket sizes (one all-reduce of every gradient, in the param dtype, per window). Time in
collectives is the wall time from each call to the end of its ``wait()`` (overlapped
collectives count their full span), so it is an upper bound on what they add to a window.
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
from fused_accum import distributed as fa_dist


class _Counter:
    def __init__(self, world):
        self.world, self.bytes, self.seconds = world, 0, 0.0

    def wrap(self, fn, which, factor=1, keyword=None):
        """``fn`` counted: ``args[which]`` (or ``kwargs[keyword]``) is the whole buffer; ``factor``
        2 for an all-reduce (a ring all-reduce moves its buffer twice: reduce-scatter + all-gather)."""

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            tensor = args[which] if len(args) > which else kwargs.get(keyword)
            if tensor is not None:
                self.bytes += factor * tensor.numel() * tensor.element_size() * (self.world - 1) // self.world
            work = fn(*args, **kwargs)
            if work is None:
                self.seconds += time.perf_counter() - t0
                return None
            counter = self

            class Timed:
                def wait(self_inner):
                    work.wait()
                    counter.seconds += time.perf_counter() - t0

            return Timed()

        return call


def _model(args, device):
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    return nn.Sequential(*layers).to(device=device, dtype=args.torch_dtype)


def _worker(rank, args, init):
    backend = args.backend
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=args.world)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(1)
    counter = _Counter(args.world)
    # count what the optimizer's reducer issues (it calls these module-level names)
    fa_dist._reduce_scatter = counter.wrap(fa_dist._reduce_scatter, 1)  # input: the whole bucket
    fa_dist._all_gather = counter.wrap(fa_dist._all_gather, 0)  # output: the whole bucket
    dist.all_reduce = counter.wrap(
        dist.all_reduce, 0, factor=2
    )  # (this process's module: DDP's C++ reducer is not counted)
    # FSDP2's all-gathers (forward and backward: output, the unsharded params) and reduce-scatters
    dist.all_gather_single = counter.wrap(dist.all_gather_single, 0, keyword="output_tensor")
    dist.reduce_scatter_single = counter.wrap(dist.reduce_scatter_single, 1, keyword="input")
    rows = []
    for mode in ("ddp", "replicated", "state", "grads", "fsdp2+torch", "fsdp2"):
        model = _model(args, device)
        n = sum(p.numel() for p in model.parameters())
        if mode.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (args.world,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            wrapped = fully_shard(model, mesh=mesh, mp_policy=policy)
            if mode == "fsdp2":
                opt = fused_accum.AdamW(model.parameters(), lr=1e-4, accum_steps=args.accum, max_grad_norm=1.0)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        elif mode == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            wrapped = model
            opt = fused_accum.AdamW(
                model.parameters(),
                lr=1e-4,
                accum_steps=args.accum,
                max_grad_norm=1.0,
                process_group=dist.group.WORLD,
                shard=None if mode == "replicated" else mode,
            )
        gen = torch.Generator().manual_seed(rank)
        xs = [
            torch.randn(args.batch, args.width, generator=gen).to(device, args.torch_dtype) for _ in range(args.accum)
        ]
        times, wire, coll = [], [], []
        for window in range(args.windows + 1):
            counter.bytes, counter.seconds = 0, 0.0
            dist.barrier()
            t0 = time.perf_counter()
            for micro, x in enumerate(xs):
                last = micro == len(xs) - 1
                ctx = wrapped.no_sync() if mode == "ddp" and not last else torch.enable_grad()
                with ctx:
                    wrapped(x).float().square().mean().backward()
            if mode in ("ddp", "fsdp2+torch"):
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if window:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
                wire.append(counter.bytes)
                coll.append(counter.seconds)
        if mode == "ddp":
            # AdamW state (exp_avg, exp_avg_sq) in the param dtype + .grad; DDP's bucket: param dtype
            held = sum(s.numel() * s.element_size() for st in opt.state.values() for s in st.values() if s.dim())
            held += sum(p.numel() * p.element_size() for p in model.parameters())  # .grad
            held += sum(p.numel() * p.element_size() for p in model.parameters())  # DDP's flat buckets
            wire = [2 * n * next(model.parameters()).element_size() * (args.world - 1) // args.world] * len(times)
        elif mode == "fsdp2+torch":  # AdamW state + sharded .grad, local shards, param dtype
            held = sum(
                s.to_local().numel() * s.element_size() for st in opt.state.values() for s in st.values() if s.dim()
            )
            held += sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        else:
            held = sum(f.nbytes() for f in opt._window.flat_groups)
            if mode == "fsdp2":  # + FSDP2's sharded .grad, which the step copies from
                held += sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        rows.append((mode, n, statistics.median(times), statistics.median(wire), statistics.median(coll), held))
    if rank == 0:
        print(
            f"world {args.world} ({args.backend}), {args.layers} x Linear({args.width}), {args.dtype} params, "
            f"{args.accum} micro-batches per window, AdamW; medians of {args.windows} windows"
        )
        print(f"{'mode':<12}{'ms/window':>10}{'wire B/param':>14}{'coll. ms':>10}{'opt+grad B/param':>18}")
        for mode, n, t, w, c, h in rows:
            print(f"{mode:<12}{t * 1e3:>10.1f}{w / n:>14.2f}{c * 1e3:>10.1f}{h / n:>18.2f}")
        print("DDP: wire bytes from its bucket sizes; B/param = AdamW state + .grad + DDP buckets (param dtype).")
        print("fused_accum: B/param = fp32 flat buffers (accumulator, master, state, step counts);")
        print("shard='state'/'grads' also allocate a transient all-gather buffer of the params' size at the step.")
        print("fsdp2: wire = FSDP2's all-gathers (forward + backward, bf16) and fp32 reduce-scatters, every")
        print("micro-batch; B/param = the optimizer's (torch: param dtype; ours: fp32) + FSDP2's sharded .grad.")
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)
    args.torch_dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
