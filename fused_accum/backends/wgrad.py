"""The fused weight-gradient GEMM: ``acc = (0 if overwrite else acc) + grad_output^T @ input``.

A Linear layer's weight gradient is ``grad_output^T @ input`` summed over every leading
(batch, sequence) position. Autograd computes it in the inputs' dtype (bf16 under autocast: an
[N, K] bf16 tensor, rounded, written, read back and folded into the fp32 accumulator); this op
writes it straight into the weight's fp32 accumulator slice instead, as Megatron-Core's
``gradient_accumulation_fusion`` and Transformer Engine's ``fuse_wgrad_accumulation`` do:
no low-precision weight gradient exists, nothing is rounded to bf16, and 2 + 2 + 4 + 4 bytes
per weight per micro-batch of traffic are gone (write and read the bf16 grad; the fold's
read-modify-write of acc happens in the GEMM's epilogue instead).

Contract (every backend; :func:`reference` is the specification and the test oracle):

- ``acc``: [N_out, K_in] float32, contiguous (a view of the flat accumulator, shaped like the
  weight). Overwritten when ``overwrite`` (its old contents, junk or not, are never read: the
  window's first micro-batch), added to otherwise.
- ``grad_output``: [..., N_out]; ``input``: [..., K_in], with the same leading shape (flattened
  to M rows; M = 0 leaves acc unchanged, or zeroed when overwriting). Both bf16, fp16 or fp32,
  the same dtype, on acc's device, any strides. The product is computed with fp32
  accumulation whatever their dtype; for fp32 inputs it is the same GEMM autograd would run
  (so TF32 follows ``torch.backends.cuda.matmul.allow_tf32``, as ``nn.Linear``'s does): for
  nn.Linear's row-major weight, torch's ``mm_mat2_backward`` computes ``mm(g^T, x)`` on the
  [M, N] and [M, K] operands, which :mod:`fused_accum.nn` passes as torch's linear has them. So
  on the reference and cpu backends an overwrite (the window's first gradient of an fp32
  weight) is bit-equal to the ``.grad`` torch would compute (tests/test_nn.py, on inputs whose
  two GEMM orders round apart), provided acc is aligned as a fresh tensor is: MKL's sgemm
  rounds by the output's alignment (on this project's AMD EPYC, an out= view 4 or 8 bytes off
  rounded apart for some shapes), and the flat buffer's slices start 256 bytes apart
  (``flat.ALIGN``). cuda makes the same call (not yet checked on a GPU). An add is summed in the
  GEMM (beta = 1), which may round apart from torch's product-then-add by an ulp (the reference
  adds the product separately, as AccumulateGrad does). Triton's own kernel keeps the
  precision, not the bits.

One function per backend, chosen by the backend name the window resolved for the weight's flat
group: the backends' registry (:func:`fused_accum.backends.wgrad_kernel`) says which function is
each backend's. This module holds the contract (:func:`check`), the specification and the torch
BLAS ones; the Triton kernel is in :mod:`fused_accum.backends.triton.wgrad` (it needs ``triton``).
This op uses none of the C++ extension: ``cpu`` and ``cuda`` are the names of the backends the
accumulator's group runs on, and their wgrad is ``torch`` BLAS (oneDNN/MKL, cuBLAS) called as
measured below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator, Tuple

import torch
from torch import Tensor

from . import NAMES, wgrad_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check(acc: Tensor, grad_output: Tensor, input: Tensor) -> Tuple[Tensor, Tensor]:
    """Validate the contract's arguments; return grad_output and input as [M, N] and [M, K].

    ``reshape`` keeps a view wherever the strides allow one (a transposed or sliced
    grad_output stays a strided 2-D view, which every backend reads as it is) and copies only
    when no 2-D view exists (e.g. a permuted 3-D tensor).
    """
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous():
        raise ValueError(
            f"wgrad_accumulate: acc must be a 2-D contiguous float32 tensor [N_out, K_in] (the "
            f"weight's accumulator slice), got {acc.dtype} of shape {tuple(acc.shape)} and "
            f"strides {acc.stride()}"
        )
    n_out, k_in = acc.shape
    for name, t, want in (("grad_output", grad_output, n_out), ("input", input, k_in)):
        if t.dim() < 1 or t.shape[-1] != want:
            raise ValueError(
                f"wgrad_accumulate: {name} must be [..., {want}] to match acc {tuple(acc.shape)}, "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise ValueError(f"wgrad_accumulate: {name} must be bf16, fp16 or fp32, got {t.dtype}")
        if t.device != acc.device:
            raise ValueError(f"wgrad_accumulate: {name} is on {t.device}, expected {acc.device} (acc's device)")
    if grad_output.shape[:-1] != input.shape[:-1]:
        raise ValueError(
            f"wgrad_accumulate: grad_output {tuple(grad_output.shape)} and input "
            f"{tuple(input.shape)} must have the same leading (batch) shape"
        )
    if grad_output.dtype != input.dtype:
        raise ValueError(
            f"wgrad_accumulate: grad_output ({grad_output.dtype}) and input ({input.dtype}) must have the same dtype"
        )
    return grad_output.reshape(-1, n_out), input.reshape(-1, k_in)


# --- reference: the specification --------------------------------------------------------------


def reference(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool) -> None:
    """fp32 GEMM of the upcast inputs, then overwrite or add. Any device; the test oracle."""
    g, x = check(acc, grad_output, input)
    product = g.float().t() @ x.float()
    if overwrite:
        acc.copy_(product)
    else:
        acc.add_(product)


# --- cpu ---------------------------------------------------------------------------------------

# torch 2.13's CPU build has no out_dtype GEMM ('aten::mm.dtype' / 'addmm.dtype' have no CPU
# kernel), and on this project's CPU (AMD EPYC, AVX2, no AVX512-BF16/AMX) a bf16 GEMM is
# emulated: ~3x slower than fp32 sgemm of the upcast operands (one thread, 2048 tokens,
# 1024 x 1024 acc: bf16 mm + add 1,364 ms, upcast + fp32 addmm_ 457 ms). So bf16/fp16 inputs
# are upcast to fp32 and added by sgemm with beta = 1 (addmm_) into acc: the precision of the
# fused path (no bf16 rounding of the product) at sgemm speed. Upcasting all M rows at once
# would allocate M x (N + K) x 4 bytes, for long sequences far more than the bf16 weight
# gradient (2 N K bytes) this op exists to avoid, so the rows go in blocks whose two fp32
# copies take at most N K bytes (half that gradient), but never fewer than CPU_MIN_BLOCK_ROWS
# rows: same run, blocks of 512 / 256 / 128 / 64 / 32 rows took 465 / 476 / 476 / 517 / 651 ms
# (acc is re-read and re-written per block). `python -m benchmarks.wgrad --quick --threads 1`
# measures the whole op against autograd's bf16 GEMM + fold.
CPU_MIN_BLOCK_ROWS = 256


def cpu_block_rows(m: int, n_out: int, k_in: int) -> int:
    """Rows of grad_output/input upcast per sgemm call by :func:`cpu` (see CPU_MIN_BLOCK_ROWS)."""
    rows = max(CPU_MIN_BLOCK_ROWS, (n_out * k_in) // (4 * (n_out + k_in)))
    return max(1, min(m, rows))


def cpu_temp_bytes(m: int, n_out: int, k_in: int) -> int:
    """The most bytes :func:`cpu` allocates at once for ``m`` rows (0 for fp32 inputs)."""
    return 4 * cpu_block_rows(m, n_out, k_in) * (n_out + k_in)


def _fp32_gemm(acc: Tensor, g: Tensor, x: Tensor, overwrite: bool) -> None:
    """fp32 operands: one sgemm into acc (beta = 0 on overwrite, else 1), on any device."""
    if overwrite:
        torch.mm(g.t(), x, out=acc)
    else:
        acc.addmm_(g.t(), x)


def cpu(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool) -> None:
    """fp32 sgemm into acc (beta = 1, or beta = 0 on overwrite); bf16/fp16 upcast in row blocks."""
    g, x = check(acc, grad_output, input)
    if acc.device.type != "cpu":
        raise ValueError(f"wgrad_accumulate: the cpu backend runs on CPU tensors, acc is on {acc.device}")
    m = g.shape[0]
    if m == 0:
        if overwrite:
            acc.zero_()
        return
    if g.dtype == torch.float32:
        _fp32_gemm(acc, g, x, overwrite)
        return
    rows = cpu_block_rows(m, *acc.shape)
    for start in range(0, m, rows):
        gb, xb = g[start : start + rows].float(), x[start : start + rows].float()
        if overwrite and start == 0:
            torch.mm(gb.t(), xb, out=acc)
        else:
            acc.addmm_(gb.t(), xb)
        del gb, xb  # before the next block's copies exist: one block's copies at a time


# --- cuda --------------------------------------------------------------------------------------


def cuda(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool) -> None:
    """cuBLAS: bf16/fp16 operands, fp32 C = acc, beta = 1 (beta = 0 on overwrite), one call.

    ``torch.addmm(acc, g^T, x, out_dtype=float32, out=acc)``: cuBLAS(Lt) reads the fp32 C tile
    and adds the fp32-accumulated product in its epilogue, the fold Megatron's
    ``wgrad_gemm_accum_fp32`` kernel does. torch 2.14.1's CUDA kernel accepts an fp32 ``self``
    with bf16 operands ("self dtype must match either out_dtype or mat1 dtype"); g^T is a
    transposed view, which cuBLAS takes as a transpose flag, no copy.
    """
    g, x = check(acc, grad_output, input)
    if acc.device.type != "cuda":
        raise ValueError(f"wgrad_accumulate: the cuda backend runs on CUDA tensors, acc is on {acc.device}")
    if g.shape[0] == 0:
        if overwrite:
            acc.zero_()
        return
    if g.dtype == torch.float32:
        _fp32_gemm(acc, g, x, overwrite)
    elif overwrite:
        torch.mm(g.t(), x, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)


# --- selection -----------------------------------------------------------------------------------
# Which function is each backend's is the registry's (fused_accum.backends); these two are its
# answers under the names this module has always offered them by.


class _ByBackend(Mapping):
    """Backend name -> its wgrad function, as :func:`fused_accum.backends.wgrad_kernel` says;
    each looked up (triton's imported) only when asked for."""

    def __getitem__(self, name: str) -> Callable[[Tensor, Tensor, Tensor, bool], None]:
        if name not in NAMES:
            raise KeyError(name)
        return wgrad_kernel(name)

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)


IMPLEMENTATIONS = _ByBackend()


def get(backend: str, device: torch.device | str | None = None) -> Callable[[Tensor, Tensor, Tensor, bool], None]:
    """The wgrad implementation of ``backend``: a resolved name, or "auto" (needs ``device``)."""
    return wgrad_kernel(backend, device)
