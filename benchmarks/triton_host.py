"""Host time of the Triton backend per call, with the kernels stubbed (issue 10, item 5).

What the Python launcher costs before any GPU work: argument checks, the per-tensor reads
(address, size, dtype, contiguity), the plan-cache lookup, and on a miss the vectorised table
build. The kernels are replaced by no-ops, so this runs on any CPU, no GPU or interpreter needed,
and measures the launcher alone. Goals (issue 10): <= 0.5 ms for a 2,048-tensor accumulate and
<= 1 ms for a 2,048-tensor step, on the development CPU.

Rows: accumulate (bf16 grads into the fp32 flat accumulator) and AdamW from acc (fp32 masters
and bf16 params, 4 state/param lists + accs), for 148 and 2,048 tensors of 256 elements, on a
plan-cache hit (same addresses as the last call: the optimizer's buffers always, gradients when
the caching allocator hands the same blocks back) and on a miss (new gradient addresses: tables
rebuilt). A ``floor`` row times ``tuple(map(Tensor.data_ptr, tensors))`` for 2,048 tensors: the
cheapest possible per-tensor read, to tell a slow (or busy) CPU from a slow launcher.

Usage:  python benchmarks/triton_host.py [--tensors 148 2048] [--repeat 200] [--out DIR]
Prints one line per row (median and best ms per call, goal, verdict) and, with --out, writes
triton_host.csv (rows and machine; one file: the GPU check returns at most 8).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GOALS_MS = {"accumulate": 0.5, "adamw": 1.0}  # for 2,048 tensors (issue 10)
NUMEL = 256
PAD = 64


class _NoLaunch:
    """kernel[grid](*args, **kwargs) that does nothing: the launcher's host work alone."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_kernels(tb):
    names = ["accumulate_kernel", "reduce_stats_kernel", "sgd_kernel", "adam_kernel", "lion_kernel"]
    saved = {n: getattr(tb.kernels, n) for n in names}
    try:
        for n in names:
            setattr(tb.kernels, n, _NoLaunch())
        yield
    finally:
        for n, k in saved.items():
            setattr(tb.kernels, n, k)


def _time(fn, repeat: int):
    fn()  # the first call may build the plan
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def measure(n: int, repeat: int):
    from fused_accum.backends import triton as tb

    gen = torch.Generator().manual_seed(0)
    slot = (NUMEL + PAD - 1) // PAD * PAD
    acc = torch.randn(n * slot, generator=gen)
    offsets = torch.arange(n, dtype=torch.int64) * slot
    grads = [torch.randn(NUMEL, generator=gen).to(torch.bfloat16) for _ in range(n)]
    accs = [acc[i * slot : i * slot + NUMEL] for i in range(n)]
    flat = {k: torch.randn(n * slot, generator=gen).abs() for k in ("master", "m", "v")}
    views = {k: [t[i * slot : i * slot + NUMEL] for i in range(n)] for k, t in flat.items()}
    lp = [torch.randn(NUMEL, generator=gen).to(torch.bfloat16) for _ in range(n)]
    steps = torch.full((n,), 3.0)
    lr, coef, found_inf, sumsq = torch.tensor(1e-3), torch.tensor(1.0), torch.zeros(()), torch.zeros(())
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)

    def accumulate_hit():
        tb.accumulate(acc, offsets, grads, 1.0, False, found_inf, sumsq)

    fresh = [[g.clone() for g in grads] for _ in range(2)]  # alternate: every call a new address set
    calls = [0]

    def accumulate_miss():
        calls[0] += 1
        tb.clear_table_cache()
        tb.accumulate(acc, offsets, fresh[calls[0] % 2], 1.0, False, found_inf, sumsq)

    def adamw_hit():
        tb.adam_step(views["master"], views["m"], views["v"], accs, steps, lr, coef, lp_params=lp,
                     found_inf=found_inf, **hyper)  # fmt: skip

    def adamw_miss():
        tb.clear_table_cache()
        adamw_hit()

    rows = []
    with stubbed_kernels(tb):
        for op, case, fn in [("accumulate", "hit", accumulate_hit), ("accumulate", "miss", accumulate_miss),
                             ("adamw", "hit", adamw_hit), ("adamw", "miss", adamw_miss)]:  # fmt: skip
            median, best = _time(fn, repeat if case == "hit" else max(repeat // 10, 5))
            goal = GOALS_MS[op] if n == 2048 and case == "hit" else None
            rows.append(dict(op=op, case=case, tensors=n, median_ms=round(median, 4), best_ms=round(best, 4),
                             goal_ms=goal, meets_goal=None if goal is None else median <= goal))  # fmt: skip
    tb.clear_table_cache()
    return rows


def floor_row(repeat: int):
    tensors = [torch.zeros(1) for _ in range(2048)]
    ptr = torch.Tensor.data_ptr
    median, best = _time(lambda: tuple(map(ptr, tensors)), repeat)
    return dict(op="floor: map(data_ptr)", case="-", tensors=2048, median_ms=round(median, 4),
                best_ms=round(best, 4), goal_ms=None, meets_goal=None)  # fmt: skip


def format_row(r) -> str:
    verdict = "" if r["goal_ms"] is None else (" meets" if r["meets_goal"] else " MISSES") + f" goal {r['goal_ms']} ms"
    return (f"{r['op']:<22} {r['case']:<5} {r['tensors']:>5} tensors  median {r['median_ms']:8.3f} ms"
            f"  best {r['best_ms']:8.3f} ms{verdict}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Triton launcher host time, kernels stubbed")
    parser.add_argument("--tensors", type=int, nargs="+", default=[148, 2048])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # Stubs launch nothing, so the interpreter flag must not matter; it is put back afterwards,
    # since a test process running this in-process interprets kernels in its other tests.
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        rows = [floor_row(args.repeat)]
        for n in args.tensors:
            rows += measure(n, args.repeat)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    import triton

    meta = dict(machine=platform.node(), cpu=platform.processor() or platform.machine(), python=platform.python_version(),
                torch=torch.__version__, triton=triton.__version__, threads=torch.get_num_threads(),
                load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                commit=os.environ.get("FUSED_ACCUM_GIT_COMMIT", ""))  # fmt: skip
    print(f"# triton launcher host time, kernels stubbed; torch {meta['torch']}, triton {meta['triton']}, "
          f"load average {meta['load_average']}")  # fmt: skip
    for r in rows:
        print(format_row(r))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "triton_host.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + list(meta))
            writer.writeheader()
            for r in rows:
                writer.writerow({**r, **meta})
    return 0


if __name__ == "__main__":
    sys.exit(main())
