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
        (((model(x) - y) ** 2).mean() / K).backward()
    opt.step()


@needs_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_window_replays_like_eager(backend):
    if fused_accum.backends.availability(backend, "cuda"):
        pytest.skip(fused_accum.backends.availability(backend, "cuda"))
    captured, eager = _model(), _model()
    kw = dict(lr=torch.tensor(1e-2, device="cuda"), accum_steps=K, max_grad_norm=0.5, backend=backend)
    opt = fused_accum.AdamW(captured.parameters(), capturable=True, **kw)
    ref = fused_accum.AdamW(eager.parameters(), **copy.deepcopy(kw))
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        [
            (torch.randn(16, 64, device="cuda", generator=gen), torch.randn(16, 8, device="cuda", generator=gen))
            for _ in range(K)
        ]
        for _ in range(6)
    ]
    static_x = [torch.zeros(16, 64, device="cuda") for _ in range(K)]
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
    # Same kernels on the same data; only the host-side order of launches differs: bit-exact
    # is expected, 1e-6 relative allows a reordered reduction in the norm.
    for p, q in zip(captured.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
