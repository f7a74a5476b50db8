"""Run the benchmark suite: ``python benchmarks/run.py [--quick] [--out DIR]``, or
``python -m fused_accum bench [args]``, or ``main(argv)`` from Python.

Writes to ``--out`` (default ``benchmarks/results``):
  kernels.csv      one row per (operation, workload, gradient dtype, provider)
  end_to_end.csv   one row per training variant
  cpu_adam.csv     one row per (AdamW op, workload, provider, threads), CPU only
  window.csv       one row per (model, param dtype, threads, provider): a whole window of k
                   micro-batches + step + zero_grad, ours against torch's (benchmarks/window.py)
  results.json     all of them, with the machine/torch/triton/commit metadata and the copy ceiling
  kernels.png      GB/s per provider: lines against size on the flat-gradient sweep, grouped
                   bars per workload for the lists and the step ops (benchmarks/common.py)
  window.png       the window suite: native / ours per model, param dtype and threads

Each CSV is written only when its suite was asked for (``--suite``), and rewritten (atomically)
after every group, so a run stopped at a time limit keeps what it measured; an interrupt (SIGINT,
as ``timeout -s INT`` sends) ends the run early and still writes the files, also when the run
was started with SIGINT ignored (a background job of a script: ``main`` restores Python's
handler). ``--no-plot`` leaves the PNGs out (benchmarks/device_check.sh: at most 8 files come
back from a lent GPU). The last line printed is the verdict: OK, FAILED (which row first) or
INTERRUPTED, with how many kernel groups ours won.

``--replot DIR`` measures nothing: it draws DIR's PNGs again from DIR/results.json (after a
change to the plots, or for a folder written with ``--no-plot``).

The benchmarks that are not suites run through here too, as ``python -m fused_accum bench TOOL
[args]`` (each also runs as a script; ``TOOL --help`` says what it takes): ``phases`` (a window's
time backward by backward, benchmarks/window_phases.py), ``distributed`` (the data-parallel and
sharded modes on gloo ranks, benchmarks/distributed.py), ``wire`` (shard="grads"'s exact wire
against the fp32 and bf16 reduce-scatters: distance from one process, bus bandwidth, the fold's
share; benchmarks/wire.py), ``wgrad`` (the fused weight-gradient
GEMM, benchmarks/wgrad.py), ``triton-sweep`` and ``triton-host`` (the Triton launch shape on a
GPU and the launcher's host time, benchmarks/triton_sweep.py and triton_host.py; both run by
benchmarks/device_check.sh), ``offload`` (offload="cpu": the host step per bucket, and on a GPU
a window with and without it, benchmarks/offload.py), ``compile`` (a window under each way of compiling
it, fused_accum against torch.optim's best, paired and interleaved: benchmarks/compile.py),
``sharded-storage`` (shard="state"'s step with the parameters bound into its buffer against
loose ones: aten ops and time per step, benchmarks/sharded_storage.py).

Sizes: ``--smoke`` is the tiniest run (for the tests, seconds); ``--quick`` is under 2 minutes
on a 2-core CPU; the default is the full suite (GPU sizes on CUDA). ``--time-budget`` skips the
groups that would start after that many seconds (the plan runs the most useful ones first), so
a run on a leased GPU ends in time and still writes everything it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script (sys.path[0] is benchmarks/) or loaded by path
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import common, end_to_end, kernels, window  # noqa: E402

DEFAULT_OUT = _ROOT / "benchmarks" / "results"
CPU_ADAM_THREADS = (1, 2)  # the thread-scaling rows: one process, the same data
SUITES = ("accumulate", "step", "e2e", "window", "cpu_adam")


def make_config(device: torch.device, mode: str) -> Dict:
    """Sizes and timing for ``mode`` ('smoke', 'quick' or 'full') on ``device``.

    GPU sizes go from 64K elements (launch-bound: ~5 us against 0.15 us of traffic at 4.3 TB/s)
    to 256M (1.5 ms of traffic for a bf16 add), and each set is at least twice the 50 MB L2.
    CPU sizes stop at 64M (a 10-byte add moves 640 MB: ~0.1 s on this 2-core machine).
    """
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cache = common.last_level_cache_bytes(device)
    if mode == "smoke":
        return dict(
            flat_sizes=[4096, 65536],
            lists=[kernels.many_small(count=40, max_numel=1024)],
            grad_dtypes=[bf16],
            step_workloads=[kernels.flat(65536)],
            timing=common.TimingConfig(samples=3, warmup_ms=2.0, min_sample_ms=2.0),
            copy_bytes=8 * 2**20,
            max_rotations=4,
            e2e=end_to_end.E2EConfig(
                vocab=64,
                d_model=32,
                n_layers=1,
                n_heads=2,
                seq_len=16,
                micro_batch=2,
                windows=3,
                warmup_windows=1,
                lr=3e-3,
            ),
            cpu_adam=[kernels.flat(65536)],
            # deepspeed stays out of the tests' run: its first use builds a C++ op for minutes
            cpu_adam_providers=("cpu", "torch_fused"),
            # one thread: on a loaded 2-core machine a 2-thread window of even these sizes takes
            # ~0.3-1 s (each parallel op waits for a descheduled thread); the tests time 2
            # threads on one small cell instead
            window=window.WindowConfig(
                accum_steps=2,
                threads=(1,),
                rounds=2,
                warmup_windows=1,
                param_count=16,
                param_numel=64,
                gpt_layers=1,
                gpt_d=16,
                gpt_heads=2,
                gpt_vocab=32,
                gpt_seq=8,
                gpt_micro_batch=1,
            ),
        )
    if device.type == "cuda":
        if mode == "quick":
            return dict(
                flat_sizes=[2**20, 2**24, 2**28],
                lists=[kernels.gpt2()],
                grad_dtypes=[bf16],
                step_workloads=[kernels.flat(2**24), kernels.gpt2()],
                timing=common.TimingConfig(samples=5),
                copy_bytes=2**30,
                max_rotations=1024,
                e2e=end_to_end.E2EConfig(n_layers=4, windows=6),
                window=window.WindowConfig(rounds=5),
            )
        return dict(
            flat_sizes=[2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28],
            lists=[
                kernels.gpt2(),
                kernels.llama(4096, 11008, blocks=2),
                kernels.many_small(2048, 65536),
                kernels.uniform(2048, 256),
            ],
            grad_dtypes=[bf16, fp16, fp32],
            step_workloads=[
                kernels.flat(2**20),
                kernels.flat(2**24),
                kernels.flat(2**28),
                kernels.gpt2(),
                kernels.many_small(2048, 65536),
            ],
            timing=common.TimingConfig(samples=10),
            copy_bytes=2**30,
            max_rotations=1024,
            e2e=end_to_end.E2EConfig(),
            window=window.WindowConfig(rounds=20),
        )
    cpu_e2e = end_to_end.E2EConfig(
        vocab=512, d_model=128, n_layers=2, n_heads=4, seq_len=64, micro_batch=4, windows=5, warmup_windows=1, lr=3e-3
    )
    if mode == "quick":
        return dict(
            flat_sizes=[2**16, 2**20, 2**24],
            lists=[
                kernels.gpt2(d=128, vocab=8192, ctx=256, name="gpt2_d128"),
                kernels.llama(256, 688, blocks=2, name="llama_h256"),
                kernels.many_small(2048, 4096, name="many_small_4k"),
                kernels.uniform(2048, 256),
            ],
            grad_dtypes=[bf16, fp32],
            step_workloads=[kernels.flat(2**20), kernels.gpt2(d=128, vocab=8192, ctx=256, name="gpt2_d128")],
            timing=common.TimingConfig(samples=5, warmup_ms=20.0, min_sample_ms=20.0),
            copy_bytes=4 * cache,
            max_rotations=512,
            e2e=cpu_e2e,
            cpu_adam=[kernels.flat(2**20), kernels.gpt2(d=128, vocab=8192, ctx=256, name="gpt2_d128")],
            # one thread, few rounds: about 40 s of the 2 minutes
            window=window.WindowConfig(threads=(1,), rounds=3),
        )
    return dict(
        flat_sizes=[2**16, 2**20, 2**24, 2**26],
        lists=[
            kernels.gpt2(),
            kernels.llama(1024, 2752, blocks=2, name="llama_h1024"),
            kernels.many_small(2048, 65536),
            kernels.uniform(2048, 256),
        ],
        grad_dtypes=[bf16, fp16, fp32],
        step_workloads=[kernels.flat(2**20), kernels.flat(2**24), kernels.gpt2()],
        timing=common.TimingConfig(samples=10, warmup_ms=50.0, min_sample_ms=50.0),
        copy_bytes=8 * cache,
        max_rotations=512,
        e2e=end_to_end.E2EConfig(
            vocab=2048, d_model=256, n_layers=4, n_heads=4, seq_len=128, micro_batch=4, windows=6, warmup_windows=1
        ),
        # issue 11's table: one 1M, 16M and 64M tensor, and GPT-2 small (148 tensors, 124M)
        cpu_adam=[kernels.flat(2**20), kernels.flat(2**24), kernels.flat(2**26), kernels.gpt2()],
        # issue 11's end-to-end table: both models, fp32 and bf16, 1 and 2 threads (~3 minutes)
        window=window.WindowConfig(),
    )


class _NoBar:
    """Stands in for tqdm where it is not installed."""

    def __init__(self, total, **_):
        self.total = total

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(total)
    # disable=None: a bar on a terminal; none in a log file, where it would be 1000 \r-lines.
    return tqdm(total=total, unit="case", disable=None, dynamic_ncols=True, file=sys.stderr)


def _auto_threads(device: torch.device) -> Optional[int]:
    """1 thread when other work already loads this CPU (1-minute load average over half the
    cores), else None (torch's default). A parallel op waits for its slowest thread, and a
    descheduled one costs a scheduler tick: on this shared 2-core machine at load 3, a 64K
    element add went from 3 us to 16 ms and --quick from 56 s to 220 s with 2 threads."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    return 1 if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1) else None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fused_accum bench",
        description=__doc__.split("\n\n")[0],
        epilog=f"Other benchmarks: fused_accum bench TOOL [args], TOOL one of {', '.join(TOOLS)}.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: under 2 minutes on 2 CPU cores")
    size.add_argument("--smoke", action="store_true", help="tiniest sizes, a few seconds (for the tests)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (default: benchmarks/results)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--suite", default=",".join(SUITES), help=f"comma-separated subset of {SUITES}")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="start no new group after S seconds (what ran is still written)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's, or 1 on a CPU whose load average "
        "is over half its cores; see _auto_threads); the cpu_adam and window "
        "suites time 1 and 2 threads whatever this says",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: fresh)")
    parser.add_argument("--no-plot", action="store_true", help="write no kernels.png nor window.png")
    parser.add_argument(
        "--replot",
        metavar="DIR",
        default=None,
        help="measure nothing: draw kernels.png and window.png again from DIR/results.json, into DIR",
    )
    args = parser.parse_args(list(argv))
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown:
        parser.error(f"--suite takes names from {SUITES}, got {unknown}")
    return args


def _summary(kernel_rows: List[Dict], e2e_rows: List[Dict], copy: Dict, window_rows: Sequence[Dict] = ()) -> List[str]:
    """The last lines printed: per (op, workload) at bf16 on the largest size, our best against
    torch's best, and the end-to-end and window rows."""
    lines = [f"copy ceiling: {copy['gbps']:.1f} GB/s"]
    keyed: Dict[tuple, List[Dict]] = {}
    for r in kernel_rows:
        if r["grad_dtype"] in ("bf16", "-") and math.isfinite(r["ms"]):
            keyed.setdefault((r["op"], r["workload"]), []).append(r)
    for (op, workload), rows in keyed.items():
        largest = max(r["numel"] for r in rows)
        rows = [r for r in rows if r["numel"] == largest]
        ours = min((r for r in rows if r["kind"] == "fused_accum"), key=lambda r: r["ms"], default=None)
        theirs = min((r for r in rows if r["kind"] == "torch"), key=lambda r: r["ms"], default=None)
        if ours is None or theirs is None:
            continue
        lines.append(
            f"{op:<17} {workload:<13} {common.fmt_numel(largest):>7}  ours {ours['provider']:<9} "
            f"{ours['ms']:9.4f} ms {ours['pct_of_copy']:5.1f}% copy | torch {theirs['provider']:<13} "
            f"{theirs['ms']:9.4f} ms {theirs['pct_of_copy']:5.1f}% copy | {ours['speedup_vs_torch']:.2f}x"
        )
    lines += [end_to_end.format_row(r) for r in e2e_rows]
    lines += [window.format_row(r) for r in window_rows]
    return lines


def failed_rows(kernel_rows, e2e_rows, cpu_adam_rows=(), window_rows=()) -> List[Dict]:
    """The rows that failed to run or disagreed with their oracle. An unavailable optional
    provider (deepspeed not installed) is a note, not a failure."""
    bad = [r for r in kernel_rows if not r["ok"]] + [r for r in e2e_rows if not math.isfinite(r["window_ms"])]
    bad += [r for r in cpu_adam_rows if not r["ok"] and not r["note"].startswith("unavailable")]
    bad += [r for r in window_rows if not r["ok"]]
    return bad


def _row_label(r: Dict) -> str:
    if r.get("section") == "window":
        return f"window {r['model']} {r['dtype']} {r['provider']}"
    if "variant" in r:
        return f"e2e {r['variant']}"
    return f"{r['op']} {r['workload']} {common.fmt_numel(int(r['numel']))} {r.get('grad_dtype', '-')} {r['provider']}"


def verdict(kernel_rows, e2e_rows, cpu_adam_rows=(), window_rows=(), skipped=(), interrupted=False) -> str:
    """The run's last line: whether every row ran and matched its oracle, and, for the kernel
    groups, how many ours won against torch's best provider (the median ratio)."""
    bad = failed_rows(kernel_rows, e2e_rows, cpu_adam_rows, window_rows)
    n = len(kernel_rows) + len(e2e_rows) + len(cpu_adam_rows) + len(window_rows)
    best: Dict[tuple, float] = {}
    for r in kernel_rows:  # our best provider per kernel group
        if r["kind"] == "fused_accum" and r["ok"] and math.isfinite(r.get("speedup_vs_torch", math.nan)):
            key = (r["op"], r["workload"], r["numel"], r["grad_dtype"])
            best[key] = max(best.get(key, 0.0), r["speedup_vs_torch"])
    parts = []
    if best:
        wins = sum(x > 1.0 for x in best.values())
        parts.append(
            f"ours faster than torch's best in {wins} of {len(best)} kernel groups "
            f"(median {statistics.median(best.values()):.2f}x)"
        )
    window_vs = [r["speedup_vs_native"] for r in window_rows if r["provider"] == "fused_accum" and r["ok"]]
    if window_vs:
        parts.append(f"window vs native {min(window_vs):.2f}x to {max(window_vs):.2f}x")
    if skipped:
        parts.append(f"{len(skipped)} skipped by the time budget")
    if interrupted:
        head = f"INTERRUPTED: {n} rows measured and written"
    elif bad:
        head = f"FAILED: {len(bad)} of {n} rows failed or wrong (first: {_row_label(bad[0])})"
    else:
        head = f"OK: all {n} rows ran and matched their oracles"
    return "; ".join([f"verdict: {head}"] + parts)


def write_all(
    out: Path,
    meta: Dict,
    copy: Dict,
    kernel_rows: List[Dict],
    e2e_rows: List[Dict],
    skipped: List[str],
    plot: bool,
    cpu_adam_rows: Sequence[Dict] = (),
    window_rows: Sequence[Dict] = (),
    suites: Sequence[str] = SUITES,
) -> List[Path]:
    """Write (or rewrite) the result files of ``suites``; returns the paths written. A suite not
    asked for writes no CSV, so a folder of one suite's results holds only that suite's."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json"]
    common.write_json(
        paths[0],
        {
            "meta": meta,
            "copy": copy,
            "kernels": kernel_rows,
            "end_to_end": e2e_rows,
            "cpu_adam": list(cpu_adam_rows),
            "window": list(window_rows),
            "skipped": skipped,
        },
    )
    csvs = [
        ("kernels.csv", kernel_rows, {"accumulate", "step"} & set(suites)),
        ("end_to_end.csv", e2e_rows, "e2e" in suites),
        ("window.csv", window_rows, "window" in suites),
        ("cpu_adam.csv", cpu_adam_rows, bool(cpu_adam_rows)),
    ]
    for name, rows, asked in csvs:
        if asked:
            paths.append(out / name)
            common.write_csv(paths[-1], list(rows), meta)
    if plot:
        title = f"{meta['device_name']} | torch {meta['torch']} | {meta['git_commit'][:10]} | {meta['date_utc']}"
        threads = f" | {meta['torch_threads']} torch thread" + ("s" if meta.get("torch_threads") != 1 else "")
        if common.plot_gbps(out / "kernels.png", kernel_rows, copy["start"]["gbps"], title + threads):
            paths.append(out / "kernels.png")
        if "window" in suites and common.plot_window(out / "window.png", list(window_rows), title):
            paths.append(out / "window.png")
    return paths


def replot(folder: Path) -> List[Path]:
    """kernels.png and window.png drawn again from ``folder``/results.json (the rows a run wrote,
    titled with that run's machine, torch, commit and date), into ``folder``."""
    payload = json.loads((folder / "results.json").read_text())
    meta = payload["meta"]
    nan = lambda rows: [{k: (math.nan if v is None else v) for k, v in r.items()} for r in rows]  # noqa: E731
    title = " | ".join(
        [meta.get("device_name", "?"), f"torch {meta.get('torch', '?')}", str(meta.get("git_commit", "?"))[:10]]
        + [meta.get("date_utc", "?")]
    )
    paths = []
    kernel_rows = nan(payload.get("kernels", []))
    if kernel_rows:
        threads = f" | {meta['torch_threads']} torch thread" + ("s" if meta.get("torch_threads") != 1 else "")
        if common.plot_gbps(folder / "kernels.png", kernel_rows, payload["copy"]["start"]["gbps"], title + threads):
            paths.append(folder / "kernels.png")
    if payload.get("window") and common.plot_window(folder / "window.png", nan(payload["window"]), title):
        paths.append(folder / "window.png")
    return paths


TOOLS = {  # name -> module of benchmarks/ with a main(argv)
    "phases": "window_phases",
    "distributed": "distributed",
    "wire": "wire",
    "wgrad": "wgrad",
    "triton-sweep": "triton_sweep",
    "triton-host": "triton_host",
    "offload": "offload",
    "compile": "compile",
    "sharded-storage": "sharded_storage",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the suite; 0 when every provider ran and matched its oracle, else 1. With a TOOL as
    the first argument, that benchmark instead (see the module's docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        import importlib

        return importlib.import_module(f"benchmarks.{TOOLS[argv[0]]}").main(argv[1:]) or 0
    args = _parse(argv)
    if args.replot is not None:
        paths = replot(Path(args.replot))
        print("wrote " + (", ".join(map(str, paths)) or "nothing (no rows, or no matplotlib)"))
        return 0 if paths else 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda was asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    threads_before = torch.get_num_threads()
    threads = args.threads if args.threads is not None else _auto_threads(device)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with common.stop_on_sigint():  # even when started with SIGINT ignored (in the background)
            return _run(args, argv, device)
    finally:
        torch.set_num_threads(threads_before)  # callers in the same process keep their setting


def _run(args: argparse.Namespace, argv: List[str], device: torch.device) -> int:
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = make_config(device, mode)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    out = Path(args.out)
    started = time.perf_counter()

    meta = common.metadata(device, argv)
    meta.update(mode=mode, seed=seed, time_budget_s=args.time_budget)
    common.log(
        f"fused_accum bench: {mode} on {meta['device_name']} | torch {meta['torch']} | "
        f"triton {meta['triton']} | commit {meta['git_commit']} | backends "
        + ", ".join(n for n, why in meta["backends"].items() if not why)
    )
    load = meta.get("load_average_1min")
    if device.type == "cpu" and load is not None and load > 0.5 * (meta["cpu_count"] or 1):
        common.log(
            f"note: load average {load:.1f} on {meta['cpu_count']} cores: other work shares this CPU, "
            f"expect noisy times (compare ratios within this run); torch threads: {torch.get_num_threads()}"
        )

    copy_bytes = cfg["copy_bytes"]
    copy = common.copy_ceiling(device, copy_bytes, cfg["timing"])
    common.log(
        f"copy ceiling: {copy['gbps']:.1f} GB/s ({copy['bytes_moved'] / 1e6:.0f} MB moved in "
        f"{copy['ms']:.3f} ms, ±{copy['spread_pct']:.0f}%)"
    )
    ctx = kernels.Context(
        device,
        cfg["timing"],
        common.last_level_cache_bytes(device),
        copy["gbps"],
        seed=seed,
        max_rotations=cfg["max_rotations"],
    )

    ops = [op for op in kernels.ACC_OPS if "accumulate" in args.suites]
    ops += [op for op in kernels.STEP_OPS if "step" in args.suites]
    first = kernels.plan(device, cfg["flat_sizes"], cfg["lists"], cfg["grad_dtypes"][:1], cfg["step_workloads"], ops)
    rest = kernels.plan(device, cfg["flat_sizes"], cfg["lists"], cfg["grad_dtypes"][1:], [], ops)
    run_e2e = "e2e" in args.suites
    run_window = "window" in args.suites
    total = sum(len(g.providers) for g in first + rest) + (len(end_to_end.VARIANTS) if run_e2e else 0)
    total += window.n_rows(cfg["window"]) if run_window else 0

    kernel_rows: List[Dict] = []
    e2e_rows: List[Dict] = []
    cpu_adam_rows: List[Dict] = []
    window_rows: List[Dict] = []
    skipped: List[str] = []
    bar = _progress_bar(total)
    over_budget = lambda: args.time_budget is not None and time.perf_counter() - started > args.time_budget

    def run_groups(groups):
        for group in groups:
            if over_budget():
                skipped.append(group.label)
                bar.update(len(group.providers))
                continue
            rows = []
            for row in kernels.run_group(group, ctx):
                rows.append(row)
                bar.update(1)
            kernels.add_speedups(rows)
            for row in rows:
                common.log(kernels.format_row(row))
            kernel_rows.extend(rows)
            write_all(out, meta, {"start": copy}, kernel_rows, e2e_rows, skipped, plot=False, suites=args.suites)

    interrupted = False
    try:
        run_groups(first)
        write_all(out, meta, {"start": copy}, kernel_rows, e2e_rows, skipped, plot=False, suites=args.suites)
        if run_e2e:
            if over_budget():
                skipped.append("end_to_end")
                bar.update(len(end_to_end.VARIANTS))
            else:

                def on_row(row):
                    bar.update(1)
                    common.log(end_to_end.format_row(row))

                e2e_rows = end_to_end.run(cfg["e2e"], device, progress=on_row)
            write_all(out, meta, {"start": copy}, kernel_rows, e2e_rows, skipped, plot=False, suites=args.suites)
        if run_window:

            def on_window_row(row):
                bar.update(1)
                common.log(window.format_row(row))

            window_rows = window.run(
                cfg["window"], device, progress=on_window_row, over_budget=over_budget, skipped=skipped
            )
            write_all(
                out,
                meta,
                {"start": copy},
                kernel_rows,
                e2e_rows,
                skipped,
                plot=False,
                window_rows=window_rows,
                suites=args.suites,
            )
        run_groups(rest)
        if "cpu_adam" in args.suites and device.type == "cpu":
            for workload in cfg["cpu_adam"]:
                for op in kernels.CPU_ADAM_OPS:
                    if over_budget():
                        skipped.append(f"cpu_adam {op} {workload.name}")
                        continue
                    providers = cfg.get("cpu_adam_providers", kernels.CPU_ADAM_PROVIDERS)
                    rows = kernels.run_cpu_adam(workload, op, CPU_ADAM_THREADS, cfg["timing"], providers, seed=seed)
                    for row in rows:
                        common.log(kernels.format_cpu_adam_row(row))
                    cpu_adam_rows.extend(rows)
    except KeyboardInterrupt:  # a time limit's SIGINT: keep what was measured, skip the rest
        interrupted = True
        common.log("interrupted: writing what was measured")
    finally:
        bar.close()

    if interrupted:  # no second copy: the signal says time is up
        copies = {"start": copy}
        meta["interrupted"] = True
    else:
        # The copy again at the end: how far the machine drifted during the run (other load,
        # clocks), the yardstick for which differences are noise.
        copy_end = common.copy_ceiling(device, copy_bytes, cfg["timing"])
        copies = {"start": copy, "end": copy_end, "drift_pct": 100.0 * (copy_end["gbps"] / copy["gbps"] - 1.0)}
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    paths = write_all(
        out,
        meta,
        copies,
        kernel_rows,
        e2e_rows,
        skipped,
        plot=not (args.no_plot or interrupted),
        cpu_adam_rows=cpu_adam_rows,
        window_rows=window_rows,
        suites=args.suites,
    )
    if interrupted:
        print(
            f"interrupted after {meta['elapsed_s']} s: {len(kernel_rows)} kernel rows, {len(e2e_rows)} "
            f"end-to-end rows written to " + ", ".join(str(p) for p in paths)
        )
        print(verdict(kernel_rows, e2e_rows, cpu_adam_rows, window_rows, skipped, interrupted=True))
        return 1

    bad = failed_rows(kernel_rows, e2e_rows, cpu_adam_rows, window_rows)
    print("\n".join(["", "summary"] + _summary(kernel_rows, e2e_rows, copy, window_rows)))
    print(
        f"copy drift over the run: {copies['drift_pct']:+.1f}%; {len(kernel_rows)} kernel rows, "
        f"{len(e2e_rows)} end-to-end rows, {len(window_rows)} window rows, "
        f"{len(skipped)} groups skipped (time budget), "
        f"{len(bad)} failed or wrong; {meta['elapsed_s']} s"
    )
    print("wrote " + ", ".join(str(p) for p in paths))
    print(verdict(kernel_rows, e2e_rows, cpu_adam_rows, window_rows, skipped))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
