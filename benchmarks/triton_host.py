"""Host time of the Triton backend per call, with the kernels stubbed (issue 10, item 5).

What the Python launcher costs before any GPU work: argument checks, the per-tensor reads
(address, dtype, ...), the plan-cache lookup, and on a miss the vectorised table build. The
kernels are replaced by no-ops, so this runs on any CPU, no GPU or interpreter needed, and
measures the launcher alone. Goals (issue 10): <= 0.5 ms for a 2,048-tensor accumulate and
<= 1 ms for a 2,048-tensor step, on the development CPU.

Rows, for 148 and 2,048 tensors of 256 elements, laid out as the optimizer lays them out (64-
element slices of flat fp32 buffers): accumulate (bf16 gradients into the flat accumulator,
with the norm and non-finite statistics) and the AdamW, SGD (momentum) and Lion steps from the
accumulator (fp32 masters and states, bf16 model parameters). Cases:
- ``plan``: the calls pass ``plan=`` as the optimizer does, the launch tables are cached (same
  addresses as the last call: the optimizer's buffers always, gradients when the caching
  allocator hands the same blocks back). The goal rows.
- ``plan, new``: as ``plan`` but every call has new addresses (accumulate: a fresh set of
  gradients; steps: of the bf16 parameters), so the tables are rebuilt from the plan.
- ``no plan``: the same call without ``plan=``, cached tables: every tensor is read.
A ``floor`` row times ``tuple(map(Tensor.data_ptr, tensors))`` for 2,048 tensors: the cheapest
per-tensor read, to tell a slow (or busy) CPU from a slow launcher. Each row prints the median
and the 10th-90th percentile spread of the per-call times.

Usage:  python benchmarks/triton_host.py [--tensors 148 2048] [--repeat 200] [--out DIR]
With --out, writes triton_host.csv (rows and machine; one file: the GPU check returns at most 8),
a row at a time as each is measured, so a run stopped at a time limit keeps them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

GOALS_MS = {"accumulate": 0.5, "adamw": 1.0, "sgd": 1.0, "lion": 1.0}  # for 2,048 tensors (issue 10)
GOAL_TENSORS = 2048
GOAL_CASE = "plan"
NUMEL = 256
PAD = 64
OPS = ("accumulate", "adamw", "sgd", "lion")
CASES = ("plan", "plan, new", "no plan")


class _NoLaunch:
    """kernel[grid](*args, **kwargs) that does nothing: the launcher's host work alone."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_kernels(tb):
    names = ["accumulate_kernel", "reduce_stats_kernel", "step_kernel"]
    saved = {n: getattr(tb.kernels, n) for n in names}
    try:
        for n in names:
            setattr(tb.kernels, n, _NoLaunch())
        yield
    finally:
        for n, k in saved.items():
            setattr(tb.kernels, n, k)


def _time(fn, repeat: int, setup=None):
    """Per-call times in ms of ``fn(setup())`` (setup untimed): median, 10th and 90th percentile."""
    fn(setup() if setup else None)  # the first call may validate and build the plan
    times = []
    for _ in range(repeat):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[len(times) // 10], times[(len(times) * 9) // 10]


def measure(n: int, repeat: int, on_row=lambda row: None):
    """The rows for ``n`` tensors; ``on_row`` sees each as it is measured."""
    from fused_accum import ops
    from fused_accum.backends import triton as tb

    gen = torch.Generator().manual_seed(0)
    slot = (NUMEL + PAD - 1) // PAD * PAD

    def flat_views():
        flat = torch.randn(n * slot, generator=gen)
        return flat, [flat[i * slot : i * slot + NUMEL] for i in range(n)]

    acc, accs = flat_views()
    offsets = torch.arange(n, dtype=torch.int64) * slot
    masters, ms, vs = flat_views()[1], flat_views()[1], flat_views()[1]

    def bf16_list():
        return [torch.randn(NUMEL, generator=gen).to(torch.bfloat16) for _ in range(n)]

    grads, lp = bf16_list(), bf16_list()
    steps = torch.full((n,), 3.0)
    lr, coef, found_inf, sumsq = torch.tensor(1e-3), torch.tensor(1.0), torch.zeros(()), torch.zeros(())
    plan = object()  # what the optimizer passes: a token for one set of parameters

    def accumulate(grads, plan):
        tb.accumulate(acc, offsets, grads, 1.0, False, found_inf, sumsq, plan=plan)

    # the step ops' records (fused_accum.ops): made once, as the tensors they hold; lp_params,
    # the model's tensors, are replaced per call, as the optimizer passes them
    step_tensors = ops.StepTensors(masters, accs, steps, lr, coef)
    adam_states, adam_hyper = ops.adam_step.states(ms, vs), ops.adam_step.hyper(0.9, 0.999, 1e-8, 0.01, True, False)
    sgd_states, sgd_hyper = ops.sgd_step.states(ms), ops.sgd_step.hyper(0.9, 0.0, 0.01, False, False)
    lion_states, lion_hyper = ops.lion_step.states(ms), ops.lion_step.hyper(0.9, 0.99, 0.01, False)

    def adamw(lp, plan):
        tb.step(ops.adam_step, step_tensors._replace(lp_params=lp), adam_states, adam_hyper, plan=plan)

    def sgd(lp, plan):
        tb.step(ops.sgd_step, step_tensors._replace(lp_params=lp), sgd_states, sgd_hyper, plan=plan)

    def lion(lp, plan):
        tb.step(ops.lion_step, step_tensors._replace(lp_params=lp), lion_states, lion_hyper, plan=plan)

    calls = {"accumulate": (accumulate, grads), "adamw": (adamw, lp), "sgd": (sgd, lp), "lion": (lion, lp)}
    rows = []
    with stubbed_kernels(tb):
        for op in OPS:
            fn, tensors = calls[op]
            # "plan, new": a fresh list each call, so every call rebuilds the tables (the list
            # is made untimed; a pool of two would be cached, as the LRU keeps both)
            fresh = lambda: [t.clone() for t in tensors]  # noqa: E731
            for case, run, setup, times in [
                ("plan", lambda _: fn(tensors, plan), None, repeat),
                ("plan, new", lambda ts: fn(ts, plan), fresh, max(repeat // 10, 5)),
                ("no plan", lambda _: fn(tensors, None), None, max(repeat // 4, 5)),
            ]:
                median, p10, p90 = _time(run, times, setup)
                goal = GOALS_MS[op] if n == GOAL_TENSORS and case == GOAL_CASE else None
                rows.append(
                    dict(
                        op=op,
                        case=case,
                        tensors=n,
                        median_ms=round(median, 4),
                        p10_ms=round(p10, 4),
                        p90_ms=round(p90, 4),
                        goal_ms=goal,
                        meets_goal=None if goal is None else median <= goal,
                    )
                )
                on_row(rows[-1])
    tb.clear_table_cache()
    return rows


def floor_row(repeat: int):
    tensors = [torch.zeros(1) for _ in range(2048)]
    ptr = torch.Tensor.data_ptr
    median, p10, p90 = _time(lambda _: tuple(map(ptr, tensors)), repeat)
    return dict(
        op="floor: map(data_ptr)",
        case="-",
        tensors=2048,
        median_ms=round(median, 4),
        p10_ms=round(p10, 4),
        p90_ms=round(p90, 4),
        goal_ms=None,
        meets_goal=None,
    )


def format_row(r) -> str:
    verdict = "" if r["goal_ms"] is None else (" meets" if r["meets_goal"] else " MISSES") + f" goal {r['goal_ms']} ms"
    return (
        f"{r['op']:<20} {r['case']:<9} {r['tensors']:>5} tensors  median {r['median_ms']:7.3f} ms"
        f"  p10-p90 {r['p10_ms']:7.3f}-{r['p90_ms']:7.3f} ms{verdict}"
    )


def main(argv=None) -> int:
    with common.stop_on_sigint():  # even when started with SIGINT ignored (in the background)
        return _main(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Triton launcher host time, kernels stubbed")
    parser.add_argument("--tensors", type=int, nargs="+", default=[148, 2048])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # Stubs launch nothing, so the interpreter flag must not matter; it is put back afterwards,
    # since a test process running this in-process interprets kernels in its other tests.
    import triton

    meta = dict(
        machine=platform.node(),
        cpu=platform.processor() or platform.machine(),
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton.__version__,
        threads=torch.get_num_threads(),
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        commit=common.git_commit()["commit"],
    )
    print(
        f"# triton launcher host time, kernels stubbed; torch {meta['torch']}, triton {meta['triton']}, "
        f"load average {meta['load_average']}"
    )
    csv_out = common.CsvAppender(args.out / "triton_host.csv") if args.out is not None else None

    def on_row(r):
        print(format_row(r), flush=True)
        if csv_out is not None:
            csv_out.add({**r, **meta})

    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        on_row(floor_row(args.repeat))
        for n in args.tensors:
            measure(n, args.repeat, on_row)
    except KeyboardInterrupt:  # a time limit's SIGINT: the rows so far are already written
        print("triton_host: interrupted")
        return 1
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
        if csv_out is not None:
            csv_out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
