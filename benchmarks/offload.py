"""offload="cpu": what the host step costs, and (on a GPU) what offloading costs a window.

    python -m fused_accum bench offload [--quick] [--out DIR]

On any machine: the host step of one bucket (AdamW, bf16 parameters with fp32 masters, the
package's CPU kernels, one thread and all of them), a speculated bucket's host step (the same
step out of place, reading the live buffers and writing their twins: ``ops.StepTensors.sources``,
what offload's double-buffered speculation runs; issue 37's bound is 1.3 x the plain step), and
for comparison the copy of the live buffers over their twins that an in-place step on the twins
would need first, per bucket size: the budget the window's last backward has to hide
them in (a bucket lands on the host every (bucket bytes / device-to-host bandwidth)).

On a GPU also: a k = 8 window of a small bf16 GPT (benchmarks/end_to_end.TinyGPT) with and
without offload: ms per window, peak device memory, the optimizer's device bytes per parameter
(after its build and after the last window; the bf16 weight's 2 B are beside them), and with
offload the host work per window (the host steps, out of place where the window speculated,
timed on the worker, not its waits for the copies; the warm-up windows left out), the fraction of it hidden
(1 - what offload added to the window / that host work), and how many windows speculated and
how many buckets' speculations were committed or put back and stepped again (a clipped window's
are redone, and the next window does not speculate: see fused_accum/offload.py).
Writes offload.csv as each row is measured (one row per measurement) and prints it; a timing,
never a test.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import fused_accum  # noqa: E402
from benchmarks import common  # noqa: E402
from fused_accum import ops  # noqa: E402


def host_step_rows(sizes, threads, repeats=11, out=None) -> list:
    """``out``: called with each row as it is measured."""
    rows = []
    for numel in sizes:
        master, m, v, acc = (torch.randn(numel) for _ in range(4))
        v.abs_()
        lp = torch.empty(numel, dtype=torch.bfloat16)
        # what offload's speculation reads from the live buffers and writes into their twins
        # (HostLayout.out_of_place): the master, the host copy of the weight and the moments,
        # 14 B/param (the gradient is only read); the step op's sources take them in its order:
        # params (the master), lp_params, states
        aside = [(buf, buf.clone()) for buf in (master, lp, m, v)]
        steps = torch.ones(1)
        t = ops.StepTensors(
            [master], [acc], steps, torch.tensor(1e-3, dtype=torch.float64), torch.ones(()), lp_params=[lp]
        )
        speculated = t._replace(sources=[live for _, live in aside])  # out of place: live -> twins
        s = ops.adam_step.states([m], [v])
        h = ops.adam_step.hyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
        backend = "cpu" if fused_accum.backends.availability("cpu", "cpu") == "" else "reference"
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            step_t, copy_t, spec_t = [], [], []
            for _ in range(repeats):  # (interleaved: a load that comes and goes hits all three)
                start = time.perf_counter()
                for buf, live in aside:
                    buf.copy_(live)
                copy_t.append(time.perf_counter() - start)
                start = time.perf_counter()
                ops.adam_step(t, s, h, backend)
                step_t.append(time.perf_counter() - start)
                start = time.perf_counter()
                ops.adam_step(speculated, s, h, backend)
                spec_t.append(time.perf_counter() - start)
            step_ms, copy_ms = statistics.median(step_t) * 1e3, statistics.median(copy_t) * 1e3
            spec_ms = statistics.median(spec_t) * 1e3
            rows.append(
                dict(
                    what="host step of one bucket",
                    numel=numel,
                    bucket_mb=numel * 4 / 2**20,
                    threads=n_threads,
                    step_ms=round(step_ms, 3),
                    copy_ms=round(copy_ms, 3),  # the live buffers copied over the twins
                    speculated_ms=round(spec_ms, 3),  # a speculated bucket's host time: one pass
                    speculated_over_step=round(spec_ms / step_ms, 2),  # (issue 37: at most 1.3)
                    two_passes_over_step=round((copy_ms + step_ms) / step_ms, 2),  # (a copy, then the step)
                    step_gbs=round(numel * 30 / step_ms / 1e6, 2),  # the AdamW step's 30 B/param
                )
            )
            if out is not None:
                out(rows[-1])
    return rows


class _HostWork:
    """Seconds the offload worker spends stepping buckets on the host (out of place, live into
    twins, where the window speculated): those alone, not its waits for the device-to-host
    copies (``event.synchronize``, which the worker's ``busy_s`` counts too). Patches the
    optimizer's ``prepare_step`` while installed: its returned call (``functools.partial`` of
    the step op, which offload's ``HostLayout.out_of_place`` gives sources) runs the op timed."""

    def __init__(self, opt) -> None:
        self.seconds = 0.0
        self._stepper = opt._window.placement.stepper
        self._own = vars(self._stepper).get("prepare_step")  # (an instance attribute already there)
        self._prepare = self._stepper.prepare_step
        timed = self._timed

        def prepare_step(*args, **kwargs):
            call = self._prepare(*args, **kwargs)
            if call is None:
                return None
            return functools.partial(_TimedOp(call.func, timed), *call.args, **call.keywords)

        self._stepper.prepare_step = prepare_step

    def _timed(self, fn, *args, **kwargs):
        if threading.current_thread().name != "fused_accum offload":  # (a step run on the main thread)
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def remove(self) -> None:
        if self._own is None:
            del self._stepper.prepare_step  # (the class's method again)
        else:
            self._stepper.prepare_step = self._own


class _TimedOp:
    """A step op run through ``timed`` (not a partial: a partial of one would be flattened)."""

    def __init__(self, op, timed) -> None:
        self.op, self.timed = op, timed

    def __call__(self, *args, **kwargs):
        return self.timed(self.op, *args, **kwargs)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device) -> Optional[int]:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _window_row(device, cfg, batches, offload, warmup) -> dict:
    """One variant's k-micro-batch windows: ms per window (median after ``warmup``), the step's
    wait, peak device memory, the optimizer's device bytes per parameter (after its build, and
    held after the last window), and with offload the host work per window (after warm-up, the
    back-up and the step only), the fraction of it hidden, and the speculation's counts."""
    from benchmarks.end_to_end import TinyGPT

    k = cfg.accum_steps
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    _sync(device)
    before = _allocated(device)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-4, accum_steps=k, max_grad_norm=1.0, offload=offload)
    _sync(device)
    built = _allocated(device)
    host = _HostWork(opt) if offload else None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, waits, spec = [], [], []
        committed = redone = 0
        for w, window in enumerate(batches):
            if w == warmup and offload:  # (the worker is idle: step() drained it)
                host.seconds = 0.0
                committed, redone = opt._window.placement.committed, opt._window.placement.redone
            _sync(device)
            start = time.perf_counter()
            for idx, targets in window:
                (model(idx, targets) / k).backward()
            _sync(device)
            before_step = time.perf_counter()
            if offload:
                counts = opt._window.placement.committed + opt._window.placement.redone
            opt.step()
            opt.zero_grad()
            _sync(device)
            end = time.perf_counter()
            if w >= warmup:
                times.append(end - start)
                waits.append(end - before_step)
                if offload:  # (this window's step settled what its last backward speculated)
                    spec.append(opt._window.placement.committed + opt._window.placement.redone > counts)
        held = _allocated(device)
        row = dict(
            what=f"k = {k} window, bf16 TinyGPT",
            offload=offload or "none",
            windows=len(times),
            window_ms=round(statistics.median(times) * 1e3, 2),
            step_wait_ms=round(statistics.median(waits) * 1e3, 2),
            peak_device_mb=round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else "",
            weight_b_per_param=2,  # (bf16)
            opt_device_b_per_param=round((built - before) / n, 2) if before is not None else "",
            opt_device_b_per_param_after=round((held - before) / n, 2) if before is not None else "",
            host_work_ms="",
            hidden_fraction="",
            speculated_windows="",
            committed_buckets="",
            redone_buckets="",
        )
        if offload:
            row["host_work_ms"] = round(host.seconds / len(times) * 1e3, 2)
            row["speculated_windows"] = sum(spec)
            row["committed_buckets"] = opt._window.placement.committed - committed
            row["redone_buckets"] = opt._window.placement.redone - redone
        return row
    finally:
        if host is not None:
            host.remove()
        del opt, model
        gc.collect()
        _sync(device)


def window_rows(device, windows=6, cfg=None, warmup=2, out=None) -> list:
    """Without and with offload, the same windows: see :func:`_window_row`. The offload row's
    hidden fraction is 1 - (what offload added to the median window) / (its host work per
    window): how much of the host's back-up and step the window did not wait for. ``out``:
    called with each row as it is measured."""
    from benchmarks.end_to_end import E2EConfig, make_batches

    if cfg is None:
        cfg = E2EConfig(
            d_model=256, n_layers=4, n_heads=4, vocab=4096, seq_len=256, micro_batch=4, accum_steps=8, windows=windows
        )
    batches = make_batches(cfg, device)
    rows = []
    for offload in (None, "cpu"):
        row = _window_row(device, cfg, batches, offload, warmup)
        if offload:
            added = row["window_ms"] - rows[0]["window_ms"]
            busy = row["host_work_ms"]
            row["hidden_fraction"] = round(min(1.0, max(0.0, 1 - added / busy)), 3) if busy else ""
        rows.append(row)
        if out is not None:
            out(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two bucket sizes, one thread count")
    parser.add_argument("--out", default=None, help="write offload.csv here (rewritten after each row)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = common.metadata(device, list(argv or []))
    rows = []

    def add(row) -> None:  # each row printed and in offload.csv as it is measured (a stage cut at
        rows.append(row)  # its limit keeps what it had)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        if args.out:
            common.write_csv(Path(args.out) / "offload.csv", rows, meta)

    try:
        with common.stop_on_sigint():
            sizes = [2**17, 2**20] if args.quick else [2**17, 2**20, 2**22, 25 * 2**18]
            threads = [1] if args.quick else sorted({1, torch.get_num_threads()})
            host_step_rows(sizes, threads, out=add)
            if device.type == "cuda":
                window_rows(device, out=add)
    except KeyboardInterrupt:
        print(f"offload: interrupted; {len(rows)} rows written", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
