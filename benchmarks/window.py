"""One training window end to end: k micro-batches (forward + backward), the optimizer step and
zero_grad, ours against torch's, interleaved per round, at 1 and 2 threads in one process.

Issue 11 asks whether the per-parameter work of our accumulation (the hooks autograd calls for
every gradient) makes a whole window slower than torch's own ``.grad`` accumulation. A kernel
benchmark cannot show it: the cost is on the autograd thread, around the kernels. So this
times what a user's loop does, on two models:

  params_2048x256  2,048 parameters of 256 elements; loss = sum_i (p_i * x).sum(), computed as
                   one ``(stack(params) * x).sum()``, so that a window is nearly all
                   per-parameter autograd work (stack's backward hands each leaf its gradient)
                   rather than 2,048 small Python-level forward ops.
  gpt2_d64         GPT-2's layout (148 tensors: tied embedding, positions, 12 pre-norm blocks,
                   final norm) at d = 64 with a small vocabulary and context, so a window takes
                   well under a second on a CPU and the per-parameter cost is visible.

each with fp32 and with bf16 parameters. Providers:

  native               torch: ``.grad`` accumulation by autograd (plain bf16 ``.grad`` for bf16
                       params) and ``torch.optim.AdamW(fused=True)`` on the params;
                       ``zero_grad()`` sets ``.grad`` to None. What issue 11 measured against.
  native_fp32acc       bf16 only: torch's like-for-like precision, ``p.grad_dtype =
                       torch.float32`` so autograd accumulates fp32 ``.grad``, fp32 master
                       copies stepped by ``AdamW(fused=True)``, copied back into the bf16
                       params (``end_to_end.fp32_master_adamw``). For fp32 params it would be
                       ``native`` again, so it is not run there.
  fused_accum          ``fused_accum.AdamW(params, accum_steps=k)``, step, zero_grad.
  fused_accum_pyhooks  the same, built with ``FUSED_ACCUM_PYTHON_HOOKS=1`` in the environment
                       (forces the per-parameter Python hooks where the C++ ones exist). The
                       ``hooks`` column says which kind each provider's parameters carry, so a
                       run where the knob changed nothing says so.

Before timing, every provider trains ``check_windows`` windows from the same weights on the
same data, and its parameter update and losses are compared with a reference (``native`` for
fp32, ``native_fp32acc`` for bf16): a provider that skips a micro-batch or the step cannot look
fast, it gets ``ok=False``. Then, at each thread count, ``warmup_windows`` untimed windows per
provider, and ``rounds`` rounds in which each provider runs one window, the order rotated by
one every round, so that load that comes and goes on a shared machine falls on all of them.
Each row reports the median window with min/max and the interquartile range, the ratio
native / this (> 1: faster than native; also the median of the per-round ratios, which cancels
slow drift), and the extra cost per parameter per micro-batch in microseconds.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn

from benchmarks import common, end_to_end

PROVIDERS = ("native", "native_fp32acc", "fused_accum", "fused_accum_pyhooks")
MODELS = ("params", "gpt2")  # labelled params_<count>x<numel> and gpt2_d<d> in the rows
PYTHON_HOOKS_ENV = "FUSED_ACCUM_PYTHON_HOOKS"

# The check compares each provider's parameter update over the check windows with the
# reference's: ||dp - dp_ref|| / ||dp_ref||, dp = params after - params before. Measured at
# lr 1e-2 (2,048 x 256 and gpt2_d64, 3 windows): fp32 params, the same math in another order,
# <= 4e-5; bf16 params with fp32 accumulation and masters, the same masters rounded to bf16
# with the odd element rounding the other way, <= 1.2e-2; plain bf16 .grad and bf16 AdamW state
# (native bf16, a different training), <= 3.3e-2. A broken provider lands far above: one
# micro-batch of 8 dropped, ~0.6; one step of three skipped, ~0.3 (of two, ~0.5).
UPDATE_TOL = {"fp32": 1e-4, "bf16": 5e-2, "bf16_native": 0.15}
# The mean loss of the last check window, relative to the reference's: a consistency report
# more than a detector (a dropped micro-batch moves gpt2_d64's loss by only ~5e-3).
LOSS_TOL = {"fp32": 1e-4, "bf16": 1e-3, "bf16_native": 2e-2}


@dataclass(frozen=True)
class WindowConfig:
    accum_steps: int = 8  # micro-batches per window
    models: Tuple[str, ...] = MODELS
    dtypes: Tuple[str, ...] = ("fp32", "bf16")
    threads: Tuple[int, ...] = (1, 2)
    rounds: int = 10  # timed windows per provider per thread count
    warmup_windows: int = 1  # untimed, per provider per thread count (the check warmed up first)
    check_windows: int = 2  # trained from the same start before timing, and compared
    # params_2048x256
    param_count: int = 2048
    param_numel: int = 256
    # gpt2_d64 (12 blocks of 12 tensors + 2 embeddings + ln_f = 148 tensors)
    gpt_layers: int = 12
    gpt_d: int = 64
    gpt_heads: int = 4
    gpt_vocab: int = 256
    gpt_seq: int = 16
    gpt_micro_batch: int = 2
    # 1e-2, not 1e-3: a step well above a bf16 ulp at these weights, so that the check's
    # rounding noise stays small beside the update it compares
    lr: float = 1e-2
    weight_decay: float = 1e-2
    seed: int = 0


class ManyParams(nn.Module):
    """``count`` parameters of ``numel`` elements, drawn at GPT's init scale (std 0.02, where a
    bf16 ulp is below an AdamW step of 1e-3, so bf16 updates are not all rounded away)."""

    def __init__(self, count: int, numel: int):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(0.02 * torch.randn(numel)) for _ in range(count))

    def forward(self, x):
        # = sum over params of (p * x).sum(), in three ops instead of 3 * count
        return (torch.stack(tuple(self.params)) * x).sum()


def model_label(kind: str, cfg: WindowConfig) -> str:
    if kind == "params":
        return f"params_{cfg.param_count}x{cfg.param_numel}"
    if kind == "gpt2":
        return f"gpt2_d{cfg.gpt_d}" + (f"_l{cfg.gpt_layers}" if cfg.gpt_layers != 12 else "")
    raise ValueError(f"model must be one of {MODELS}, got {kind!r}")


def _model_and_batches(name: str, dtype: torch.dtype, cfg: WindowConfig, device: torch.device):
    """A freshly initialised model (the same weights every call) and the window's k
    micro-batches, as argument tuples for ``model(*mb)``."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    k = cfg.accum_steps
    if name == "params":
        model = ManyParams(cfg.param_count, cfg.param_numel)
        batches = [(torch.randn(cfg.param_numel, generator=gen).to(device, dtype),) for _ in range(k)]
    elif name == "gpt2":
        gpt = end_to_end.E2EConfig(
            vocab=cfg.gpt_vocab,
            d_model=cfg.gpt_d,
            n_layers=cfg.gpt_layers,
            n_heads=cfg.gpt_heads,
            seq_len=cfg.gpt_seq,
            micro_batch=cfg.gpt_micro_batch,
        )
        model = end_to_end.TinyGPT(gpt)
        shape = (cfg.gpt_micro_batch, cfg.gpt_seq)
        batches = [
            tuple(torch.randint(cfg.gpt_vocab, shape, generator=gen).to(device) for _ in range(2)) for _ in range(k)
        ]
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return model.to(device=device, dtype=dtype), batches


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _hook_kind(params: Sequence[torch.Tensor]) -> str:
    """Which hooks take the params' gradients: 'c++' or 'python' (a fused_accum optimizer's,
    fused_accum.arrivals), or 'none' (torch's own accumulation)."""
    from fused_accum import arrivals, owners

    owner = owners.owner(params[0]) if params else None
    if owner is None:
        return "none"
    return "python" if isinstance(owner._arrivals, arrivals.PythonArrivals) else "c++"


def _make_step(
    provider: str, params: List[torch.Tensor], cfg: WindowConfig, device: torch.device
) -> Tuple[Callable[[], None], str]:
    """The end of a window for ``provider`` (optimizer step + zero_grad); and a note on how."""
    hp = dict(lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay)
    if provider in ("fused_accum", "fused_accum_pyhooks"):
        import fused_accum

        # The knob is read when the optimizer is built: set it for the constructor only.
        knob = _env(PYTHON_HOOKS_ENV, "1") if provider == "fused_accum_pyhooks" else contextlib.nullcontext()
        with knob:
            opt = fused_accum.AdamW(params, accum_steps=cfg.accum_steps, **hp)
        note = f"fused_accum.AdamW(accum_steps={cfg.accum_steps})"
        if provider == "fused_accum_pyhooks":
            note += f" with {PYTHON_HOOKS_ENV}=1"
    elif provider == "native":
        flag = end_to_end.best_adamw_flag(device)
        opt = torch.optim.AdamW(params, **hp, **{flag: True})
        note = f".grad in the param dtype; AdamW({flag}=True)"
    elif provider == "native_fp32acc":
        return end_to_end.fp32_master_adamw(params, hp, end_to_end.best_adamw_flag(device))
    else:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")

    def step():
        opt.step()
        opt.zero_grad()  # torch's default set_to_none=True; ours ends the window

    return step, note


def _window(model: nn.Module, step: Callable[[], None], batches, losses: List[float] = None) -> None:
    """One window: k forward + backward passes with the loss divided by k, then the step."""
    k = len(batches)
    for mb in batches:
        loss = model(*mb)
        (loss / k).backward()
        if losses is not None:
            losses.append(loss.detach().float().item())
    step()


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def providers_for(dtype: str) -> Tuple[str, ...]:
    return PROVIDERS if dtype == "bf16" else tuple(p for p in PROVIDERS if p != "native_fp32acc")


def _tolerance_key(dtype: str, provider: str) -> str:
    return "bf16_native" if dtype == "bf16" and provider == "native" else dtype


@dataclass
class Cell:
    """One (model, param dtype): a model per provider from the same weights, its window's end,
    the check's outcome, and the columns every row of the cell shares."""

    base: Dict
    providers: Tuple[str, ...]
    models: Dict[str, nn.Module]
    steps: Dict[str, Callable[[], None]]
    notes: Dict[str, str]
    checks: Dict[str, Dict]
    batches: list


def prepare_cell(model_name: str, dtype: str, cfg: WindowConfig, device: torch.device) -> Cell:
    """Build every provider's model and optimizer and run the check (which also warms up the
    optimizer state and the allocator before any timing)."""
    providers = providers_for(dtype)
    reference = "native_fp32acc" if dtype == "bf16" else "native"
    models, steps, notes, batches = {}, {}, {}, None
    for provider in providers:
        models[provider], batches = _model_and_batches(model_name, common.DTYPES[dtype], cfg, device)
        steps[provider], notes[provider] = _make_step(provider, list(models[provider].parameters()), cfg, device)
    params0 = list(models[providers[0]].parameters())
    start = _flat(params0)
    base = {
        "section": "window",
        "model": model_label(model_name, cfg),
        "dtype": dtype,
        "n_tensors": len(params0),
        "numel": sum(p.numel() for p in params0),
        "accum_steps": cfg.accum_steps,
    }

    check_loss, update = {}, {}
    for provider in providers:
        for _ in range(cfg.check_windows):
            losses: List[float] = []
            _window(models[provider], steps[provider], batches, losses)
        check_loss[provider] = statistics.fmean(losses)  # the last window's mean loss
        update[provider] = _flat(models[provider].parameters()) - start
    ref_update, ref_loss = update[reference], check_loss[reference]
    checks = {}
    for provider in providers:
        err = float((update[provider] - ref_update).norm() / ref_update.norm().clamp_min(1e-30))
        loss_diff = abs(check_loss[provider] - ref_loss) / max(abs(ref_loss), 1e-12)
        key = _tolerance_key(dtype, provider)
        checks[provider] = dict(
            check_update_err=err,
            check_loss_rel_diff=loss_diff,
            check_loss=check_loss[provider],
            ok=bool(err <= UPDATE_TOL[key] and loss_diff <= LOSS_TOL[key]),
            hooks=_hook_kind(list(models[provider].parameters())),
        )
    return Cell(base, providers, models, steps, notes, checks, batches)


def time_cell(
    cell: Cell, threads: int, cfg: WindowConfig, device: torch.device, over_budget: Callable[[], bool] = lambda: False
) -> List[Dict]:
    """The cell's rows at ``threads`` torch threads (set by the caller)."""
    samples = _time_rounds(cell.providers, cell.models, cell.steps, cell.batches, cfg, device, over_budget)
    return _rows(cell.base, threads, cell.providers, samples, cell.checks, cell.notes, cfg)


MIN_ROUNDS = 3  # a time budget cuts a cell's rounds, but not below this many


def _time_rounds(
    providers, models, steps, batches, cfg: WindowConfig, device, over_budget: Callable[[], bool] = lambda: False
) -> Dict[str, List[float]]:
    """Per provider, the milliseconds of each timed window. Round r runs the providers in the
    order rotated by r, so each one goes first, second, ... equally often. Past the time budget
    the rounds stop once MIN_ROUNDS were timed (the rows' ``rounds`` says how many)."""
    gc.collect()
    samples: Dict[str, List[float]] = {p: [] for p in providers}
    n = len(providers)
    for r in range(cfg.warmup_windows + cfg.rounds):
        order = providers[r % n :] + providers[: r % n]
        for provider in order:
            common.synchronize(device)
            t0 = time.perf_counter()
            _window(models[provider], steps[provider], batches)
            common.synchronize(device)
            if r >= cfg.warmup_windows:
                samples[provider].append((time.perf_counter() - t0) * 1e3)
        if r + 1 - cfg.warmup_windows >= MIN_ROUNDS and over_budget():
            break
    return samples


def _rows(
    base: Dict, threads: int, providers, samples: Dict[str, List[float]], checks, notes, cfg: WindowConfig
) -> List[Dict]:
    medians = {p: statistics.median(s) for p, s in samples.items()}
    rows = []
    for provider in providers:
        s = samples[provider]
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0],) * 3
        row = {
            **base,
            "provider": provider,
            "threads": threads,
            "window_ms": medians[provider],
            "ms_min": min(s),
            "ms_max": max(s),
            "ms_q1": q1,
            "ms_q3": q3,
            "iqr_pct": 100.0 * (q3 - q1) / medians[provider],
            "rounds": len(s),
        }
        for native in ("native", "native_fp32acc"):
            if native not in samples:
                continue
            # > 1: this provider is faster than that native. The per-round ratio compares
            # windows run back to back, so slow drift of the machine cancels in it.
            row[f"speedup_vs_{native}"] = medians[native] / medians[provider]
            row[f"speedup_vs_{native}_paired"] = statistics.median(
                a / b for a, b in zip(samples[native], samples[provider])
            )
        row["extra_us_per_param_mb"] = (
            (medians[provider] - medians["native"]) * 1e3 / (base["n_tensors"] * cfg.accum_steps)
        )
        row.update(checks[provider], note=notes[provider])
        rows.append(row)
    return rows


def _add_thread_scaling(rows: List[Dict]) -> None:
    """thread_scaling = the median of the same model, dtype and provider at the fewest threads
    measured / this row's median (> 1: more threads helped)."""
    key = lambda r: (r["model"], r["dtype"], r["provider"])
    fewest: Dict[tuple, Dict] = {}
    for r in rows:
        if key(r) not in fewest or r["threads"] < fewest[key(r)]["threads"]:
            fewest[key(r)] = r
    for r in rows:
        r["thread_scaling"] = fewest[key(r)]["window_ms"] / r["window_ms"]


def cells(cfg: WindowConfig) -> List[Tuple[str, str]]:
    return [(m, d) for m in cfg.models for d in cfg.dtypes]


def n_rows(cfg: WindowConfig) -> int:
    return sum(len(providers_for(d)) for _, d in cells(cfg)) * len(cfg.threads)


def run(
    cfg: WindowConfig,
    device: torch.device,
    progress: Callable[[Dict], None] = lambda r: None,
    over_budget: Callable[[], bool] = lambda: False,
    skipped: List[str] = None,
) -> List[Dict]:
    """Every (model, dtype) cell of ``cfg`` at every thread count, all cells at the fewest
    threads first: on a loaded machine the extra threads are what is slow (a parallel op waits
    for a descheduled thread), so a time budget cuts those rows, not the one-thread table. A
    (threads, cell) that would start over budget is skipped, its label added to ``skipped``;
    one running when the budget passes stops after MIN_ROUNDS rounds. A cell is built (models
    and checks, seconds each) only when its first timing starts, after the budget check: a
    budget already spent builds nothing."""
    threads_before = torch.get_num_threads()
    rows: List[Dict] = []
    prepared: Dict[Tuple[str, str], Cell] = {}
    try:
        for n in sorted(cfg.threads):
            for model_name, dtype in cells(cfg):
                if over_budget():
                    if skipped is not None:
                        skipped.append(f"window {model_label(model_name, cfg)} {dtype} {n} threads")
                    continue
                if (model_name, dtype) not in prepared:
                    torch.set_num_threads(min(cfg.threads))  # the checks run at the fewest threads
                    prepared[model_name, dtype] = prepare_cell(model_name, dtype, cfg, device)
                cell = prepared[model_name, dtype]
                torch.set_num_threads(n)
                for row in time_cell(cell, n, cfg, device, over_budget):
                    rows.append(row)
                    progress(row)
    finally:
        torch.set_num_threads(threads_before)
    _add_thread_scaling(rows)
    return rows


def format_row(r: Dict) -> str:
    vs = f"{r['speedup_vs_native']:5.2f}x native (paired {r['speedup_vs_native_paired']:.2f}x)"
    if "speedup_vs_native_fp32acc" in r:
        vs += f" {r['speedup_vs_native_fp32acc']:5.2f}x fp32acc"
    check = "ok" if r["ok"] else f"WRONG (update err {r['check_update_err']:.2g}, loss {r['check_loss_rel_diff']:.2g})"
    return (
        f"window {r['model']:<15} {r['dtype']:<4} {r['threads']}t {r['provider']:<19} "
        f"{r['window_ms']:8.1f} ms [{r['ms_q1']:.1f}..{r['ms_q3']:.1f}]  {vs}  "
        f"{r['extra_us_per_param_mb']:+6.2f} us/param/mb  hooks={r['hooks']}  {check}"
    )
