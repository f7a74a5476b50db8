"""Spill gate for the Triton kernels (issue 10, item 11): compile every kernel of
fused_accum/backends/triton/kernels.py for sm_90 without a GPU (Triton ships ptxas and
cuobjdump) in the variants with the most live values, and fail on any local memory.

A spill in a bandwidth-bound kernel is extra memory traffic per element (the AdamW variant for
bf16 params without masters spilled 8 bytes under Triton 3.6): CI fails on it as it fails on
CUDA spills (scripts/check_cuda_build.sh calls this). Variants: per kernel, each param / grad
dtype family with every optional operand and switch on (the most live values).

Usage: python scripts/check_triton_spills.py [--arch 90]   (exit 1 on a spill, 0 otherwise)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_triton_spills: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fused_accum.backends import triton as tb  # noqa: E402

kernels = tb.kernels
POINTERS = {"chunks": "*i64", "tensors": "*i64"}
INTS = ("first", "chunk", "n")


def compile_kernel(fn, arch: int, num_warps: int, **constexprs):
    """``fn`` compiled for sm_<arch>: tables int64 pointers, other pointers fp32, the ints and
    *_bits int64, every other runtime argument an fp32 scalar."""
    pointer_args = {"partial_sumsq", "partial_bad", "sumsq", "found_inf", "steps", "lr_ptr", "coef_ptr"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in pointer_args:
            signature[name] = "*fp32"
        elif name in INTS or name.endswith("_bits"):
            signature[name] = "i64"
        else:
            signature[name] = "fp32"
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "enable_fp_fusion": tb.FP_FUSION}
    )


def resource_usage(compiled) -> dict:
    """cuobjdump -res-usage of the cubin: REG, STACK, LOCAL... (bytes of local memory per thread
    in STACK/LOCAL are spills or register arrays moved to memory)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def variants():
    """(name, kernel, num_warps, constexprs) of every variant the gate compiles."""
    f32, bf16, f16 = tl.float32, tl.bfloat16, tl.float16
    block = dict(BLOCK=tb.BLOCK)
    for grad in (bf16, f16, f32):  # statistics on and acc read: the most live values
        yield (
            f"accumulate grad={grad}",
            kernels.accumulate_kernel,
            tb.NUM_WARPS,
            dict(GRAD_DTYPE=grad, OVERWRITE=False, STATS=True, **block),
        )
    yield (
        "reduce_stats",
        kernels.reduce_stats_kernel,
        tb.REDUCE_WARPS,
        dict(HAS_SUMSQ=True, HAS_FOUND_INF=True, BLOCK=tb.REDUCE_BLOCK),
    )
    # (param dtype, lp dtype or None): fp32 masters with/without a bf16 copy, bf16 params alone
    families = [(f32, bf16), (f32, None), (bf16, None)]
    # every switch on; the fused last micro-batch (grad + acc read) for each family, and the
    # plain step from acc for the first (20 variants, ~1 min on 2 cores; cached by Triton after)
    for (param, lp), fused, on in [(f, True, True) for f in families] + [(families[0], False, True)]:
        common = dict(
            PARAM_DTYPE=param,
            LP_DTYPE=lp or f32,
            GRAD_DTYPE=bf16,
            HAS_LP=lp is not None,
            FUSED=fused,
            GRADS_OVERWRITE=False,
            HAS_FOUND_INF=on,
            MAXIMIZE=on,
            **block,
        )
        tag = f"param={param} lp={lp} fused={fused} switches={'on' if on else 'off'}"
        yield (
            f"sgd {tag}",
            kernels.sgd_kernel,
            tb.NUM_WARPS,
            dict(common, HAS_WEIGHT_DECAY=on, HAS_MOMENTUM=True, NESTEROV=on),
        )
        for amsgrad in (False, True):
            yield (
                f"adam amsgrad={amsgrad} {tag}",
                kernels.adam_kernel,
                tb.NUM_WARPS,
                dict(common, HAS_WEIGHT_DECAY=True, DECOUPLED=on, AMSGRAD=amsgrad),
            )
        yield (f"lion {tag}", kernels.lion_kernel, tb.NUM_WARPS, common)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        print(f"[check_triton_spills] SKIP: this triton ships no cuobjdump ({tool})")
        return 0
    start, bad, n = time.time(), [], 0
    worst = {}
    for name, fn, warps, constexprs in variants():
        usage = resource_usage(compile_kernel(fn, args.arch, warps, **constexprs))
        n += 1
        kernel = name.split()[0]
        worst[kernel] = max(worst.get(kernel, 0), usage.get("REG", 0))
        if usage.get("STACK", 0) or usage.get("LOCAL", 0):
            bad.append(f"{name}: {usage}")
    print(
        f"[check_triton_spills] triton {triton.__version__}, sm_{args.arch}: {n} variants compiled in "
        f"{time.time() - start:.0f} s; most registers per kernel: " + ", ".join(f"{k} {v}" for k, v in worst.items())
    )
    for line in bad:
        print(f"[check_triton_spills] SPILL {line}")
    if bad:
        print(f"[check_triton_spills] FAIL: {len(bad)} variants use local memory (spills)")
        return 1
    print("[check_triton_spills] OK: no variant spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
