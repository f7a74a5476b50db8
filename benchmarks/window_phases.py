"""Where a window's time goes, backward by backward: torch against fused_accum.

The window suite (``python -m benchmarks.run --suite window``) times whole windows; this splits
one into its k backward passes and the step (+ ``zero_grad()``), so a difference between the
providers can be placed: the first backward (ours copies what torch steals), the middle ones
(ours folds in the hooks), the last (ours adds the norm pass), the step (ours is fused).
Same models, micro-batches and optimizers as the window suite; the two providers alternate
window by window in one process; medians over the rounds after two warm-up rounds.

Usage:  python benchmarks/window_phases.py [--model gpt2|params] [--dtype fp32|bf16]
                                           [--rounds 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import window  # noqa: E402

PROVIDERS = ("native", "fused_accum")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def phases(model_name: str, dtype: torch.dtype, rounds: int) -> dict:
    """provider -> per-round lists of seconds: [backward 1, ..., backward k, step]."""
    cfg = window.WindowConfig()
    device = torch.device("cpu")
    cells = {}
    for provider in PROVIDERS:
        model, batches = window._model_and_batches(model_name, dtype, cfg, device)
        step, _ = window._make_step(provider, list(model.parameters()), cfg, device)
        cells[provider] = (model, batches, step)
    times = {p: [] for p in PROVIDERS}
    for _ in range(rounds):
        for provider, (model, batches, step) in cells.items():
            row = []
            for mb in batches:
                loss = model(*mb) / len(batches)
                start = time.perf_counter()
                loss.backward()
                row.append(time.perf_counter() - start)
            start = time.perf_counter()
            step()
            row.append(time.perf_counter() - start)
            times[provider].append(row)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=window.MODELS, default="gpt2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (two are warm-up)")
    torch.set_num_threads(args.threads)
    times = phases(args.model, DTYPES[args.dtype], args.rounds)
    medians = {p: [statistics.median(col) * 1e3 for col in zip(*rows[2:])] for p, rows in times.items()}
    k = len(medians["native"]) - 1
    names = [f"bwd {i + 1}" for i in range(k)] + ["step"]
    print(f"# {args.model} {args.dtype}, {args.threads} thread(s), ms, median of {args.rounds - 2} rounds")
    print(f"{'':12s}" + "".join(f"{n:>8s}" for n in names) + f"{'window':>9s}")
    for provider, row in medians.items():
        print(f"{provider:12s}" + "".join(f"{t:8.2f}" for t in row) + f"{sum(row):9.1f}")
    diff = [o - n for o, n in zip(medians["fused_accum"], medians["native"])]
    print(f"{'ours - torch':12s}" + "".join(f"{t:+8.2f}" for t in diff) + f"{sum(diff):+9.1f}")


if __name__ == "__main__":
    main()
