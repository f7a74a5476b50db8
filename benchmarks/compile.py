"""Compiled windows: the time of one training window under each way of compiling it, fused_accum
against torch.optim's best, paired and interleaved (``python -m fused_accum bench compile``).

A window is k micro-batches (forward, backward with the loss divided by k), the clipped AdamW
step and zero_grad, on a small GPT (benchmarks/end_to_end.TinyGPT: GPT-2's layout). Recipes:

  eager              the plain loop
  compile_model      ``torch.compile(model)``; backward, step and zero_grad eager
  compiled_autograd  ``torch.compile(model)``, each backward under compiled autograd
                     (``torch._dynamo.compiled_autograd._enable``)
  compiled_step      ``torch.compile(model)``, eager backwards, the step (and zero_grad; for
                     torch the clip too) one compiled function: ``fullgraph=True`` for
                     fused_accum; torch's fused step breaks the graph (it is compiler-disabled)
  one_graph          the whole window in one compiled function: for fused_accum the README's
                     recipe (``opt.backward(loss)`` k times, ``opt.step()``, ``opt.zero_grad()``,
                     ``fullgraph=True`` under ``trace_autograd_ops``); for torch the same
                     function with ``loss.backward()`` and its optimizer (its step breaks the graph:
                     ``fullgraph=False``)

Optimizers: ``fused_accum.AdamW(max_grad_norm=1.0)`` on the model's parameters (bf16 with fp32
masters, or fp32), and torch's best: ``torch.optim.AdamW(fused=True)`` (foreach where fused does
not run) after ``clip_grad_norm_(foreach=True)``, on fp32 parameters (bf16: under bf16 autocast;
torch's optimizers cannot step bf16 parameters whose ``.grad`` is fp32).

Each cell (recipe x optimizer) is built, compiled and checked first: its weights after
``--check`` windows against the eager cell of the same optimizer (``exact``: bit for bit;
``max_diff``: the largest difference), and how many graphs Dynamo compiled for it, how many graph
breaks it reported, how many compiled graphs run per window (a compiled forward's AOT backward
counts with its forward: compile_model runs k per window) and, on CUDA, how many CUDA graphs
replay per window (``torch.cuda.CUDAGraph.replay`` counted; ``--mode reduce-overhead``). Then ``--rounds`` rounds, each
running one window of every cell in an order rotated by one per round, so load that comes and
goes falls on all of them; per cell the median window time, and against fused_accum's eager
window the median of the per-round ratios (> 1: faster). A recipe that cannot run (compiled
autograd before fused_accum supports it) is a row with its error. The last lines print the
machine's load average before and after.

Usage: python -m fused_accum bench compile [--dtype bf16|fp32] [--k 4] [--rounds 20] [--d 64]
         [--layers 4] [--micro-batch 2[,4...]] [--seq 64] [--backend inductor] [--mode MODE]
         [--device cpu] [--recipes eager,compile_model,...] [--time-budget S] [--smoke] [--csv PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks import common, end_to_end  # noqa: E402

RECIPES = ("eager", "compile_model", "compiled_autograd", "compiled_step", "one_graph")
OPTIMIZERS = ("fused_accum", "torch")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Counting:
    """A Dynamo backend over ``inner`` that counts the calls of the graphs it compiles (a
    compiled forward's AOT backward runs inside that call's autograd node: counted with it)."""

    def __init__(self, inner: str, mode: Optional[str]) -> None:
        self.inner, self.mode = inner, mode
        self.calls = 0

    def __call__(self, gm, example_inputs):
        if self.inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs, config_patches=list_mode_options(self.mode) if self.mode else None)
        else:
            fn = torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def counted(*args):
            self.calls += 1
            return fn(*args)

        counted._boxed_call = getattr(fn, "_boxed_call", False)  # (aot's calling convention: passed on)
        return counted


class Cell:
    """One recipe with one optimizer: its model, its window, and what Dynamo made of it."""

    def __init__(self, recipe: str, optimizer: str, args, batches) -> None:
        self.recipe, self.optimizer, self.batches = recipe, optimizer, batches
        self.counting = Counting(args.backend, args.mode)
        self.breaks = 0
        self.error: Optional[str] = None
        torch.manual_seed(0)
        model = end_to_end.TinyGPT(gpt_config(args)).to(args.device)
        self.k = args.k
        bf16 = args.dtype == "bf16"
        if optimizer == "fused_accum":
            import fused_accum

            self.model = model.to(DTYPES[args.dtype])
            self.opt = fused_accum.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
            self.autocast = contextlib.nullcontext
        else:
            self.model = model
            flag = end_to_end.best_adamw_flag(torch.device(args.device))
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01, **{flag: True})
            device_type = torch.device(args.device).type
            self.autocast = (
                (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
            )
        self.run = self._build(args)

    def _step(self) -> None:
        if self.optimizer == "torch":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad()

    def _build(self, args) -> Callable[[list], None]:
        model, k = self.model, self.k
        ours = self.optimizer == "fused_accum"
        if self.recipe in ("compile_model", "compiled_autograd", "compiled_step"):
            model = torch.compile(model, backend=self.counting)
        step = self._step
        if self.recipe == "compiled_step":
            step = torch.compile(self._step, backend=self.counting, fullgraph=ours)

        def backward(loss):
            if self.recipe == "compiled_autograd":
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend=self.counting)):
                    loss.backward()
            elif ours:
                self.opt.backward(loss)
            else:
                loss.backward()

        def window(chunk):
            for idx, targets in chunk:
                with self.autocast():
                    loss = model(idx, targets) / k
                backward(loss)
            step()

        if self.recipe == "one_graph":
            return torch.compile(window, backend=self.counting, fullgraph=ours)
        return window

    def weights(self) -> List[torch.Tensor]:
        return [p.detach().float().clone() for p in self.model.parameters()]


def _dynamo_counts() -> tuple:
    """(graphs compiled, graph breaks) Dynamo counted so far (a trace restarted is one graph)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def gpt_config(args) -> end_to_end.E2EConfig:
    """The model and its data, as the command line sizes them (``--check`` windows of data)."""
    return end_to_end.E2EConfig(
        vocab=args.vocab,
        d_model=args.d,
        n_layers=args.layers,
        n_heads=args.heads,
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        accum_steps=args.k,
        windows=args.check,
    )


def prepare(args) -> List[Cell]:
    """Every cell built, compiled and checked (``--check`` windows, from the same weights)."""
    batches = end_to_end.make_batches(gpt_config(args), torch.device(args.device))
    cells = []
    for optimizer in OPTIMIZERS:
        for recipe in args.recipes:
            before = _dynamo_counts()
            cell = Cell(recipe, optimizer, args, batches[0])
            try:
                with torch._dynamo.config.patch(trace_autograd_ops=recipe == "one_graph"):
                    for chunk in batches:
                        cell.run(chunk)
                common.synchronize(torch.device(args.device))
            except Exception as error:  # noqa: BLE001 (a recipe that cannot run is a row saying why)
                if _interrupted(error):
                    raise KeyboardInterrupt from error
                cell.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            after = _dynamo_counts()
            cell.compiled, cell.breaks = after[0] - before[0], after[1] - before[1]
            cell.checked = cell.weights()
            cell.calls_checked = cell.counting.calls
            cells.append(cell)
    for cell in cells:
        reference = next(c for c in cells if c.optimizer == cell.optimizer and c.recipe == "eager")
        diffs = [(p - q).abs().max().item() for p, q in zip(cell.checked, reference.checked)]
        cell.max_diff = max(diffs) if diffs else 0.0
        cell.exact = all(d == 0 for d in diffs)
    return cells


@contextlib.contextmanager
def counting_replays(device: torch.device):
    """On CUDA, every ``torch.cuda.CUDAGraph.replay`` counted (the list's length)."""
    replays: List[int] = []
    if device.type != "cuda":
        yield replays
        return
    real = torch.cuda.CUDAGraph.replay

    def replay(self):
        replays.append(1)
        return real(self)

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield replays
    finally:
        torch.cuda.CUDAGraph.replay = real


def measure(cells: List[Cell], args) -> Dict[str, List[float]]:
    """Seconds per window of every runnable cell, rounds rotated (and each cell's CUDA graph
    replays, in ``cell.replays``)."""
    runnable = [c for c in cells if c.error is None]
    times: Dict[str, List[float]] = {id(c): [] for c in runnable}
    device = torch.device(args.device)
    for cell in runnable:
        cell.replays = 0
    with counting_replays(device) as replays:
        for r in range(args.warmup + args.rounds):
            order = runnable[r % len(runnable) :] + runnable[: r % len(runnable)]
            for cell in order:
                with torch._dynamo.config.patch(trace_autograd_ops=cell.recipe == "one_graph"):
                    common.synchronize(device)
                    before = len(replays)
                    start = time.perf_counter()
                    cell.run(cell.batches)
                    common.synchronize(device)
                if r >= args.warmup:
                    times[id(cell)].append(time.perf_counter() - start)
                    cell.replays += len(replays) - before
    return times


def report(cells: List[Cell], times: Dict, args) -> List[Dict]:
    base = next(c for c in cells if c.optimizer == "fused_accum" and c.recipe == "eager")
    windows = args.warmup + args.rounds
    rows = []
    for cell in cells:
        row = dict(
            recipe=cell.recipe,
            optimizer=cell.optimizer,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            backend=args.backend + (f" ({args.mode})" if args.mode else ""),
            graphs_compiled=cell.compiled,
            breaks=cell.breaks,
            error=cell.error or "",
        )
        if cell.error is None:
            ts = times[id(cell)]
            row.update(
                graphs_per_window=(cell.counting.calls - cell.calls_checked) / windows,
                cuda_graph_replays_per_window=cell.replays / args.rounds,
                ms=statistics.median(ts) * 1e3,
                vs_ours_eager=statistics.median(b / t for b, t in zip(times[id(base)], ts)),
                exact=cell.exact,
                max_diff=cell.max_diff,
            )
        rows.append(row)
    return rows


def print_table(rows: List[Dict], args, loads) -> None:
    print(
        f"# {args.dtype}, GPT d={args.d} layers={args.layers} seq={args.seq} micro-batch={args.micro_batch}, "
        f"k={args.k}, {args.backend}{' ' + args.mode if args.mode else ''}, {args.device}, "
        f"{torch.get_num_threads()} thread(s), median of {args.rounds} rounds"
    )
    print(
        f"{'recipe':18s}{'optimizer':12s}{'ms':>9s}{'x ours eager':>14s}{'graphs/window':>15s}"
        f"{'replays/window':>16s}{'compiled':>10s}{'breaks':>8s}  vs its eager"
    )
    for row in rows:
        head = f"{row['recipe']:18s}{row['optimizer']:12s}"
        if row["error"]:
            print(head + f"  cannot run: {row['error']}")
            continue
        same = "bit for bit" if row["exact"] else f"max |diff| {row['max_diff']:.2e}"
        print(
            head + f"{row['ms']:9.2f}{row['vs_ours_eager']:14.2f}{row['graphs_per_window']:15.1f}"
            f"{row['cuda_graph_replays_per_window']:16.1f}{row['graphs_compiled']:10d}{row['breaks']:8d}  {same}"
        )
    print(f"load average before {loads[0]}, after {loads[1]}")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per window")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds after the check")
    parser.add_argument("--check", type=int, default=3, help="windows each cell trains before timing")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", default="2", help="sequences per micro-batch; a list (1,2,4): a table each")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: start no micro-batch size after it")
    parser.add_argument("--backend", default="inductor", help="inductor, aot_eager, ...")
    parser.add_argument("--mode", default=None, help="inductor's mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager: the plumbing in seconds")
    parser.add_argument("--csv", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    args.micro_batches = [int(m) for m in str(args.micro_batch).split(",") if m.strip()]
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; the recipes are {', '.join(RECIPES)}")
    if "eager" not in args.recipes:
        args.recipes.insert(0, "eager")  # (the reference of every check and ratio)
    if args.smoke:
        args.d, args.layers, args.heads, args.seq, args.vocab, args.k = 16, 1, 2, 8, 32, 2
        args.micro_batches = args.micro_batches[:2]
        args.rounds, args.warmup, args.check = 2, 1, 2
        args.backend = "aot_eager"
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    try:
        with common.stop_on_sigint():  # (a stage's SIGINT at its limit: the sizes measured are written)
            run(args)
    except KeyboardInterrupt:
        print("# interrupted: the sizes above are all that was measured")
        return 130
    return 0


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` is, or wraps, a KeyboardInterrupt (Dynamo wraps what a trace raises)."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__cause__ or error.__context__
    return False


def run(args) -> None:
    start, rows = time.monotonic(), []
    for micro_batch in args.micro_batches:
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            print(f"# micro-batch {micro_batch}: not started, the {args.time_budget:g} s budget is spent")
            continue
        args.micro_batch = micro_batch
        loads = [os.getloadavg()]
        cells = prepare(args)
        times = measure(cells, args)
        loads.append(os.getloadavg())
        size_rows = report(cells, times, args)
        print_table(size_rows, args, [", ".join(f"{x:.1f}" for x in load) for load in loads])
        rows += size_rows
        if args.csv:  # (rewritten after every size: a run stopped at its limit keeps what it measured)
            common.write_csv(Path(args.csv), rows, common.metadata(torch.device(args.device), sys.argv))
        torch._dynamo.reset()  # (the next size's cells compile their own graphs)


if __name__ == "__main__":
    sys.exit(main())
