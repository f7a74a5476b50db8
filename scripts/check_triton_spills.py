"""Spill gate for the Triton kernels (issue 10, item 11): compile every kernel of
fused_accum/backends/triton/kernels.py for sm_90 without a GPU (Triton ships ptxas and
cuobjdump) in the variants with the most live values, and fail on any local memory.

A spill in a bandwidth-bound kernel is extra memory traffic per element: CI fails on it as it
fails on CUDA spills (scripts/check_cuda_build.sh calls this). Variants: per kernel, each param /
grad dtype family with every optional operand and switch on (the most live values).

What is reported, per variant that uses local memory: ptxas's own account (``ptxas -v`` on the
PTX: the stack frame, and of it the bytes of spill stores and loads), the SASS's local-memory
instructions (STL/LDL: how many, and how many sit inside a loop, i.e. run per element block),
and the subroutine calls beside them (CALL.REL: the out-of-line slow paths of IEEE-rounded fp32
division and square root, tl.div_rn / tl.sqrt_rn; a register live across such a call may be
saved on the stack). A stack frame that no instruction touches is not a spill and passes, said
as such; a spill, or any local-memory access, fails. Each failing variant is compiled again at
twice the warps and at half the BLOCK, and what those use is printed: the launch shape that
would avoid it. Every variant is compiled at the warps the launcher gives it
(``fused_accum.backends.triton.step_num_warps``). Seen under triton 3.6: the two Adam variants
for bf16 params without masters (amsgrad off and on) at BLOCK 1024 and 4 warps keep 48
registers and save one or two around the slow-path calls inside the main loop (4 B spill
stores and 4 B loads; amsgrad 8 and 36), while at 8 warps or BLOCK 512 (40 registers) or BLOCK
2048 (72-76) they have no stack; triton 3.9 compiles them with none. The launcher runs those two
at 8 warps since; the remainder variants (bf16 params + int16 remainders) spill in neither
version at 4.

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

from fused_accum import ops, registry  # noqa: E402
from fused_accum.backends import triton as tb  # noqa: E402

kernels, updates = tb.kernels, tb.updates
POINTERS = {"chunks": "*i64", "tensors": "*i64"}
INTS = ("first", "chunk", "n")


def compile_kernel(fn, arch: int, num_warps: int, hyper: tuple = (), **constexprs):
    """``fn`` compiled for sm_<arch>: tables int64 pointers, other pointers fp32, the ints int64,
    ``hyper`` (a step's tuple of scalars) the types of the values given, every other runtime
    argument an fp32 scalar."""
    pointer_args = {"partial_sumsq", "partial_bad", "sumsq", "found_inf", "steps", "lr_ptr", "coef_ptr"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in pointer_args:
            signature[name] = "*fp32"
        elif name in INTS:
            signature[name] = "i64"
        elif name == "hyper":
            signature[name] = tuple("i64" if isinstance(x, int) else "fp32" for x in hyper)
        else:
            signature[name] = "fp32"
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "enable_fp_fusion": tb.FP_FUSION}
    )


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_report(compiled) -> dict:
    """``ptxas -v`` on the variant's PTX, for its own target (sm_90a for arch 90): registers,
    stack_frame, spill_stores, spill_loads (bytes; a spill is what ptxas calls one, as against
    a frame for locals or call saves). Empty where ptxas says none of it."""
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\w+)", ptx, flags=re.M).group(1)
    with tempfile.TemporaryDirectory() as folder:
        src, obj = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([_tool("ptxas"), "-v", f"-arch={target}", src, "-o", obj], capture_output=True, text=True)
    text = run.stdout + run.stderr
    out = {}
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if frame:
        out.update(stack_frame=int(frame[1]), spill_stores=int(frame[2]), spill_loads=int(frame[3]))
    regs = re.search(r"Used (\d+) registers", text)
    if regs:
        out["registers"] = int(regs[1])
    return out


def sass_local_memory(compiled) -> dict:
    """The cubin's SASS, as :func:`local_memory_in` reads it."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return local_memory_in(sass)


def local_memory_in(sass: str) -> dict:
    """Local-memory instructions in a cuobjdump -sass listing (stl: STL, ldl: LDL), how many of
    them sit inside a loop (in_loop: between a backward branch's target and the branch), and the
    subroutine calls (calls: CALL.REL) that a register live across is saved around."""
    local, loops, calls, stl = [], [], 0, 0
    for addr, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        at = int(addr, 16)
        if re.search(r"\b(STL|LDL)\b", ins):
            local.append(at)
            stl += bool(re.search(r"\bSTL\b", ins))
        calls += bool(re.search(r"\bCALL\.REL", ins))
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", ins)
        if branch and int(branch[1], 16) < at:
            loops.append((int(branch[1], 16), at))
    in_loop = sum(any(lo <= a <= hi for lo, hi in loops) for a in local)
    return {"stl": stl, "ldl": len(local) - stl, "in_loop": in_loop, "calls": calls}


def describe(usage: dict, ptxas: dict, sass: dict) -> str:
    """One line of what a variant keeps in local memory, from cuobjdump, ptxas and the SASS."""
    parts = [f"{ptxas.get('registers', usage.get('REG', '?'))} registers"]
    if ptxas:
        parts.append(
            f"ptxas: {ptxas.get('stack_frame', 0)} bytes stack frame, {ptxas.get('spill_stores', 0)} bytes spill "
            f"stores, {ptxas.get('spill_loads', 0)} bytes spill loads"
        )
    parts.append(
        f"SASS: {sass['stl']} STL + {sass['ldl']} LDL, {sass['in_loop']} of them inside a loop, "
        f"beside {sass['calls']} CALL.REL (out-of-line subroutine calls)"
    )
    parts.append(f"cuobjdump: STACK {usage.get('STACK', 0)}, LOCAL {usage.get('LOCAL', 0)}")
    return "; ".join(parts)


def resource_usage(compiled) -> dict:
    """cuobjdump -res-usage of the cubin: REG, STACK, LOCAL... (bytes of local memory per thread
    in STACK/LOCAL are spills or register arrays moved to memory)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
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
    # (param dtype, lp dtype or None, or "rem"): fp32 masters with/without a bf16 copy, bf16
    # params alone, bf16 params with int16 remainders (exact 2-byte masters)
    families = [(f32, bf16), (f32, None), (bf16, None), (bf16, "rem")]
    # every switch on; the fused last micro-batch (grad + acc read) for each family, and the
    # plain step from acc for the first (20 variants, ~1 min on 2 cores; cached by Triton after)
    for (param, lp), fused, on in [(f, True, True) for f in families] + [(families[0], False, True)]:
        rem = lp == "rem"
        common = dict(
            PARAM_DTYPE=param,
            LP_DTYPE=tl.int16 if rem else lp or f32,
            GRAD_DTYPE=bf16,
            HAS_LP=lp is not None and not rem,
            HAS_REM=rem,
            FUSED=fused,
            GRADS_OVERWRITE=False,
            HAS_FOUND_INF=on,
            MAXIMIZE=on,
            **block,
        )
        tag = f"param={param} lp={lp} fused={fused} switches={'on' if on else 'off'}"
        for op_name, update in updates.UPDATES.items():
            # at the warps the launcher gives the variant, its switches all on and all on but
            # the last (Adam: amsgrad on and off)
            warps = tb.step_num_warps(op_name, param.primitive_bitwidth, common["HAS_LP"], rem)
            hyper, switches = update.arguments(*_sample_records(op_name))
            for n_on in sorted({len(switches), max(len(switches) - 1, 0)}, reverse=True):
                which = (True,) * n_on + (False,) * (len(switches) - n_on)
                yield (
                    f"{op_name} switches={which} {tag}",
                    kernels.step_kernel,
                    warps,
                    dict(
                        common,
                        PREPARE=update.prepare,
                        UPDATE=update.update,
                        SWITCHES=which,
                        WRITES_PARAM=update.writes_param,
                        READS_INPUT=update.reads_input,
                        hyper=hyper,
                    ),
                )


def _sample_records(op_name: str) -> tuple:
    """(hyper, states) records of step op ``op_name`` at an algorithm's defaults: what its
    ``arguments`` turns into the kernel's scalars (their types are the signature's)."""
    op = next(o for o in ops.kernel_ops() if o.name == op_name)  # (a split step's prologue or epilogue too)
    algorithm = next(a for a in registry.ALGORITHMS.values() if a.hyper is op.hyper)
    return op.hyper.of(algorithm.name, algorithm.defaults), op.states(*([] for _ in op.state_keys))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        print(f"[check_triton_spills] SKIP: this triton ships no cuobjdump ({tool})")
        return 0
    start, bad, notes, n = time.time(), [], [], 0
    worst = {}
    for name, fn, warps, constexprs in variants():
        compiled = compile_kernel(fn, args.arch, warps, **constexprs)
        usage = resource_usage(compiled)
        n += 1
        kernel = name.split()[0]  # accumulate, reduce_stats, or the step op
        worst[kernel] = max(worst.get(kernel, 0), usage.get("REG", 0))
        if not (usage.get("STACK", 0) or usage.get("LOCAL", 0)):
            continue
        ptxas, sass = ptxas_report(compiled), sass_local_memory(compiled)
        line = f"{name} (BLOCK {constexprs['BLOCK']}, {warps} warps): {describe(usage, ptxas, sass)}"
        spilled = ptxas.get("spill_stores", 0) or ptxas.get("spill_loads", 0)
        if not spilled and not usage.get("LOCAL", 0) and sass["stl"] + sass["ldl"] == 0:
            notes.append(f"STACK FRAME ONLY (no spill, no local-memory instruction) {line}")
            continue
        tag = "SPILL" if spilled else "LOCAL MEMORY"
        bad.append(f"{tag} {line}")
        for what, w, block in (
            ("twice the warps", 2 * warps, constexprs["BLOCK"]),
            ("half the BLOCK", warps, constexprs["BLOCK"] // 2),
        ):
            other = ptxas_report(compile_kernel(fn, args.arch, w, **dict(constexprs, BLOCK=block)))
            has = other.get("stack_frame", 0) or other.get("spill_stores", 0) or other.get("spill_loads", 0)
            bad.append(
                f"    the same at {what} (BLOCK {block}, {w} warps): {other.get('registers', '?')} registers, "
                + (
                    f"{other.get('stack_frame', 0)} bytes stack frame, {other.get('spill_stores', 0)} B spill stores"
                    if has
                    else "no stack"
                )
            )
    print(
        f"[check_triton_spills] triton {triton.__version__}, sm_{args.arch}: {n} variants compiled in "
        f"{time.time() - start:.0f} s; most registers per kernel: " + ", ".join(f"{k} {v}" for k, v in worst.items())
    )
    for line in notes + bad:
        print(f"[check_triton_spills] {line}")
    if bad:
        failing = sum(not line.startswith(" ") for line in bad)
        print(f"[check_triton_spills] FAIL: {failing} variants use local memory (spills or local arrays)")
        return 1
    print("[check_triton_spills] OK: no variant spills or touches local memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
