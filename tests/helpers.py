"""What several test files share: the backends this process can run, the flat layout the
optimizer gives its buffers, relative errors, and the small model the contract tests train.

Imported by name (``from helpers import ...``): pytest puts tests/ on sys.path, as it does for
dispatch_record.py and lion_reference.py. The shared fixtures are in conftest.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import List, NamedTuple, Sequence, Union

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fused_accum import backends
from fused_accum.flat import ALIGN

# --- backends -------------------------------------------------------------------------------------


def _available(names, device_type) -> List[str]:
    return [n for n in names if backends.availability(n, device_type) == ""]


# The kernel backends, never the reference (a kernel test comparing the reference with itself
# could not fail): on CPU tensors ``cpu`` when the C++ extension is built and ``triton`` only in a
# ``TRITON_INTERPRET=1`` process (the variable must be set before triton is first imported); on
# CUDA tensors ``cuda`` and ``triton`` (``-m gpu`` on a CUDA machine).
CPU_KERNEL_BACKENDS = _available(("cpu", "triton"), "cpu")
GPU_KERNEL_BACKENDS = _available(("cuda", "triton"), "cuda") if torch.cuda.is_available() else []
# Every backend an optimizer can be given here: the reference always, then the kernel backends.
CPU_BACKENDS = ["reference"] + CPU_KERNEL_BACKENDS
GPU_BACKENDS = ["reference"] + GPU_KERNEL_BACKENDS if torch.cuda.is_available() else []


def device_cases(cpu_names: Sequence[str], gpu_names: Sequence[str]) -> list:
    """``(backend, device)`` parameters: ids ``<name>-cpu`` and ``<name>-cuda``, the CUDA ones
    marked ``gpu`` (deselected by default, run by ``-m gpu``)."""
    return [pytest.param(n, "cpu", id=f"{n}-cpu") for n in cpu_names] + [
        pytest.param(n, "cuda", id=f"{n}-cuda", marks=pytest.mark.gpu) for n in gpu_names
    ]


# --- the flat layout ------------------------------------------------------------------------------

PAD = ALIGN  # the optimizer's slice alignment, in elements (fused_accum.flat.ALIGN)
SENTINEL = -7.0  # in the padding of a layout not drawn at random: kernels must not write padding


class FlatLayout(NamedTuple):
    flat: torch.Tensor  # the fp32 accumulator, as accumulate takes it
    offsets: torch.Tensor  # int64 on the CPU: where each slice starts, as accumulate takes them
    views: List[torch.Tensor]  # the slices (1-D views), as the step ops take them


def flat_layout(sizes, device="cpu", *, pad=PAD, fill=None, gen=None) -> FlatLayout:
    """A flat fp32 buffer with one slice per size, each starting at a multiple of ``pad``
    elements (the optimizer's layout; pad=1 packs the slices at odd, unaligned offsets).

    With ``gen``: random values everywhere, the padding too (one ``randn`` of the whole buffer
    drawn from ``gen``). Without: SENTINEL everywhere, then ``fill`` in the slices where given."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + pad - 1) // pad * pad
    if gen is not None:
        flat = torch.randn(total, generator=gen).to(device)
    else:
        flat = torch.full((total,), SENTINEL, device=device)
    views = [flat[o : o + n] for o, n in zip(offsets, sizes)]
    if fill is not None:
        for v in views:
            v.fill_(fill)
    return FlatLayout(flat, torch.tensor(offsets, dtype=torch.int64), views)


def padding_untouched(flat, views) -> bool:
    """Whether every element of ``flat`` outside ``views`` still holds SENTINEL."""
    mask = torch.ones_like(flat, dtype=torch.bool)
    for v in views:
        start = v.storage_offset() - flat.storage_offset()
        mask[start : start + v.numel()] = False
    return bool((flat[mask] == SENTINEL).all())


# --- relative errors ------------------------------------------------------------------------------

# fp32 parameters, gradients and state against torch.optim on a twin model fed the same data: a
# correct implementation rounds as torch does but not always in the same order (a few ulp; the
# files using it say what they measured), while the bugs these comparisons pin (a missing division,
# a lost or extra micro-batch, a wrong clip factor, a step that should have been skipped) are
# >= 1e-3.
RTOL = 1e-6


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in fp64 (0 when equal; NaNs must sit at the same
    places, where they count as equal)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.equal(a.isnan(), e.isnan()), "NaNs at different places"
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    diff = (a - e).abs().max().item() if a.numel() else 0.0
    scale = e.abs().max().item() if e.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def assert_rel(actual, expected, rtol=RTOL, what="value"):
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def assert_params_match(ours: nn.Module, ref: nn.Module, rtol=RTOL):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert_rel(p, q, rtol, f"parameter {name}")


def assert_grads_match(ours: nn.Module, ref: nn.Module, rtol=RTOL, when=""):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), (
            f"{name}.grad {when}: {'None' if p.grad is None else 'set'}, torch's {'None' if q.grad is None else 'set'}"
        )
        if q.grad is not None:
            assert_rel(p.grad, q.grad, rtol, f"{name}.grad {when}")


Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def norm_rel_err(got: Tensors, want: Tensors) -> float:
    """||got - want|| / ||want||, in fp64, over all elements as one flat vector (a list of
    tensors is concatenated); ||want|| = 0 counts as 1e-30 (equal zeros give 0, not NaN)."""
    if not isinstance(got, torch.Tensor):
        got = torch.cat([g.reshape(-1) for g in got])
    if not isinstance(want, torch.Tensor):
        want = torch.cat([w.reshape(-1) for w in want])
    g, w = got.detach().double(), want.detach().double()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


# --- the twin models the contract tests train -----------------------------------------------------


class Net(nn.Module):
    """body -> tanh -> head, fp32: 6 features in, 16 hidden, 3 out."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def twins(seed=0, cls=Net):
    """Two equal models: one for fused_accum, one for torch.optim."""
    a = cls(seed)
    return a, copy.deepcopy(a)


def data(n, micro=4, seed=1, dtype=torch.float32):
    """``n`` micro-batches ``(x, y)`` of ``micro`` samples for Net (6 features in, 3 out)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(micro, 6, generator=gen).to(dtype), torch.randn(micro, 3, generator=gen).to(dtype))
        for _ in range(n)
    ]


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


class RaiseWhenArmed(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a backward that fails half way (the
    layers after it have their gradients, the ones before it none), as an OOM or an error in a
    custom op would leave it."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if RaiseWhenArmed.armed:
            raise RuntimeError("planted error in backward")
        return g


def spawn_ranks(worker, path: str, world: int, *args, weights_only: bool = False) -> list:
    """Run ``worker(rank, path, *args)`` in ``world`` spawned processes, each of which saves its
    results with ``torch.save`` to ``f"{path}.rank{rank}"``, and return what they saved, in rank
    order."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(path, *args), nprocs=world, join=True)
    return [torch.load(f"{path}.rank{r}", weights_only=weights_only) for r in range(world)]


# --- a one-rank gloo world in this process ------------------------------------------------------

# A one-rank gloo world inside the test's own process (DDP with one process, DTensor on a
# one-rank mesh), torn down so that it cannot hang the process.
#
# gloo frees a finished collective's work on its worker thread, and freeing it takes the GIL (the
# work keeps the launching thread's thread-local state, which can hold a Python object); the
# process group's destructor joins those threads while holding the GIL. When the last reference to
# the group goes (a DDP model's reducer, freed as the test returns) before a worker thread has
# freed its last work, each waits on the other forever: seen as a pytest-xdist worker hung in
# ~ProcessGroupGloo under load. Sleeping before the teardown releases the GIL, so the worker
# threads free their work first (DDP waits for every collective it launches, so none is still
# running then).
_LET_GLOO_THREADS_FINISH_S = 0.2  # (a thread waiting for the GIL gets it within 5 ms of a release)


@contextlib.contextmanager
def one_rank_world(tmp_path):
    """A one-rank gloo world inside the test's own process (DDP with one process, DTensor on a
    one-rank mesh), torn down so that it cannot hang the process (see above)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield
    finally:
        time.sleep(_LET_GLOO_THREADS_FINISH_S)
        dist.destroy_process_group()
