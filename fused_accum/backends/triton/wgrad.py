"""Triton backend of the fused weight-gradient GEMM (contract in :mod:`fused_accum.backends.wgrad`).

One program owns a BLOCK_N x BLOCK_K tile of acc [N, K] and walks the M rows of grad_output
[M, N] and input [M, K] in BLOCK_M steps, accumulating ``g_tile^T @ x_tile`` in fp32 registers
(``tl.dot``: bf16/fp16 tensor-core MMA with fp32 accumulation). The epilogue is the fold: load
the fp32 acc tile (unless overwriting), add, store, so acc is read and written once per
micro-batch and no low-precision weight gradient exists.

Both operands are read through their own strides (a transposed or sliced grad_output is not
copied). fp32 operands use ``input_precision="ieee"`` unless torch allows TF32 for matmuls, the
precision nn.Linear's own GEMM would have. No split over M: each acc tile is written by exactly
one program, so the result is deterministic; a layer with few output tiles and many tokens
(e.g. 64 x 64 weights, 16k tokens) leaves SMs idle, which a split-M variant with a second
reduction pass would fix (not done: 1B-class shapes have >= 256 tiles of 128 x 128).

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported), as a test of
the tiling, masks, strides and epilogue. There the tiles are upcast to fp32 before ``tl.dot``
(Triton 3.9's interpreter multiplies bf16 tiles as raw 16-bit integers: errors of 1e9 on
1 x 1 x 1), so the bf16 MMA itself is only exercised on a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ..wgrad import check

# First guesses for an H100/H200 (bf16: 128 x 128 output tile, 32-row steps, 8 warps; 4 stages
# of 2 x 128 x 32 x 2 B = 64 KB shared memory); to be swept on the GPU.
BLOCK_N = 128
BLOCK_K = 128
BLOCK_M = 32
NUM_WARPS = 8
NUM_STAGES = 4
# Under the interpreter every program is numpy on the host: smaller tiles keep the tests quick
# and make small test shapes span several tiles (edges and masks exercised).
INTERPRETED_BLOCKS = (16, 16, 16)


# M (tokens) only bounds the loop and masks the rows past it: a variant per M of 1, a multiple
# of 16 or neither (Triton's default value and alignment specialisation) computes the same
# thing, and each costs a JIT compile of 1-4 s on a bare GPU machine. N and K stay specialised:
# their divisibility lets the acc tile's loads and stores vectorise.
@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["M"])
def wgrad_kernel(
    acc_ptr,
    g_ptr,
    x_ptr,
    M,
    N,
    K,
    stride_gm,
    stride_gn,
    stride_xm,
    stride_xk,
    OVERWRITE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_n = pid // tiles_k
    pid_k = pid % tiles_k
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    total = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = offs_m < M
        # g^T tile [BLOCK_N, BLOCK_M] and x tile [BLOCK_M, BLOCK_K]; rows past M read 0.
        g_t = tl.load(
            g_ptr + offs_n[:, None] * stride_gn + offs_m[None, :] * stride_gm,
            mask=mask_n[:, None] & mask_m[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        if UPCAST:  # the interpreter's tl.dot reads bf16 as raw 16-bit integers (numpy has no bf16)
            g_t = g_t.to(tl.float32)
            x = x.to(tl.float32)
        if IEEE:
            total = tl.dot(g_t, x, total, input_precision="ieee")
        else:
            total = tl.dot(g_t, x, total)
    # The epilogue: the fold into the fp32 accumulator (acc is contiguous [N, K]).
    acc_ptrs = acc_ptr + offs_n[:, None] * K + offs_k[None, :]
    mask = mask_n[:, None] & mask_k[None, :]
    if not OVERWRITE:
        total += tl.load(acc_ptrs, mask=mask, other=0.0)
    tl.store(acc_ptrs, total, mask=mask)


def wgrad_accumulate(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool) -> None:
    """Launch :func:`wgrad_kernel` over acc's tiles (the contract: :mod:`fused_accum.backends.wgrad`)."""
    g, x = check(acc, grad_output, input)
    m, (n, k) = g.shape[0], acc.shape
    if n == 0 or k == 0:
        return
    interpreted = acc.device.type != "cuda"
    block_n, block_k, block_m = INTERPRETED_BLOCKS if interpreted else (BLOCK_N, BLOCK_K, BLOCK_M)
    ieee = g.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    grid = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)
    wgrad_kernel[grid](
        acc,
        g,
        x,
        m,
        n,
        k,
        g.stride(0),
        g.stride(1),
        x.stride(0),
        x.stride(1),
        OVERWRITE=overwrite,
        IEEE=ieee or interpreted,
        UPCAST=interpreted,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_M=block_m,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
