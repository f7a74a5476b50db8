"""Measurement machinery shared by the benchmarks: the byte model, timing, the copy ceiling,
run metadata, and writing CSV / JSON / PNG.

Why each piece is the way it is:

- Device work is asynchronous, so on CUDA a sample is timed with CUDA events around a run of
  back-to-back calls; on the CPU with ``time.perf_counter``.
- A sample repeats the call enough times to last ``min_sample_ms``, so a 5 us launch is not
  timed alone against a ~1 us timer resolution; the median of several samples is reported with
  its min and max, and the spread is the noise floor a difference must beat.
- Calls rotate through several independent argument sets whose total size is at least 4x the
  last-level cache (50 MB of L2 on an H200, 32 MB of L3 here), so a repeat does not find its
  inputs still cached and report cache bandwidth instead of memory bandwidth.
- Inputs are fresh random numbers, never zeros: zeros hide unwritten outputs and can run faster
  than real data (an H200 bf16 matmul ran 13% faster on zeros than on random data).
- GB/s comes from the project's byte model (below: the bytes the operation must move, the
  same for every provider), and is divided by the bandwidth of a plain copy timed in the same
  run: that ratio, not the absolute number, is what carries across noisy shared machines.
  On a CPU, a plain store first reads its cache line (read-for-ownership), so a copy really
  moves 3 bytes per 2 counted and an in-place add (which reads its destination anyway) can
  reach ~150% of "copy"; GPUs write without reading, so there the copy is a true ceiling.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch

from fused_accum.optimizer import padded_offsets  # the optimizer's layout, one definition

REPO_ROOT = Path(__file__).resolve().parent.parent


FP32_BYTES = 4

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")


def elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------
# Byte model. Bytes per parameter that each operation must move at least:
# every input read once, every output written once. The same number is used for every provider
# of an operation, so GB/s compares providers on the work done, not on the work each one chose.
# ---------------------------------------------------------------------------------------------

# fp32 optimizer-state tensors each update reads and writes besides the master weights.
STATE_TENSORS = {"sgd": 1, "adamw": 2, "lion": 1, "adagrad": 1, "ademamix": 3, "muon": 1}


def accumulate_bytes(grad_dtype: torch.dtype, overwrite: bool) -> int:
    """acc = grad (+ acc): read grad, (read acc 4), write acc 4. bf16: 6 first, 10 later."""
    grad = elem_size(grad_dtype)
    return grad + FP32_BYTES if overwrite else grad + 2 * FP32_BYTES


def step_bytes(
    optimizer: str,
    lp_dtype: torch.dtype = torch.bfloat16,
    grad_dtype: Optional[torch.dtype] = None,
    grads_overwrite: bool = False,
) -> int:
    """One optimizer step from the fp32 accumulator with fp32 master and state.

    Reads acc, master, state and the low-precision param (the master follows a weight written
    from outside: fused_accum.backends.reference.follow_weight); writes master, state and the
    low-precision param. With ``grad_dtype`` the window's last micro-batch is fused in: its
    gradient is read too, and with ``grads_overwrite`` (a one-micro-batch window) acc is not read
    at all. The accumulator is left ready to be overwritten, so no zeroing pass is counted.
    AdamW, bf16: 32 (30 before the masters followed the weights); fused: 34.
    """
    n_state = STATE_TENSORS[optimizer]
    read = FP32_BYTES * (2 + n_state) + elem_size(lp_dtype)  # acc, master, state, lp param
    write = FP32_BYTES * (1 + n_state) + elem_size(lp_dtype)  # master, state, lp param
    total = read + write
    if grad_dtype is not None:
        total += elem_size(grad_dtype) - (FP32_BYTES if grads_overwrite else 0)
    return total


def unfused_torch_bytes(
    optimizer: str, grad_dtype: torch.dtype = torch.bfloat16, lp_dtype: torch.dtype = torch.bfloat16
) -> int:
    """What the PyTorch sequence for the window's last micro-batch moves: add into the fp32
    buffer, an fp32 optimizer step reading the buffer as its .grad, a copy of the master into
    the low-precision param, and zeroing the buffer. AdamW, bf16: 10 + 28 + 6 + 4 = 48."""
    n_state = STATE_TENSORS[optimizer]
    add = accumulate_bytes(grad_dtype, overwrite=False)
    fp32_step = FP32_BYTES * (2 + n_state) + FP32_BYTES * (1 + n_state)  # no lp write
    copy = FP32_BYTES + elem_size(lp_dtype)
    zero = FP32_BYTES
    return add + fp32_step + copy + zero


def gbps(bytes_moved: float, ms: float) -> float:
    """Decimal GB/s (1e9 bytes), as memory datasheets and the copy ceiling use."""
    return bytes_moved / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# Flat buffers
# ---------------------------------------------------------------------------------------------


def flat_views(flat: torch.Tensor, shapes: Sequence[Sequence[int]], shaped: bool = False) -> List[torch.Tensor]:
    """Views of ``flat``, one per shape, at padded offsets: 1-D (as the step ops take them), or
    in the parameter's own shape (as torch's ``.grad`` and optimizers see them)."""
    numels = [math.prod(s) for s in shapes]
    offsets, total = padded_offsets(numels)
    if flat.numel() < total:
        raise ValueError(f"flat buffer has {flat.numel()} elements, the layout needs {total}")
    views = [flat[o : o + n] for o, n in zip(offsets, numels)]
    return [v.view(tuple(s)) for v, s in zip(views, shapes)] if shaped else views


def random_tensor(shape, dtype, device, generator: Optional[torch.Generator] = None, positive=False):
    """Fresh random values (never zeros). ``positive`` gives uniform (0, 1], for Adam's v."""
    if positive:
        t = torch.rand(shape, dtype=torch.float32, device=device, generator=generator)
        return t.add_(1e-3).to(dtype)
    t = torch.randn(shape, dtype=torch.float32, device=device, generator=generator)
    return t.to(dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when anything is non-finite (NaN never passes)."""
    out64, ref64 = out.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


# ---------------------------------------------------------------------------------------------
# Cache size and rotation
# ---------------------------------------------------------------------------------------------


def last_level_cache_bytes(device: torch.device) -> int:
    """L2 of the GPU, or the largest CPU cache Linux reports; 32 MiB when unknown."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or 50 * 2**20
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best or 32 * 2**20


def rotation_count(set_bytes: int, cache_bytes: int, max_sets: int = 256) -> int:
    """How many independent argument sets to rotate through so that together they span at
    least 4x the cache. Twice was not enough here: with 8 MB sets cycling through 64 MB (2x the
    32 MB L3) a 1M-element fp32 add still ran at 3.6x the copy bandwidth, since replacement
    policies that resist cyclic thrashing keep part of the cycle resident."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    return max(1, min(max_sets, math.ceil(4 * cache_bytes / set_bytes)))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class TimingConfig:
    samples: int = 10  # timed samples; the median is reported
    warmup_ms: float = 25.0  # at least this long (and 3 calls) of untimed calls first
    min_sample_ms: float = 10.0  # each sample repeats the call to last at least this long
    max_calls_per_sample: int = 10_000


@dataclass
class Timing:
    samples_ms: List[float]  # per-call time of each sample
    calls_per_sample: int
    rotations: int

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def spread_pct(self) -> float:
        """(max - min) / median: how far apart repeats of the same thing landed."""
        return 100.0 * (self.max_ms - self.min_ms) / self.median_ms


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(fn, arg_sets, first: int, calls: int, device: torch.device) -> float:
    """Milliseconds for ``calls`` back-to-back calls, rotating through ``arg_sets``."""
    n = len(arg_sets)
    synchronize(device)  # earlier queued work must not land inside this sample
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(first, first + calls):
            fn(arg_sets[i % n])
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for i in range(first, first + calls):
        fn(arg_sets[i % n])
    return (time.perf_counter() - t0) * 1e3


def measure(
    fn: Callable[[Any], None], arg_sets: Sequence[Any], device: torch.device, config: Optional[TimingConfig] = None
) -> Timing:
    """Time ``fn(arg_sets[i])`` for i rotating through the sets; per-call milliseconds.

    Warm-up doubles the number of calls until ``warmup_ms`` and 3 calls have passed (this also
    absorbs compilation and lazy state creation), and the last warm-up batch sizes each sample.
    """
    if not arg_sets:
        raise ValueError("arg_sets must hold at least one argument set")
    device = torch.device(device)
    config = config or TimingConfig()
    cursor, calls, warm_ms, warm_calls = 0, 1, 0.0, 0
    while True:
        ms = _time_calls(fn, arg_sets, cursor, calls, device)
        cursor, warm_ms, warm_calls = cursor + calls, warm_ms + ms, warm_calls + calls
        if warm_calls >= 3 and warm_ms >= config.warmup_ms:
            break
        calls *= 2
    per_call = max(ms / calls, 1e-6)
    per_sample = max(1, min(config.max_calls_per_sample, math.ceil(config.min_sample_ms / per_call)))
    samples = []
    for _ in range(config.samples):
        samples.append(_time_calls(fn, arg_sets, cursor, per_sample, device) / per_sample)
        cursor += per_sample
    return Timing(samples_ms=samples, calls_per_sample=per_sample, rotations=len(arg_sets))


def measure_interleaved(
    fns: Dict[str, Callable[[], None]], config: Optional[TimingConfig] = None, seed: int = 0
) -> Dict[str, Timing]:
    """Time several zero-argument CPU calls against each other: per round, each one sample, in a
    fresh random order. Load that comes and goes (a shared machine) then lands on every provider
    alike, where timing them one after another lets it fall on one. Each fn is warmed up as
    :func:`measure` does and its sample length sized from that."""
    config = config or TimingConfig()
    rng = random.Random(seed)
    per_sample: Dict[str, int] = {}
    for name, fn in fns.items():
        calls, warm_ms, warm_calls = 1, 0.0, 0
        while True:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            ms = (time.perf_counter() - t0) * 1e3
            warm_ms, warm_calls = warm_ms + ms, warm_calls + calls
            if warm_calls >= 3 and warm_ms >= config.warmup_ms:
                break
            calls *= 2
        per_call = max(ms / calls, 1e-6)
        per_sample[name] = max(1, min(config.max_calls_per_sample, math.ceil(config.min_sample_ms / per_call)))
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    order = list(fns)
    for _ in range(config.samples):
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            for _ in range(per_sample[name]):
                fns[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3 / per_sample[name])
    return {name: Timing(samples_ms=samples[name], calls_per_sample=per_sample[name], rotations=1) for name in fns}


# ---------------------------------------------------------------------------------------------
# The copy ceiling
# ---------------------------------------------------------------------------------------------


def copy_ceiling(device: torch.device, nbytes: int, config: Optional[TimingConfig] = None) -> Dict[str, float]:
    """Bandwidth of ``dst.copy_(src)`` on fp32 buffers of ``nbytes``, counting bytes read plus
    bytes written (so a copy moves 2 * nbytes), the way the byte model counts.

    This is the practical ceiling of the machine: an H200 copies at about 4.3 TB/s against the
    datasheet's 4.8. Give buffers several times the last-level cache, so that one pair is
    enough and no rotation is needed (run.py uses 1 GiB on a GPU, 4-8x the L3 on a CPU).
    """
    device = torch.device(device)
    n = int(nbytes) // FP32_BYTES
    src = random_tensor((n,), torch.float32, device)
    dst = torch.empty_like(src)
    timing = measure(lambda pair: pair[1].copy_(pair[0]), [(src, dst)], device, config)
    moved = 2 * n * FP32_BYTES
    return {
        "bytes_moved": moved,
        "ms": timing.median_ms,
        "gbps": gbps(moved, timing.median_ms),
        "spread_pct": timing.spread_pct,
    }


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> Dict[str, Any]:
    """The commit benchmarked. FUSED_ACCUM_GIT_COMMIT overrides it, for copies of the tree that
    travel without .git (the lent GPU machine). ``dirty`` says whether the tree differed from
    the commit, untracked files included (a new backend file changes what is measured), except
    the results folder this suite writes into."""
    override = os.environ.get("FUSED_ACCUM_GIT_COMMIT")
    if override:
        return {"commit": override, "dirty": None}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=all")
    if status is None:
        return {"commit": commit or "unknown", "dirty": None}
    changed = [line[3:] for line in status.splitlines() if not line[3:].startswith("benchmarks/results/")]
    return {"commit": commit or "unknown", "dirty": bool(changed)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def backend_availability(device_type: str) -> Dict[str, str]:
    """Each fused_accum backend: "" when it runs on this device type, else why not."""
    from fused_accum import backends

    return {name: backends.availability(name, device_type) for name in backends.NAMES}


def metadata(device: torch.device, argv: Sequence[str] = ()) -> Dict[str, Any]:
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except Exception as err:  # not installed, or broken: record why rather than fail the run
        triton_version = f"unavailable ({type(err).__name__})"
    meta: Dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "device_type": device.type,
        "last_level_cache_bytes": last_level_cache_bytes(device),
        **{f"git_{k}": v for k, v in git_commit().items()},
        "backends": backend_availability(device.type),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(
            device_name=props.name,
            sm_count=props.multi_processor_count,
            device_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
        )
    else:
        meta["device_name"] = meta["cpu"]
    return meta


# ---------------------------------------------------------------------------------------------
# Writing results
# ---------------------------------------------------------------------------------------------


def _columns(rows: Iterable[Dict[str, Any]]) -> List[str]:
    """Union of the rows' keys, in first-seen order."""
    columns: Dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def _stamp(meta: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "git_commit": meta.get("git_commit"),
        "device_name": meta.get("device_name"),
        "torch": meta.get("torch"),
        "date_utc": meta.get("date_utc"),
    }


def _replace_atomically(path: Path, write: Callable[[Any], None], newline: Optional[str] = None) -> None:
    """Write to a temporary file beside ``path``, then rename: a run killed mid-write (a stage
    of benchmarks/device_check.sh at its time limit) leaves the previous complete file, never
    half of one."""
    tmp = Path(str(path) + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)  # (--out names a folder that may not exist yet)
    with open(tmp, "w", newline=newline) as f:
        write(f)
    os.replace(tmp, path)


def write_csv(path: Path, rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> None:
    """CSV of ``rows``, each row stamped with the commit, device and date so a CSV alone says
    where its numbers came from. Rewritten whole (atomically): callers rewrite it as rows come."""
    stamp = _stamp(meta)

    def write(f):
        writer = csv.DictWriter(f, fieldnames=_columns(rows) + list(stamp))
        writer.writeheader()
        writer.writerows({**row, **stamp} for row in rows)

    _replace_atomically(Path(path), write, newline="")


class CsvAppender:
    """A CSV written one row at a time, flushed after each, so a benchmark stopped at its time
    limit leaves the header and every row measured so far. The columns are the first row's
    (plus the ``meta`` stamp of :func:`write_csv`); a later row with other keys is a bug and
    raises. Nothing is written until the first row: no rows, no file."""

    def __init__(self, path: Path, meta: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        self.stamp = _stamp(meta) if meta is not None else {}
        self._file = None
        self._writer = None

    def add(self, row: Dict[str, Any]) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=list(row) + list(self.stamp))
            self._writer.writeheader()
        self._writer.writerow({**row, **self.stamp})
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf/nan; null says "not measured / not applicable"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, payload: Dict[str, Any]) -> None:
    def write(f):
        json.dump(_json_safe(payload), f, indent=1, allow_nan=False)
        f.write("\n")

    _replace_atomically(Path(path), write)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save_figure(plt, fig, path: Path) -> None:
    tmp = Path(str(path) + ".tmp")  # write then rename: a reader never sees half a PNG
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, path)


# A flat-size sweep with at least this many sizes is drawn as lines against the size; anything
# with fewer (the step ops time one flat size, and the lists are one size each) as bars per
# workload: one point per line on a log axis says nothing and its labels overlap.
MIN_SIZES_FOR_LINES = 3


def kernel_panels(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The panels of kernels.png, in order: per (op, grad dtype) a ``lines`` panel of the flat
    sweep when it has :data:`MIN_SIZES_FOR_LINES` sizes or more, and a ``bars`` panel of every
    other workload (each list, and the flat sizes when too few for lines), a group of bars per
    workload, one bar per provider. Each panel: kind, op, grad_dtype, title, rows."""
    panels = []
    ops = list(dict.fromkeys(r["op"] for r in rows))  # the order the suite ran them in
    for op in ops:
        for dt in sorted({r["grad_dtype"] for r in rows if r["op"] == op}):
            mine = [r for r in rows if r["op"] == op and r["grad_dtype"] == dt]
            what = f"{op}, {dt} grads" if dt != "-" else f"{op} (from the fp32 accumulator)"
            flat = [r for r in mine if r["workload"] == "flat"]
            lines = flat if len({r["numel"] for r in flat}) >= MIN_SIZES_FOR_LINES else []
            if lines:
                panels.append(dict(kind="lines", op=op, grad_dtype=dt, title=f"{what}: one flat tensor", rows=lines))
            bars = [r for r in mine if not lines or r["workload"] != "flat"]
            if bars:
                title = f"{what}: per workload" if lines else what
                panels.append(dict(kind="bars", op=op, grad_dtype=dt, title=title, rows=bars))
    return panels


def workload_label(row: Dict[str, Any]) -> str:
    """A bar group's label: the workload, its size and (for lists) its tensor count."""
    size = fmt_numel(int(row["numel"]))
    if row["workload"] == "flat":
        return f"flat {size}"
    return f"{row['workload']}\n{size}\n{row['n_tensors']} tensors"


def _bar_groups(
    ax,
    groups: List[str],
    series: Dict[str, Dict[str, float]],
    colors: Dict[str, str],
    fmt: str,
    whiskers: Optional[Dict[str, Dict[str, tuple]]] = None,
) -> None:
    """Grouped bars: one group per label in ``groups``, one bar per series (provider) that has a
    value there, each labelled with its value in ``fmt`` above the bar (and above its whisker:
    ``whiskers[series][group] = (low, high)``, drawn as a black line). Labels are upright when a
    group has at most 3 bars, else turned to read upwards, so that they never overlap."""
    names = list(series)
    width = 0.8 / max(1, len(names))
    rotation = 0 if len(names) <= 3 else 90
    top = max((v for s in series.values() for v in s.values()), default=1.0)
    for i, name in enumerate(names):
        for g, label in enumerate(groups):
            if label not in series[name]:
                continue
            x, y = g + (i - (len(names) - 1) / 2) * width, series[name][label]
            ax.bar([x], [y], width=width * 0.95, color=colors[name])
            label_y = y
            lo_hi = (whiskers or {}).get(name, {}).get(label)
            if lo_hi is not None:
                ax.plot([x, x], list(lo_hi), color="black", linewidth=0.8)
                label_y = max(y, lo_hi[1])
                top = max(top, lo_hi[1])
            ax.text(x, label_y + 0.01 * top, fmt.format(y), ha="center", va="bottom", fontsize=6, rotation=rotation)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=6.5 if len(groups) > 3 else 7)
    ax.set_ylim(0, top * 1.18)  # room above the tallest bar for its label


def plot_gbps(path: Path, rows: List[Dict[str, Any]], copy_gbps: float, title: str) -> bool:
    """kernels.png: GB/s of every provider, the copy ceiling as a dashed line, panels as
    :func:`kernel_panels` lays them out (lines against size for a flat sweep, grouped bars per
    workload otherwise), one legend for the figure (a provider has one colour everywhere).
    Returns False (and writes nothing) without matplotlib or rows."""
    rows = [r for r in rows if math.isfinite(r["gbps"])]
    plt = _pyplot() if rows else None
    if plt is None:
        return False
    panels = kernel_panels(rows)
    providers = sorted({r["provider"] for r in rows})
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel_rows = panel["rows"]
        if panel["kind"] == "lines":
            for provider in sorted({r["provider"] for r in panel_rows}):
                pts = sorted((r["numel"], r["gbps"]) for r in panel_rows if r["provider"] == provider)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[provider])
            ax.set_xscale("log")
            ax.set_xlabel("elements", fontsize=8)
        else:
            order = sorted({(r["workload"] != "flat", int(r["numel"]), workload_label(r)) for r in panel_rows})
            groups = [label for _, _, label in order]
            series: Dict[str, Dict[str, float]] = {}
            for provider in sorted({r["provider"] for r in panel_rows}):
                series[provider] = {workload_label(r): r["gbps"] for r in panel_rows if r["provider"] == provider}
            _bar_groups(ax, groups, series, colors, "{:.0f}")
        ax.axhline(copy_gbps, color="grey", linestyle="--")
        ax.set_title(panel["title"], fontsize=9)
        ax.set_ylabel("GB/s (byte model)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in providers]
    handles.append(plt.Line2D([0], [0], color="grey", linestyle="--"))
    fig.legend(handles, providers + [f"copy ({copy_gbps:.0f} GB/s)"], loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    _save_figure(plt, fig, path)
    return True


def plot_window(path: Path, rows: List[Dict[str, Any]], title: str) -> bool:
    """window.png: per model, the ratio native / provider of the median window (> 1: faster
    than torch's own accumulation), a group of bars per (param dtype, threads), one bar per
    provider other than native, whiskers from native's median over the provider's quartiles;
    1.0 (native) as a dashed line. Returns False (and writes nothing) without matplotlib or rows."""
    rows = [r for r in rows if math.isfinite(r.get("speedup_vs_native", math.nan))]
    plt = _pyplot() if rows else None
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    providers = [p for p in dict.fromkeys(r["provider"] for r in rows) if p != "native"]
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    cell = lambda r: f"{r['dtype']}, {r['threads']} thread" + ("s" if int(r["threads"]) > 1 else "")  # noqa: E731
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model]
        groups = list(dict.fromkeys(cell(r) for r in mine))
        native = {cell(r): r["window_ms"] for r in mine if r["provider"] == "native"}
        by = {(r["provider"], cell(r)): r for r in mine if r["provider"] != "native"}
        series = {p: {g: by[p, g]["speedup_vs_native"] for g in groups if (p, g) in by} for p in providers}
        series = {p: s for p, s in series.items() if s}
        whiskers = {
            p: {g: (native[g] / by[p, g]["ms_q3"], native[g] / by[p, g]["ms_q1"]) for g in s if g in native}
            for p, s in series.items()
        }
        _bar_groups(ax, groups, series, colors, "{:.2f}x", whiskers)
        ax.axhline(1.0, color="grey", linestyle="--")
        first = mine[0]
        ax.set_title(
            f"{model}: {first['n_tensors']} tensors, {fmt_numel(int(first['numel']))} params, "
            f"k = {first['accum_steps']} micro-batches",
            fontsize=9,
        )
        ax.set_ylabel("native / provider, median window (> 1: faster)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in providers]
    handles.append(plt.Line2D([0], [0], color="grey", linestyle="--"))
    labels = providers + ["native (torch .grad + AdamW(fused=True)) = 1"]
    fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    _save_figure(plt, fig, path)
    return True


def fmt_numel(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


@contextlib.contextmanager
def stop_on_sigint() -> Iterator[None]:
    """Ctrl-C (SIGINT, as ``timeout -s INT`` sends at a stage's limit) raises KeyboardInterrupt
    inside the block, whatever the process inherited, and the handler before it is put back
    after. A process started in the background by a non-interactive shell inherits SIGINT
    *ignored*, and Python then installs no handler of its own: without this, such a benchmark
    never hears the signal, runs on to the end and is killed without writing what it measured.
    Only the main thread may set a handler: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.SIG_DFL)


def log(msg: str) -> None:
    """Print without breaking a progress bar (tqdm.write when tqdm is there)."""
    try:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stdout)
    except ImportError:
        print(msg, flush=True)
