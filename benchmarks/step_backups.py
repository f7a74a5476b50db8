"""The host step with backups (issue 37): what offload's speculative step costs over a plain one.

For one bucket of B MB of parameters, AdamW on the C++ CPU backend, three ways, interleaved:

- ``plain``: the step alone;
- ``backups``: the step writing the old values of everything it changes into ``backups``
  (ops.StepTensors.backups: the kernel copies each block just before updating it);
- ``copy+step``: the old way, each written buffer copied aside (``copy_``) and then the step.

Formats: ``fp32`` (fp32 params stepped in place: params, exp_avg, exp_avg_sq written; B MB of
fp32 params) and ``bf16+master`` (fp32 masters with bf16 copies: masters, bf16 copy, exp_avg,
exp_avg_sq written; B MB of bf16 params, so twice the elements). Prints the median time of each
and the ratios to ``plain``, per thread count.

    .venv/bin/python -m benchmarks.step_backups [--sizes-mb 4 25] [--threads 1 2] [--repeats 15] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fused_accum import ops
from fused_accum.algorithms import AdamHyper

HYPER = AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)


def _bucket(fmt: str, mb: float):
    """(StepTensors without backups, AdamStates, the written tensors in the backups' order)."""
    elsize = 4 if fmt == "fp32" else 2
    n = int(mb * 2**20) // elsize
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    acc = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    lp = [master.bfloat16()] if fmt == "bf16+master" else []
    t = ops.StepTensors(
        [master], [acc], torch.ones(1), torch.tensor(1e-4, dtype=torch.float64), torch.ones(()), lp_params=lp
    )
    written = [master, *lp, m, v]
    return n, t, ops.AdamStates([m], [v]), written


def run(sizes_mb, threads, repeats: int, backend: str = "cpu", cold: bool = False) -> list:
    """Median seconds per way. ``cold``: a 128 MB buffer is written between calls (not timed),
    so a bucket's buffers come from memory, as in offload, where the other buckets' steps have
    passed through the caches since this one's last step; else the bucket steps again and again,
    from L3 where it fits."""
    rows = []
    scratch = torch.empty(32 * 2**20) if cold else None
    for fmt in ("fp32", "bf16+master"):
        for mb in sizes_mb:
            n, t, s, written = _bucket(fmt, mb)
            backups = [torch.empty_like(x) for x in written]
            aside = [torch.empty_like(x) for x in written]
            with_backups = t._replace(backups=backups)

            def plain():
                ops.adam_step(t, s, HYPER, backend)

            def backed_up():
                ops.adam_step(with_backups, s, HYPER, backend)

            def copy_then_step():
                for dst, src in zip(aside, written):
                    dst.copy_(src)
                ops.adam_step(t, s, HYPER, backend)

            ways = {"plain": plain, "backups": backed_up, "copy+step": copy_then_step}
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                times = {name: [] for name in ways}
                cpu = {name: [] for name in ways}
                for f in ways.values():  # warm: pages touched, clones resolved
                    f()
                for _ in range(repeats):
                    for name, f in ways.items():  # interleaved: drift hits every way alike
                        if scratch is not None:
                            scratch.fill_(float(len(times[name])))
                        start, start_cpu = time.perf_counter(), time.process_time()
                        f()
                        times[name].append(time.perf_counter() - start)
                        cpu[name].append(time.process_time() - start_cpu)
                med = {name: statistics.median(x) for name, x in times.items()}
                med.update({f"cpu {name}": statistics.median(x) for name, x in cpu.items()})
                rows.append((fmt, mb, n, n_threads, med))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 25])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--cold", action="store_true", help="evict the caches between calls (128 MB written)")
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, AdamW, backend {args.backend}, median of {args.repeats} interleaved runs, "
        f"{'cold (caches evicted between calls)' if args.cold else 'warm (the bucket steps again and again)'}"
    )
    print("wall: median wall-clock ms; cpu: median process CPU ms (all threads; on a shared machine the")
    print("one-thread cpu ratios leave out the time the thread waited for a core)")
    print(f"{'format':>12} {'MB':>5} {'elements':>10} {'thr':>3} {'plain ms':>9} {'backups':>9} {'copy+step':>10}"
          f" {'backups/plain':>14} {'copy+step/plain':>16} {'cpu: b/p':>9} {'cpu: c/p':>9}")  # fmt: skip
    for fmt, mb, n, n_threads, med in run(args.sizes_mb, args.threads, args.repeats, args.backend, args.cold):
        p, b, c = (med[k] * 1e3 for k in ("plain", "backups", "copy+step"))
        cp, cb, cc = (med[f"cpu {k}"] for k in ("plain", "backups", "copy+step"))
        print(
            f"{fmt:>12} {mb:>5g} {n:>10} {n_threads:>3} {p:>9.2f} {b:>9.2f} {c:>10.2f} {b / p:>14.2f} {c / p:>16.2f}"
            f" {cb / cp:>9.2f} {cc / cp:>9.2f}"
        )


if __name__ == "__main__":
    main()
