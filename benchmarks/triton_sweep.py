"""Sweep the Triton backend's launch shape on a GPU (issue 10, item 4): BLOCK, num_warps and
programs per SM (the chunk size), for a bf16 accumulate into fp32 and a fused AdamW step from
acc (fp32 masters, bf16 params), each as achieved GB/s and % of a device-to-device copy timed
in the same run. Run by benchmarks/device_check.sh; the winner becomes the default in
fused_accum/backends/triton/__init__.py (BLOCK, NUM_WARPS, PROGRAMS_PER_SM).

One setting is varied at a time around the default (:func:`configurations`): the default
first, then each other BLOCK, each other num_warps, each other programs per SM, with the rest at
their defaults: 6 configurations, not the 18 of the full product, so a budget of a few seconds
measures every setting's alternatives (with BLOCK as the outer loop of the product, the budget
cut off most of the BLOCK 2048 rows). The ``varied`` column names the setting that differs.

Bytes per element (docs/design.md, "The byte model"): accumulate 10 (read bf16 grad 2 + acc 4, write acc 4),
AdamW from acc 30 (read acc, master, m, v 16; write master, m, v 12, bf16 param 2). The default
size, 2**26 elements, moves 0.67 GB (accumulate) and 2 GB (step), far past the 50 MB L2.

Usage: python benchmarks/triton_sweep.py [--numel N] [--out DIR] [--budget SECONDS]
Compiles one kernel per (BLOCK, num_warps) and op (chunk sizes are run-time arguments: no
compile); stops starting new configurations after --budget seconds. triton_sweep.csv is written
a row at a time as each is measured, so a run stopped at a time limit (or by SIGINT, also when
started with SIGINT ignored) keeps them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

BLOCKS = (512, 1024, 2048)
WARPS = (4, 8)
PROGRAMS_PER_SM = (4, 16, 64)
BYTES_PER_ELEMENT = {"accumulate": 10, "adamw": 30}
SETTINGS = ("block", "num_warps", "programs_per_sm")


def configurations(default: Tuple[int, int, int]) -> List[Tuple[str, Tuple[int, int, int]]]:
    """(varied, (BLOCK, num_warps, programs per SM)) in the order they are measured: the default
    ("default"), then per setting each of its other values with the other two at their
    defaults. A default outside the swept values is measured first all the same."""
    out = [("default", tuple(default))]
    for axis, values in enumerate((BLOCKS, WARPS, PROGRAMS_PER_SM)):
        for value in values:
            if value != default[axis]:
                config = list(default)
                config[axis] = value
                out.append((SETTINGS[axis], tuple(config)))
    return out


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def copy_gbps(numel: int) -> float:
    """A device-to-device copy of numel fp32 (bytes read + written): the practical ceiling."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * 4 * numel / ms / 1e6


def main(argv=None) -> int:
    with common.stop_on_sigint():  # even when started with SIGINT ignored (in the background)
        return _main(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA device")
        return 2
    from fused_accum import ops
    from fused_accum.backends import reference
    from fused_accum.backends import triton as tb

    start = time.time()
    n = args.numel
    ceiling = copy_gbps(n)
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    acc = torch.randn(n, device="cuda", generator=gen)
    offsets = torch.zeros(1, dtype=torch.int64)
    master, m = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    v = torch.rand(n, device="cuda", generator=gen)
    lp = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    steps, lr, coef = (
        torch.full((1,), 3.0, device="cuda"),
        torch.tensor(1e-4, device="cuda"),
        torch.tensor(1.0, device="cuda"),
    )
    hyper = ops.adam_step.hyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
    adamw = (ops.StepTensors([master], [acc], steps, lr, coef, lp_params=[lp]), ops.adam_step.states([m], [v]), hyper)
    ops = {
        "accumulate": lambda: tb.accumulate(acc, offsets, [grad], 1.0, False),
        "adamw": lambda: tb.step(ops.adam_step, *adamw),
    }
    # correctness of the default shape once, on fresh data (a sweep of wrong kernels is worthless)
    want = acc.clone()
    reference.accumulate(want, offsets, [grad], 1.0, False)
    ops["accumulate"]()
    torch.testing.assert_close(acc, want, rtol=0, atol=0)

    saved = (tb.BLOCK, tb.NUM_WARPS, tb.PROGRAMS_PER_SM)
    rows = []
    csv_out = common.CsvAppender(args.out / "triton_sweep.csv") if args.out is not None else None
    try:
        for varied, (block, warps, pps) in configurations(saved):
            if time.time() - start > args.budget:
                print(f"triton_sweep: budget of {args.budget:.0f} s reached, {len(rows)} rows")
                break
            tb.BLOCK, tb.NUM_WARPS, tb.PROGRAMS_PER_SM = block, warps, pps
            tb.clear_table_cache()
            chunk = tb.chunk_size(n, tb._sm_count(torch.device("cuda")))
            for op, fn in ops.items():
                ms = _bench(fn)
                gbps = BYTES_PER_ELEMENT[op] * n / ms / 1e6
                rows.append(
                    dict(
                        op=op,
                        varied=varied,
                        numel=n,
                        block=block,
                        num_warps=warps,
                        programs_per_sm=pps,
                        chunk=chunk,
                        programs=-(-n // chunk),
                        ms=round(ms, 4),
                        gbps=round(gbps, 1),
                        pct_of_copy=round(100 * gbps / ceiling, 1),
                        copy_gbps=round(ceiling, 1),
                    )
                )
                r = rows[-1]
                if csv_out is not None:
                    csv_out.add(r)
                print(
                    f"{op:<10} BLOCK {block:>4} warps {warps} programs/SM {pps:>2} (chunk {chunk:>6}, "
                    f"{r['programs']:>6} programs): {ms:7.3f} ms {gbps:7.1f} GB/s {r['pct_of_copy']:5.1f}% of copy"
                )
    except KeyboardInterrupt:  # a time limit's SIGINT: the rows so far are already written
        print(f"triton_sweep: interrupted after {len(rows)} rows")
    finally:
        tb.BLOCK, tb.NUM_WARPS, tb.PROGRAMS_PER_SM = saved
        tb.clear_table_cache()
        if csv_out is not None:
            csv_out.close()
    for op in ops:
        best = max((r for r in rows if r["op"] == op), key=lambda r: r["gbps"], default=None)
        if best:
            print(
                f"best {op}: BLOCK {best['block']} warps {best['num_warps']} programs/SM "
                f"{best['programs_per_sm']}: {best['pct_of_copy']}% of the copy ({ceiling:.0f} GB/s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
