"""offload="cpu": what the host step costs, and (on a GPU) what offloading costs a window.

    python -m fused_accum bench offload [--quick] [--out DIR]

On any machine: the host step of one bucket (AdamW, bf16 parameters with fp32 masters, the
package's CPU kernels, one thread and all of them), and the copy aside that speculation makes
before it (fused_accum/offload.py), per bucket size: the budget the window's last backward has
to hide them in (a bucket lands on the host every (bucket bytes / device-to-host bandwidth)).

On a GPU also: a k = 8 window of a small bf16 GPT (benchmarks/end_to_end.TinyGPT) with and
without offload: ms per window, peak device memory, and the fraction of the host step hidden
behind the last backward (1 - what offload added to the window / the host's busy time).
Writes offload.csv (one row per measurement) and prints a table; a timing, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import fused_accum  # noqa: E402
from benchmarks import common  # noqa: E402
from fused_accum import ops  # noqa: E402
from fused_accum.algorithms import AdamHyper  # noqa: E402


def host_step_rows(sizes, threads, repeats=5) -> list:
    rows = []
    for numel in sizes:
        master, m, v, acc = (torch.randn(numel) for _ in range(4))
        v.abs_()
        lp = torch.empty(numel, dtype=torch.bfloat16)
        # what offload's speculation copies aside (OffloadLayout.back_up): the master, the
        # moments and the host copy of the weight, 14 B/param (the gradient is not changed)
        aside = [(buf, torch.empty_like(buf)) for buf in (master, m, v, lp)]
        steps = torch.ones(1)
        t = ops.StepTensors(
            [master], [acc], steps, torch.tensor(1e-3, dtype=torch.float64), torch.ones(()), lp_params=[lp]
        )
        s = ops.AdamStates([m], [v])
        h = AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            step_t, copy_t = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                for buf, copy in aside:
                    copy.copy_(buf)
                copy_t.append(time.perf_counter() - start)
                start = time.perf_counter()
                ops.adam_step(t, s, h, "cpu" if fused_accum.backends.availability("cpu", "cpu") == "" else "reference")
                step_t.append(time.perf_counter() - start)
            step_ms, copy_ms = statistics.median(step_t) * 1e3, statistics.median(copy_t) * 1e3
            rows.append(
                dict(
                    what="host step of one bucket",
                    numel=numel,
                    bucket_mb=numel * 4 / 2**20,
                    threads=n_threads,
                    step_ms=round(step_ms, 3),
                    backup_ms=round(copy_ms, 3),
                    step_gbs=round(numel * 30 / step_ms / 1e6, 2),  # the AdamW step's 30 B/param
                )
            )
    return rows


def window_rows(device, windows=6) -> list:
    from benchmarks.end_to_end import E2EConfig, TinyGPT, make_batches

    rows = []
    cfg = E2EConfig(
        d_model=256, n_layers=4, n_heads=4, vocab=4096, seq_len=256, micro_batch=4, accum_steps=8, windows=windows
    )
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(device, torch.bfloat16)
        opt = fused_accum.AdamW(model.parameters(), lr=1e-4, accum_steps=8, max_grad_norm=1.0, offload=offload)
        torch.cuda.reset_peak_memory_stats(device)
        times, waits = [], []
        for w, window in enumerate(make_batches(cfg, device)):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for idx, targets in window:
                (model(idx, targets) / 8).backward()
            torch.cuda.synchronize(device)
            before_step = time.perf_counter()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize(device)
            end = time.perf_counter()
            if w >= 2:
                times.append(end - start)
                waits.append(end - before_step)
        row = dict(
            what="k = 8 window, bf16 TinyGPT",
            offload=offload or "none",
            window_ms=round(statistics.median(times) * 1e3, 2),
            step_wait_ms=round(statistics.median(waits) * 1e3, 2),
            peak_device_mb=round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        )
        if offload:
            worker = opt._window.offload.worker
            busy_ms = worker.busy_s / len(make_batches(cfg, device)) * 1e3
            row["host_busy_ms"] = round(busy_ms, 2)
            # how much of the host's work added nothing to the window (the last backward waits
            # for its speculation, step() for the rest: neither wait alone tells)
            added = row["window_ms"] - rows[0]["window_ms"]
            row["hidden_fraction"] = round(min(1.0, max(0.0, 1 - added / busy_ms)), 3) if busy_ms else None
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two bucket sizes, one thread count")
    parser.add_argument("--out", default=None, help="write offload.csv here")
    args = parser.parse_args(argv)
    with common.stop_on_sigint():
        sizes = [2**17, 2**20] if args.quick else [2**17, 2**20, 2**22, 25 * 2**18]
        threads = [1] if args.quick else sorted({1, torch.get_num_threads()})
        rows = host_step_rows(sizes, threads)
        if torch.cuda.is_available():
            rows += window_rows(torch.device("cuda"))
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    if args.out:
        meta = common.metadata(torch.device("cuda" if torch.cuda.is_available() else "cpu"), list(argv or []))
        common.write_csv(Path(args.out) / "offload.csv", rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
