"""The fused weight-gradient GEMM against autograd's bf16 weight gradient plus the fold.

For the Linear shapes of a 1B-class transformer (hidden 2048, MLP 8192: weights 2048 x 2048,
8192 x 2048 and 2048 x 8192) and 4k-16k tokens per micro-batch, one micro-batch's weight
gradient reaching the fp32 accumulator, per provider:

  unfused         what nn.Linear + FusedAccumOptimizer do today: autograd's GEMM in bf16
                  (``x^T g``, transposed, as F.linear's backward computes it), then the fold
                  (``ops.accumulate`` on the device's backend: read bf16 + acc, write acc)
  bf16_gemm       the bf16 GEMM alone: the goal on a GPU is a fused wgrad at least this fast
                  (the fold for free)
  fused:<b>       ``ops.wgrad_accumulate(acc, g, x, overwrite=False, backend=b)``

Reported per row: median ms (min/max), TFLOP/s (2 M N K), the byte model's bytes and GB/s,
and the peak memory the call allocates above its inputs and acc (CUDA: max_memory_allocated;
CPU: the profiler's allocator events, the method of tests/test_nn.py). Byte model per call:
g and x are read once (2 M N + 2 M K); the fused call reads and writes acc (8 N K); unfused
also writes and reads the bf16 gradient (2 + 2 N K), 12 N K in all. (A GEMM re-reads its
operands from L2/LLC per tile; the model counts the floor.)

  python -m benchmarks.wgrad --quick --threads 1 # CPU: shapes / 8, tokens 512 and 2048
  python -m benchmarks.wgrad --device cuda      # GPU: the full shapes

``--e2e`` adds the end-to-end window of benchmarks/end_to_end.py's small GPT (bf16, AdamW,
``FusedAccumOptimizer``) with and without ``fused_accum.nn.convert_linears_``: ms per window,
final loss, peak memory of the timed windows (CUDA) or of the last window (CPU, profiler).

Writes wgrad.csv (and with --e2e wgrad_e2e.csv) a row at a time as each is measured, so a run
stopped at a time limit keeps them, and wgrad.json (with the machine, torch/triton versions and the
commit) at the end (an interrupt, SIGINT, still writes it) to --out. On the CPU the fused providers skip the bf16 rounding but not the upcast: see
fused_accum/backends/wgrad.py for why the cpu backend upcasts in row blocks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks import common
from fused_accum import backends, ops

# (N_out, K_in) of a 1B-class model's Linear weights, and tokens per micro-batch
FULL_WEIGHTS = [(2048, 2048), (8192, 2048), (2048, 8192)]
FULL_TOKENS = [4096, 8192, 16384]
QUICK_SCALE = 8  # --quick: every dimension / 8 (a 2-core CPU does ~10-15 fp32 GFLOP/s)
QUICK_TOKENS = [512, 2048]
SMOKE_SCALE, SMOKE_TOKENS = 64, [67]  # --smoke: seconds, for tests/test_nn.py


def _peak_extra_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Bytes allocated at the peak of one ``fn()`` above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_peak_bytes(fn)


def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak bytes allocated by the CPU allocator during ``fn()``, above the level at its start.

    torch.profiler with profile_memory=True records every allocation and free that goes
    through c10's CPU allocator (reportMemoryUsage), including temporaries inside ops and
    the gradients autograd creates and frees; replaying those events in time order gives the
    exact live-bytes curve. (sys.getallocatedblocks or RSS would see Python objects or the
    OS's pages, not tensor storage.) A CPU backward runs on the calling thread, which the
    profiler observes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def providers(device: torch.device, names: Sequence[str]) -> Dict[str, Callable]:
    """name -> fn(acc_flat, acc, g, x) for the providers that run on ``device``."""
    fold_backend = backends.resolve("auto", device)
    offsets = torch.zeros(1, dtype=torch.int64)

    def unfused(acc_flat, acc, g, x):
        w = x.t().mm(g).t()  # F.linear's backward: (x^T g)^T, bf16
        ops.accumulate(acc_flat, offsets, [w], 1.0, False, None, None, fold_backend)

    def bf16_gemm(acc_flat, acc, g, x):
        x.t().mm(g)

    out: Dict[str, Callable] = {f"unfused({fold_backend} fold)": unfused, "bf16_gemm": bf16_gemm}
    for name in names:
        # the cpu/cuda wgrad is torch BLAS (no extension needed): it runs on its own device type
        runs = (
            name == "reference"
            or name == device.type
            or (name == "triton" and backends.availability(name, device.type) == "")
        )
        if runs:
            out[f"fused:{name}"] = lambda acc_flat, acc, g, x, name=name: ops.wgrad_accumulate(acc, g, x, False, name)
    return out


def byte_model(provider: str, m: int, n: int, k: int) -> int:
    operands = 2 * m * n + 2 * m * k
    if provider == "bf16_gemm":
        return operands + 2 * n * k
    if provider.startswith("unfused"):
        return operands + 12 * n * k
    return operands + 8 * n * k


def run(
    device: torch.device,
    shapes,
    names,
    config: common.TimingConfig,
    seed: int,
    on_row: Callable[[Dict], None] = lambda row: None,
) -> List[Dict]:
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for m, n, k in shapes:
        g = torch.randn(m, n, generator=gen).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        acc_flat = torch.randn(n * k, generator=gen).to(device)
        acc = acc_flat.view(n, k)
        for provider, fn in providers(device, names).items():
            call = lambda _args, fn=fn: fn(acc_flat, acc, g, x)  # noqa: E731
            timing = common.measure(call, [None], device, config)
            peak = _peak_extra_bytes(lambda: call(None), device)
            moved = byte_model(provider, m, n, k)
            row = dict(
                tokens=m,
                n_out=n,
                k_in=k,
                provider=provider,
                device=device.type,
                ms=timing.median_ms,
                ms_min=timing.min_ms,
                ms_max=timing.max_ms,
                tflops=2 * m * n * k / timing.median_ms / 1e9,
                bytes_moved=moved,
                gbps=common.gbps(moved, timing.median_ms),
                peak_extra_bytes=peak,
                bf16_wgrad_bytes=2 * n * k,
            )
            rows.append(row)
            on_row(row)
            common.log(
                f"M={m:>6} N={n:>5} K={k:>5} {provider:<26} {row['ms']:9.2f} ms "
                f"[{row['ms_min']:.2f}, {row['ms_max']:.2f}]  {row['tflops']:7.3f} TFLOP/s  "
                f"{row['gbps']:7.1f} GB/s  peak +{peak / 2**20:7.2f} MiB"
            )
    return rows


def e2e(device: torch.device, quick: bool, on_row: Callable[[Dict], None] = lambda row: None) -> List[Dict]:
    """The small GPT's training window with and without converted Linears (same data/init)."""
    import dataclasses
    import statistics
    import time

    from benchmarks import end_to_end
    from fused_accum import FusedAccumOptimizer
    from fused_accum.nn import convert_linears_

    cfg = end_to_end.E2EConfig()
    if quick:
        cfg = dataclasses.replace(
            cfg,
            vocab=512,
            d_model=128,
            n_layers=2,
            n_heads=4,
            seq_len=64,
            micro_batch=4,
            accum_steps=4,
            windows=4,
            warmup_windows=1,
        )
    batches = end_to_end.make_batches(cfg, device)
    rows = []
    for converted in (False, True):
        torch.manual_seed(cfg.seed)
        model = end_to_end.TinyGPT(cfg).to(device=device, dtype=torch.bfloat16)
        if converted:
            convert_linears_(model)
        opt = FusedAccumOptimizer(
            model.parameters(), "adamw", accum_steps=cfg.accum_steps, lr=cfg.lr, weight_decay=cfg.weight_decay
        )

        def window(micro_batches):
            losses = []
            for inputs, targets in micro_batches:
                loss = model(inputs, targets)
                (loss / cfg.accum_steps).backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            return torch.stack(losses).float().mean().item()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for i, micro_batches in enumerate(batches):
            common.synchronize(device)
            t0 = time.perf_counter()
            if device.type == "cpu" and i == len(batches) - 1:
                peak = _peak_extra_bytes(lambda: losses.append(window(micro_batches)), device)
            else:
                losses.append(window(micro_batches))
            common.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        timed = times[cfg.warmup_windows : -1] if device.type == "cpu" else times[cfg.warmup_windows :]
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        row = dict(
            e2e="tiny_gpt",
            converted=converted,
            window_ms=statistics.median(timed),
            window_ms_min=min(timed),
            window_ms_max=max(timed),
            first_loss=losses[0],
            final_loss=losses[-1],
            peak_bytes=peak,
            peak_kind="max_memory_allocated" if device.type == "cuda" else "last window, above its start",
            config=",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()),
        )
        rows.append(row)
        on_row(row)
        common.log(
            f"e2e tiny GPT {'converted  ' if converted else 'nn.Linear  '} {row['window_ms']:9.1f} ms/window "
            f"[{row['window_ms_min']:.1f}, {row['window_ms_max']:.1f}]  loss {row['first_loss']:.4f} -> "
            f"{row['final_loss']:.4f}  peak {peak / 2**20:.1f} MiB ({row['peak_kind']})"
        )
        del model, opt
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    with common.stop_on_sigint():  # even when started with SIGINT ignored (in the background)
        return _main(argv)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wgrad", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"shapes / {QUICK_SCALE}, tokens {QUICK_TOKENS} (CPU)")
    size.add_argument("--smoke", action="store_true", help=f"shapes / {SMOKE_SCALE}, tokens {SMOKE_TOKENS} (tests)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated fused backends (default: cpu: reference,cpu; cuda: cuda,triton,reference)",
    )
    parser.add_argument("--samples", type=int, default=None, help="timed samples per row (default 10, --quick 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on the CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e", action="store_true", help="also the small GPT's window with and without conversion")
    parser.add_argument(
        "--out", default=str(common.REPO_ROOT / "benchmarks" / "results"), help="folder for wgrad.csv/json"
    )
    parser.add_argument(
        "--extra-out",
        default=None,
        help="folder for wgrad_e2e.csv and wgrad.json instead of --out (device_check.sh: --out "
        "holds only the files that come back from a lent GPU)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    default = "cuda,triton,reference" if device.type == "cuda" else "reference,cpu"
    names = [n for n in (args.backends or default).split(",") if n]
    for name in names:
        if name not in backends.NAMES:
            parser.error(f"--backends: {name!r} is not one of {sorted(backends.NAMES)}")
    if args.quick or args.smoke:
        scale, tokens = (QUICK_SCALE, QUICK_TOKENS) if args.quick else (SMOKE_SCALE, SMOKE_TOKENS)
        weights = [(n // scale, k // scale) for n, k in FULL_WEIGHTS]
    else:
        weights, tokens = FULL_WEIGHTS, FULL_TOKENS
    shapes = [(m, n, k) for m in tokens for n, k in weights]
    small = args.quick or args.smoke
    config = common.TimingConfig(
        samples=args.samples or (3 if small else 10),
        warmup_ms=25.0 if not args.smoke else 1.0,
        min_sample_ms=10.0 if not args.smoke else 1.0,
    )
    meta = common.metadata(device, ["benchmarks/wgrad.py", *(argv if argv is not None else sys.argv[1:])])
    common.log(
        f"wgrad on {meta['device_name']} ({device.type}), torch {meta['torch']}, "
        f"commit {meta['git_commit']}{' (dirty)' if meta.get('git_dirty') else ''}, "
        f"{meta['torch_threads']} threads, load {meta['load_average_1min']}"
    )
    out = Path(args.out)
    extra = Path(args.extra_out) if args.extra_out else out
    for folder in (out, extra):
        folder.mkdir(parents=True, exist_ok=True)
    gemm_csv, e2e_csv = common.CsvAppender(out / "wgrad.csv", meta), common.CsvAppender(extra / "wgrad_e2e.csv", meta)
    rows: List[Dict] = []
    e2e_rows: List[Dict] = []
    interrupted = False
    try:
        rows.extend(run(device, shapes, names, config, args.seed, on_row=gemm_csv.add))
        if args.e2e:
            e2e_rows.extend(e2e(device, quick=small, on_row=e2e_csv.add))
    except KeyboardInterrupt:  # a time limit's SIGINT: the CSV rows so far are written; the json too
        interrupted = True
        meta["interrupted"] = True
        common.log("interrupted: writing what was measured")
    finally:
        gemm_csv.close()
        e2e_csv.close()
    if interrupted:  # run()/e2e() did not return their lists: the rows are in the CSVs
        rows = _read_csv(out / "wgrad.csv")
        e2e_rows = _read_csv(extra / "wgrad_e2e.csv")
    common.write_json(extra / "wgrad.json", {"meta": meta, "rows": rows, "e2e": e2e_rows})
    common.log(f"wrote {out / 'wgrad.csv'} and {extra / 'wgrad.json'}")
    return 1 if interrupted else 0


def _read_csv(path: Path) -> List[Dict]:
    import csv

    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


if __name__ == "__main__":
    sys.exit(main())
