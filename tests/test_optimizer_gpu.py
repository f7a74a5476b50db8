"""The optimizer on a CUDA device: a whole window (backwards + step) captured in a CUDA graph.

``pytest -m gpu`` (run by benchmarks/device_check.sh on a lent GPU). step() keeps every
per-step value on the device (lr as a tensor, step counts, the clip/unscale coefficient, the
skip flag) and makes no host-to-device copy once a configuration has run eagerly, so a captured
window replays what eager execution does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fused_accum

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
K = 2  # micro-batches per window


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()


def _window(model, opt, xs, ys):
    for x, y in zip(xs, ys):
        (((model(x).float() - y) ** 2).mean() / K).backward()
    opt.step()


def _replayed_and_eager(backend, dtype=torch.float32, **kw):
    """A window captured in a CUDA graph and replayed on 4 new windows (a change of the lr
    tensor between), beside the same optimizer run eagerly on the same data: (captured model,
    its optimizer, eager model, its optimizer), synchronized. ``kw``: more optimizer keywords."""
    if fused_accum.backends.availability(backend, "cuda"):
        pytest.skip(fused_accum.backends.availability(backend, "cuda"))
    captured, eager = _model().to(dtype), _model().to(dtype)
    kw = dict(lr=torch.tensor(1e-2, device="cuda"), accum_steps=K, max_grad_norm=0.5, backend=backend, **kw)
    opt = fused_accum.AdamW(captured.parameters(), capturable=True, **kw)
    ref = fused_accum.AdamW(eager.parameters(), **copy.deepcopy(kw))
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        [
            (
                torch.randn(16, 64, device="cuda", generator=gen).to(dtype),
                torch.randn(16, 8, device="cuda", generator=gen),
            )
            for _ in range(K)
        ]
        for _ in range(6)
    ]
    static_x = [torch.zeros(16, 64, device="cuda", dtype=dtype) for _ in range(K)]
    static_y = [torch.zeros(16, 8, device="cuda") for _ in range(K)]

    def load(window):
        for (x, y), sx, sy in zip(window, static_x, static_y):
            sx.copy_(x)
            sy.copy_(y)

    # Warm up on a side stream (torch's recipe): kernels compiled, index tensors cached. Whole
    # windows, as captured below, so that every kernel variant the capture launches has been
    # launched eagerly first (Triton loads a variant's module at its first launch, which the
    # driver refuses inside a capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for window in data[:2]:
            load(window)
            _window(captured, opt, static_x, static_y)
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    for window in data[:2]:
        _window(eager, ref, *zip(*window))
        ref.zero_grad(set_to_none=True)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _window(captured, opt, static_x, static_y)
    for step, window in enumerate(data[2:]):
        if step == 2:  # a scheduler's change of the lr tensor reaches the replays
            opt.param_groups[0]["lr"].fill_(3e-3)
            ref.param_groups[0]["lr"].fill_(3e-3)
        load(window)
        graph.replay()
        _window(eager, ref, *zip(*window))
        ref.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return captured, opt, eager, ref


@needs_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_window_replays_like_eager(backend):
    captured, _, eager, _ = _replayed_and_eager(backend)
    # Same kernels on the same data; only the host-side order of launches differs: bit-exact
    # is expected, 1e-6 relative allows a reordered reduction in the norm.
    for p, q in zip(captured.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _masters(opt) -> list:
    """Each parameter's fp32 master as the optimizer holds it (rebuilt in the remainder mode)."""
    window = opt._window
    return [window.flat_groups[s.flat_index].master_of(s).clone() for s in window.slots]


@needs_cuda
@pytest.mark.parametrize("master_weights", [True, "remainder"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_bf16_window_with_masters_replays_like_eager(backend, master_weights):
    """bf16 parameters with fp32 masters, or with int16 remainders (exact 2-byte masters): the
    captured window's step writes the masters (or remainders) and the bf16 weights as eager does."""
    captured, opt, eager, ref = _replayed_and_eager(backend, torch.bfloat16, master_weights=master_weights)
    flat = opt._window.flat_groups[0]
    assert type(flat.masters).__name__ == {True: "Fp32Copy", "remainder": "Remainder"}[master_weights]
    # bit-exact expected as above; the masters within 1e-6 relative (a reordered norm), so a
    # weight, their rounding to bf16, within 1 bf16 ulp
    for got, want in zip(_masters(opt), _masters(ref)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for p, q in zip(captured.parameters(), eager.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=1e-7)
    assert any(not torch.equal(m, p.detach().reshape(-1).float()) for m, p in zip(_masters(opt), captured.parameters()))
