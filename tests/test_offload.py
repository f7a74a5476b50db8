"""``offload="cpu"``: exact against the same optimizer without offload, on a CPU-only machine.

The whole pipeline runs here with CPU parameters: the "device" buffers (parameters and
accumulators) and the host ones are both in CPU memory, the transfers are copies made on the
host worker, in order, and the worker thread, the speculation, its commit, its put-back and
re-run, and the waits are the code a GPU runs (the GPU adds only its side stream and events:
fused_accum/host.py, Copies). The oracle is the same optimizer without offload on the
``cpu`` backend, whose kernels the host runs: parameters, masters and state must be equal bit
for bit after every window.
"""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from torch import nn

import fused_accum
from fused_accum import host as host_module
from fused_accum import offload as offload_module
import cases  # tests/cases.py: every algorithm, its cases, the modes it runs in
from fused_accum.backends import ext
from helpers import RaiseWhenArmed, one_rank_world  # tests/helpers.py

pytestmark = pytest.mark.skipif(ext._C is None, reason="the host step runs the C++ CPU kernels")

ALGORITHMS = {c.id: c for c in cases.cases(cases.OFFLOAD, every=True)}  # tests/cases.py
SGD = next(c.id for c in cases.cases(cases.OFFLOAD) if c.algorithm == "sgd")  # (its default case)


def net(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 3)).to(dtype)


def batches(n, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=gen).to(dtype), torch.randn(4, 3, generator=gen)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return (model(x).float() - y).square().mean()


def train(model, opt, k, windows, *, poison=(), num_items=False, scaler=None, edit_at=None, dtype=torch.float32):
    data = batches(k * windows, dtype)
    for w in range(windows):
        if w == edit_at:
            with torch.no_grad():
                model[0].weight.mul_(0.5)  # a user edit between steps
        for j in range(k):
            loss = loss_of(model, data[w * k + j]) / (1 if num_items else k)
            if w in poison and j == k - 1:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step(num_items=torch.tensor(float(4 * k)) if num_items else None)
        opt.zero_grad()
        yield w


def state_of(opt) -> list:
    """Every tensor the step keeps: masters (rebuilt where a remainder holds them), state, steps."""
    out = []
    for flat in opt._window.flat_groups:
        for slot in flat.slots:
            out.append(flat.master_of(slot).cpu())
            out.extend(v.cpu() for _, v in sorted(slot.state.items()))
        out.append(flat.steps.cpu())
    return out


def assert_equal_runs(ours, ours_opt, ref, ref_opt, when):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{when}: parameter {name}"
    for i, (a, b) in enumerate(zip(state_of(ours_opt), state_of(ref_opt))):
        assert torch.equal(a, b), f"{when}: state tensor {i}"


CASES = [
    # name, algorithm (its case in tests/cases.py), param dtype, master mode, k, optimizer
    # keywords, loop options. What the offload does around the step, on one algorithm each,
    ("adamw-bf16-k8-clips", "adamw", torch.bfloat16, True, 8, dict(max_grad_norm=0.02), {}),
    ("adamw-bf16-k3-no-clip", "adamw", torch.bfloat16, True, 3, dict(max_grad_norm=1e6), {}),
    ("adamw-fp32-k1", "adamw", torch.float32, True, 1, {}, {}),
    (
        "sgd-bf16-k3-skip",
        SGD,
        torch.bfloat16,
        True,
        3,
        dict(max_grad_norm=0.02, skip_nonfinite=True),
        dict(poison=(2,)),
    ),
    ("lion-fp32-k8", "lion", torch.float32, True, 8, {}, {}),
    (
        "amsgrad-bf16-remainder-k3",
        "adam_amsgrad_maximize",
        torch.bfloat16,
        "remainder",
        3,
        dict(max_grad_norm=0.05),
        {},
    ),
    ("adamw-bf16-num_items", "adamw", torch.bfloat16, True, 3, {}, dict(num_items=True)),
    ("adamw-bf16-user-edit", "adamw", torch.bfloat16, True, 3, {}, dict(edit_at=3)),
    ("sgd-fp16-gradscaler", SGD, torch.float16, True, 3, {}, dict(scaler=True)),
    # then each algorithm's default case plainly (every speculation is the step)
    *((f"{c.id}-bf16-k3-plain", c.id, torch.bfloat16, True, 3, {}, {}) for c in cases.cases(cases.OFFLOAD)),
]


@pytest.mark.parametrize("name, algorithm, dtype, master, k, kwargs, loop", CASES, ids=[c[0] for c in CASES])
def test_offload_is_bit_identical_to_the_same_optimizer_without(
    name, algorithm, dtype, master, k, kwargs, loop, one_thread
):
    case = ALGORITHMS[algorithm]
    ours, ref = net(dtype), net(dtype)
    common = dict(master_weights=master, accum_steps=k, backend="cpu", **kwargs)
    ours_opt = case.make(ours.parameters(), offload="cpu", **common)
    ref_opt = case.make(ref.parameters(), **common)
    loop = dict(loop)
    scalers = (
        [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
        if loop.pop("scaler", False)
        else [None, None]
    )
    runs = [
        train(ours, ours_opt, k, 6, scaler=scalers[0], dtype=dtype, **loop),
        train(ref, ref_opt, k, 6, scaler=scalers[1], dtype=dtype, **loop),
    ]
    for w, _ in zip(*runs):
        assert_equal_runs(ours, ours_opt, ref, ref_opt, f"window {w}")
    offload = ours_opt._window.placement
    if "clips" in name or "skip" in name or "remainder" in name:
        assert offload.redone > 0  # (a clip or a skip: the speculation was put back and redone)
    if "no-clip" in name or "plain" in name or name == "lion-fp32-k8":
        assert offload.committed > 0 and offload.redone == 0  # (every speculation was the step)
    if "num_items" in name or "gradscaler" in name:
        assert not offload.speculate  # (after the first step: such a loop steps at step())


@pytest.mark.parametrize("fault", ["commit_always", "speculation_in_place"])
def test_a_planted_fault_in_the_commit_logic_is_caught(fault, monkeypatch, one_thread):
    """The exactness test fails if a clipped window's speculation were committed, or if it had
    stepped the live buffers (in place: then its redo steps from what it wrote)."""
    if fault == "commit_always":
        monkeypatch.setattr(offload_module.Offload, "_still_valid", lambda self, flat, record: True)
        monkeypatch.setattr(offload_module.Offload, "step_window", _step_committing_always)
    else:  # every host step in place, no twins: a redo steps the speculation's values again
        monkeypatch.setattr(host_module.HostLayout, "out_of_place", lambda self, flat, slots, call: call)
        monkeypatch.setattr(host_module.HostLayout, "commit", lambda self, flat, stepped: None)
    with pytest.raises(AssertionError):
        test_offload_is_bit_identical_to_the_same_optimizer_without(*CASES[0][:7], None)


_real_step = offload_module.Offload.step_window


def _step_committing_always(self, flat_groups, topology, stepper, scale, skip, speculable):
    """A broken step that commits whatever the coefficient (as if the clip never applied)."""
    ones = {d: torch.ones_like(c) for d, c in scale.items()}
    return _real_step(self, flat_groups, topology, stepper, ones, skip, speculable)


def test_the_next_forward_never_sees_half_a_step_whatever_the_workers_timing(monkeypatch, one_thread):
    """The worker made slow, at random, before every task: each step still returns with every
    parameter written (equal to the run without offload), and the backwards that run while the
    worker steps are unaffected."""
    rng = random.Random(0)
    monkeypatch.setattr(host_module, "WORKER_DELAY", lambda: time.sleep(rng.random() * 0.004))
    ours, ref = net(torch.bfloat16), net(torch.bfloat16)
    # a bucket each; no clip (every speculation stands) but a skipped window (window 3, put back)
    kwargs = dict(lr=1e-2, accum_steps=4, max_grad_norm=1e6, skip_nonfinite=True, backend="cpu", bucket_cap_mb=1e-6)
    ours_opt = fused_accum.AdamW(ours.parameters(), offload="cpu", **kwargs)
    ref_opt = fused_accum.AdamW(ref.parameters(), **kwargs)
    runs = [train(m, o, 4, 8, dtype=torch.bfloat16, poison=(3,)) for m, o in ((ours, ours_opt), (ref, ref_opt))]
    for w, _ in zip(*runs):
        assert_equal_runs(ours, ours_opt, ref, ref_opt, f"window {w}")
    assert len(ours_opt._window.flat_groups[0].buckets) == 6  # (six buckets in flight)
    # windows 0-3 and 5-7 speculated (4 after the skip did not): 7 x 6 buckets, 6 of them put back
    assert (ours_opt._window.placement.committed, ours_opt._window.placement.redone) == (36, 6)


def test_after_a_clipped_window_the_next_steps_at_step_until_one_does_not_clip(one_thread):
    """Clipping comes in runs: a clipped window's speculation is put back and stepped again, so
    the window after it does not speculate; the window after the first unclipped step does."""
    ours, ref = net(torch.bfloat16), net(torch.bfloat16)
    kwargs = dict(lr=1e-2, accum_steps=2, max_grad_norm=100.0, backend="cpu")
    opts = [
        fused_accum.AdamW(ours.parameters(), offload="cpu", **kwargs),
        fused_accum.AdamW(ref.parameters(), **kwargs),
    ]
    offload, data = opts[0]._window.placement, batches(10, torch.bfloat16)
    seen = []
    for w, loud in enumerate([False, True, True, False, False]):  # (loud: a norm far above 100)
        for model, opt in zip((ours, ref), opts):
            for j in range(2):
                (loss_of(model, data[2 * w + j]) * (1e5 if loud else 1.0)).backward()
            opt.step()
            opt.zero_grad()
        assert_equal_runs(ours, opts[0], ref, opts[1], f"window {w}")
        seen.append((offload.committed, offload.redone))
    # committed in 0, put back in 1, no speculation in 2 (after a clip) nor 3 (after a clip),
    # committed in 4 (after 3, which did not clip)
    assert seen == [(1, 0), (1, 1), (1, 1), (1, 1), (2, 1)], seen


def test_a_mid_window_checkpoint_of_an_offloaded_optimizer_resumes_bit_exactly(one_thread):
    model = net(torch.bfloat16)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, accum_steps=3, offload="cpu", backend="cpu")
    run = train(model, opt, 3, 2, dtype=torch.bfloat16)
    next(run), next(run)
    data = batches(2, torch.bfloat16, seed=7)
    loss_of(model, data[0]).div(3).backward()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    twin = net(torch.bfloat16, seed=5)
    twin.load_state_dict(saved[0])
    twin_opt = fused_accum.AdamW(twin.parameters(), lr=1e-2, accum_steps=3, offload="cpu", backend="cpu")
    twin_opt.load_state_dict(saved[1])
    for m, o in ((model, opt), (twin, twin_opt)):
        for _ in range(2):
            loss_of(m, data[1]).div(3).backward()
        o.step()
        o.zero_grad()
    assert_equal_runs(model, opt, twin, twin_opt, "after the resumed window")


def test_bytes_per_parameter_on_the_device_and_on_the_host():
    """bf16 AdamW: the device keeps the 2-byte weight and the 4-byte accumulator (6 B/param); the
    host the fp32 master, the two moments, its copy of the weight, the window's gradient and the
    speculation's backup (4 + 8 + 2 + 4 + 14 = 32 B/param), counted from the buffers."""
    model = nn.Linear(1000, 1000).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    opt = fused_accum.AdamW(model.parameters(), accum_steps=2, offload="cpu", backend="cpu")
    for _ in range(2):
        model(torch.randn(2, 1000).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
    flat = opt._window.flat_groups[0]
    layout = flat.layout
    device = flat.acc.numel() * 4 + sum(p.numel() * p.element_size() for p in model.parameters())
    host = sum(
        t.numel() * t.element_size() for t in [flat.master, *flat.state.values(), layout.host_params, layout.host_acc]
    )
    host += sum(t.numel() * t.element_size() for t in layout.twin.values())
    assert 6 <= device / n < 6.001, device / n  # (slices padded to 64 elements)
    assert 32 <= host / n < 32.01, host / n


def test_what_offload_refuses():
    params = net(torch.bfloat16).parameters
    with pytest.raises(ValueError, match="offload must be"):
        fused_accum.AdamW(params(), offload="nvme")
    with pytest.raises(ValueError, match="a fused algorithm only"):
        fused_accum.FusedAccumOptimizer(params(), torch.optim.RMSprop, offload="cpu", lr=0.1)
    with pytest.raises(ValueError, match="master_weights=False"):
        fused_accum.AdamW(params(), offload="cpu", master_weights=False)
    with pytest.raises(ValueError, match="steps on the host"):
        fused_accum.AdamW(params(), offload="cpu", accum_steps=2, step_in_backward=True)


def test_a_scheduler_between_the_last_backward_and_the_step_is_seen(one_thread):
    """The speculation stepped with the lr of its time; an lr changed before step() (a scheduler
    stepped first) makes it redo the step with the new one, as without offload."""
    ours, ref = net(torch.bfloat16), net(torch.bfloat16)
    opts = [
        fused_accum.AdamW(m.parameters(), lr=1e-2, accum_steps=2, backend="cpu", offload=o)
        for m, o in ((ours, "cpu"), (ref, None))
    ]
    data = batches(6, torch.bfloat16)
    for w in range(3):
        for model, opt in zip((ours, ref), opts):
            for j in range(2):
                loss_of(model, data[2 * w + j]).div(2).backward()
            opt.param_groups[0]["lr"] *= 0.5
            opt.step()
            opt.zero_grad()
    assert_equal_runs(ours, opts[0], ref, opts[1], "after 3 windows")
    assert opts[0]._window.placement.redone > 0


def test_under_ddp_the_offloaded_step_takes_ddps_grad(tmp_path, one_thread):
    """DDP owns .grad (one process, gloo): the offloaded step takes it at step(), without
    speculation, equal to the same DDP run without offload."""

    with one_rank_world(tmp_path):
        ours, ref = net(torch.bfloat16), net(torch.bfloat16)
        ddp, ref_ddp = nn.parallel.DistributedDataParallel(ours), nn.parallel.DistributedDataParallel(ref)
        ours_opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, offload="cpu", backend="cpu")
        ref_opt = fused_accum.AdamW(ref.parameters(), lr=1e-2, backend="cpu")
        data = batches(6, torch.bfloat16)
        for w in range(3):
            for model, opt in ((ddp, ours_opt), (ref_ddp, ref_opt)):
                for j in range(2):
                    loss_of(model, data[2 * w + j]).div(2).backward()
                opt.step()
                opt.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_device_holds_6_bytes_per_param_and_the_forward_waits_for_the_copies(monkeypatch):
    """On a CUDA device (benchmarks/device_check.sh's gpu-matrix stage): the optimizer adds only
    the fp32 accumulator to the device (4 B/param beside the 2-byte bf16 weight); the parameters
    the next forward reads are the host step's, whatever the worker's timing (the compute stream
    waits on the copies' events); and the run stays close to the same optimizer stepping on the
    device (not bit-equal: the device backend's kernels are held to the reference by tolerance,
    tests/test_gpu_kernels.py; a master differs by a few fp32 ulp, a weight by at most 1 bf16 ulp)."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64)).cuda().to(torch.bfloat16)
    ref = copy.deepcopy(ours)
    n = sum(p.numel() for p in ours.parameters())
    # the twin first (its 16 B/param of masters, moments and accumulator on the device), then the
    # offload optimizer alone between the two readings: what it adds to the device
    ref_opt = fused_accum.AdamW(ref.parameters(), lr=1e-3, accum_steps=4, max_grad_norm=0.05)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-3, accum_steps=4, max_grad_norm=0.05, offload="cpu")
    torch.cuda.synchronize()
    after_build = torch.cuda.memory_allocated()
    monkeypatch.setattr(host_module, "WORKER_DELAY", lambda: time.sleep(random.uniform(0, 0.003)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for w in range(5):
        for model, o in ((ours, opt), (ref, ref_opt)):
            gen.manual_seed(1 + w)  # (the same data for both)
            for _ in range(4):
                x = torch.randn(32, 256, device="cuda", generator=gen).to(torch.bfloat16)
                model(x).float().square().mean().div(4).backward()
            o.step()
            o.zero_grad()
        hosts = [opt._window.flat_groups[s.flat_index].layout.host_params[s.local] for s in opt._window.slots]
        for slot, host in zip(opt._window.slots, hosts):  # (read on the compute stream, no sync first)
            assert torch.equal(slot.param.detach().reshape(-1).cpu(), host), slot.name
    added = (after_build - before) / n
    assert added < 4.1, added  # the accumulator, padded to 64 elements per slice, and a few scalars
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=1e-5)  # 1 bf16 ulp
    assert opt._window.placement.committed + opt._window.placement.redone > 0  # it speculated


# --- loops a review found inexact (each against the same optimizer without offload) -----------


def _pair(dtype=torch.bfloat16, cls=fused_accum.AdamW, **kwargs):
    """(model, offloaded optimizer, twin model, its optimizer without offload): one bucket per
    parameter, so a speculation is in flight per parameter."""
    kwargs = dict(dict(lr=1e-2, backend="cpu", bucket_cap_mb=1e-6), **kwargs)
    ours, ref = net(dtype), net(dtype)
    return ours, cls(ours.parameters(), offload="cpu", **kwargs), ref, cls(ref.parameters(), **kwargs)


def _window(model, opt, batch, scale=1.0, before_step=None):
    loss_of(model, batch).mul(scale).backward()
    if before_step is not None:
        before_step(model, opt)
    opt.step()
    opt.zero_grad()


def test_a_backward_that_raised_and_its_retry_step_from_both(one_thread):
    """The raised backward's completed buckets were speculated from its gradient alone; the
    retry adds to them: the speculation is put back when the backward raises."""
    ours, opt, ref, ref_opt = _pair(accum_steps=1)
    data = batches(3, torch.bfloat16)
    for w, batch in enumerate(data):
        for model, o in ((ours, opt), (ref, ref_opt)):
            x, y = batch
            if w == 2:
                RaiseWhenArmed.armed = True
                with pytest.raises(RuntimeError, match="planted error"):
                    loss_of(nn.Sequential(*model[:2], _RaisingLayer(), *model[2:]), (x, y)).backward()
                RaiseWhenArmed.armed = False
            _window(model, o, batch)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")


class _RaisingLayer(nn.Module):
    def forward(self, x):
        return RaiseWhenArmed.apply(x)


def test_a_state_reset_or_a_momentum_turned_on_before_a_redone_window(one_thread):
    """prepare_step takes a user's new entry (or restarts a buffer) before the speculation:
    a put-back restores the counts it started from, not those of before."""
    ours, opt, ref, ref_opt = _pair(accum_steps=1, max_grad_norm=0.5)
    for w, batch in enumerate(batches(4, torch.bfloat16)):
        for model, o in ((ours, opt), (ref, ref_opt)):
            if w == 2:
                for p in model.parameters():
                    o.state[p] = {}  # torch: the state starts afresh
            _window(model, o, batch, scale=100.0 if w == 2 else 0.01)  # (window 2 clips: put back)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    ours, opt, ref, ref_opt = _pair(cls=fused_accum.SGD, accum_steps=1, lr=0.05, momentum=0.0, dampening=0.3)
    for w, batch in enumerate(batches(4, torch.bfloat16)):
        for model, o in ((ours, opt), (ref, ref_opt)):
            if w == 2:
                o.param_groups[0]["momentum"] = 0.9

            def schedule(model, o, w=w):
                if w == 2:
                    o.param_groups[0]["lr"] = 0.04  # (a scheduler after the last backward: redone)

            _window(model, o, batch, before_step=schedule)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")


def _halve_grad(p) -> None:
    p.grad.mul_(0.5)


def test_a_post_accumulate_grad_hook_that_edits_grad_is_seen(one_thread):
    """The hook edits .grad (the running sum) after the bucket's fold: such a bucket does not
    speculate."""
    ours, opt, ref, ref_opt = _pair(accum_steps=1)
    for model in (ours, ref):
        model[0].weight.register_post_accumulate_grad_hook(_halve_grad)
    for w, batch in enumerate(batches(3, torch.bfloat16)):
        for model, o in ((ours, opt), (ref, ref_opt)):
            _window(model, o, batch)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    assert opt._window.placement.committed > 0  # (the other buckets still speculate)


def test_a_checkpoint_between_the_last_backward_and_step_holds_the_state_before_the_step(one_thread):
    ours, opt, ref, ref_opt = _pair(accum_steps=1)
    data = batches(3, torch.bfloat16)
    for model, o in ((ours, opt), (ref, ref_opt)):
        _window(model, o, data[0])
        loss_of(model, data[1]).backward()
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    for (i, entry), (j, ref_entry) in zip(sorted(saved["state"].items()), sorted(ref_saved["state"].items())):
        assert i == j and sorted(entry) == sorted(ref_entry)
        assert all(torch.equal(entry[k], ref_entry[k]) for k in entry), i
    for model, o in ((ours, opt), (ref, ref_opt)):
        o.step()
        o.zero_grad()
        _window(model, o, data[2])
    assert_equal_runs(ours, opt, ref, ref_opt, "after the window checkpointed before its step")


def test_the_state_between_the_last_backward_and_step_is_the_state_before_the_step(one_thread):
    """The speculation steps into the twins: between the window's last backward and step(),
    opt.state shows the state before the step (step counts included), as without offload; an
    in-place edit of it there (a moment zeroed, a step count set) or an entry assigned there is
    what the step reads: those buckets step again from it, bit for bit as without offload."""
    ours, opt, ref, ref_opt = _pair(accum_steps=1)
    data = batches(5, torch.bfloat16)
    for w, batch in enumerate(data):
        for model, o in ((ours, opt), (ref, ref_opt)):
            loss_of(model, batch).backward()
            if w == 2:
                o.state[model[0].weight]["exp_avg"].zero_()
                o.state[model[0].bias]["step"].fill_(10.0)
            if w == 3:
                entry = o.state[model[0].weight]
                o.state[model[0].weight] = {k: v.clone() * (2 if k == "exp_avg_sq" else 1) for k, v in entry.items()}
        for p, q in zip(ours.parameters(), ref.parameters()) if w else ():  # (what each shows)
            mine, theirs = opt.state[p], ref_opt.state[q]
            assert sorted(mine) == sorted(theirs)
            assert all(torch.equal(mine[k].cpu(), theirs[k].cpu()) for k in mine), (w, sorted(mine))
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    offload = opt._window.placement
    assert offload.committed > 0 and offload.redone > 0  # (windows 2 and 3 redo a flat group)


def test_a_step_pre_hook_turns_speculation_off(one_thread):
    ours, opt, ref, ref_opt = _pair(accum_steps=1)

    def halve_the_moments(o, args, kwargs):  # a hook that edits the state before each step
        for entry in o.state.values():
            entry["exp_avg"].mul_(0.5)

    for o in (opt, ref_opt):
        o.register_step_pre_hook(halve_the_moments)
    for w, batch in enumerate(batches(3, torch.bfloat16)):
        for model, o in ((ours, opt), (ref, ref_opt)):
            _window(model, o, batch)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    assert opt._window.placement.committed == opt._window.placement.redone == 0


def test_an_edit_through_data_of_a_parameter_that_is_its_own_master_is_kept(one_thread):
    """WGAN's clamp through .data moves no version counter; without offload the step reads the
    fp32 parameter itself, so with offload its host copy is fetched before each step."""
    ours, opt, ref, ref_opt = _pair(dtype=torch.float32, accum_steps=1)
    for w, batch in enumerate(batches(4, torch.float32)):
        for model, o in ((ours, opt), (ref, ref_opt)):
            _window(model, o, batch)
            for p in model.parameters():
                p.data.clamp_(-0.05, 0.05)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")


def test_tensor_betas_changed_in_place_redo_the_speculation(one_thread):
    betas = lambda: (torch.tensor(0.9), torch.tensor(0.999))  # noqa: E731
    ours, opt, ref, ref_opt = _pair(accum_steps=1, betas=betas())
    for w, batch in enumerate(batches(3, torch.bfloat16)):
        for model, o in ((ours, opt), (ref, ref_opt)):

            def change(model, o, w=w):
                if w == 1:
                    o.param_groups[0]["betas"][0].fill_(0.5)

            _window(model, o, batch, before_step=change)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")


def test_a_failed_host_task_puts_the_speculation_back(monkeypatch, one_thread):
    """The worker raised before one bucket's task: step() raises it, puts every speculated
    bucket back, and the next step() steps the window as if nothing had been speculated."""
    ours, opt, ref, ref_opt = _pair(accum_steps=1)
    data = batches(2, torch.bfloat16)
    for model, o in ((ours, opt), (ref, ref_opt)):
        _window(model, o, data[0])
    calls = []

    def fail_the_third():
        calls.append(1)
        if len(calls) == 3:
            raise OSError("planted")

    monkeypatch.setattr(host_module, "WORKER_DELAY", fail_the_third)
    loss_of(ours, data[1]).backward()
    with pytest.raises(RuntimeError, match="the host step failed"):
        opt.step()
    monkeypatch.setattr(host_module, "WORKER_DELAY", None)
    opt.step()
    opt.zero_grad()
    _window(ref, ref_opt, data[1])
    assert_equal_runs(ours, opt, ref, ref_opt, "after the failed and the repeated step")


def test_a_compiled_model_trains_alike_with_and_without_offload(one_thread):
    """torch.compile of the model (aot_eager: the same graph capture as inductor, without its
    C++ compile): the hooks see the compiled backward's gradients as they do eager ones."""
    ours, opt, ref, ref_opt = _pair(accum_steps=2, max_grad_norm=1e6)
    compiled = [torch.compile(m, backend="aot_eager") for m in (ours, ref)]
    data = batches(6, torch.bfloat16)
    for w in range(3):
        for model, o in zip(compiled, (opt, ref_opt)):
            for j in range(2):
                loss_of(model, data[2 * w + j]).div(2).backward()
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    assert opt._window.placement.committed > 0


def test_every_host_step_is_out_of_place_and_the_slots_that_did_not_step_are_carried_over(monkeypatch, one_thread):
    """Every host step of a flat group that has twins (made by its first speculation) reads the
    live buffers and writes their twins (ops.StepTensors.sources: the master, the weight copy
    and both moments of each stepped slot), speculated or not: a window that did not speculate
    too, so that a step() that fails leaves nothing of it. A window that used some of the
    parameters speculates on their buckets (one parameter per bucket here): the step redoes them
    (num_items) from the live buffers, untouched; the others did not step, and are carried over
    into the twins before the swap. Against the same optimizer without offload, bit for bit."""
    from fused_accum import ops

    def model():
        torch.manual_seed(0)
        return nn.ModuleDict(dict(a=nn.Linear(6, 3), b=nn.Linear(6, 3))).to(torch.bfloat16)

    ours, ref = model(), model()
    keywords = dict(lr=1e-2, accum_steps=2, backend="cpu", bucket_cap_mb=1e-5)
    opt = fused_accum.AdamW(ours.parameters(), offload="cpu", **keywords)
    ref_opt = fused_accum.AdamW(ref.parameters(), **keywords)
    assert len(opt._window.flat_groups[0].buckets) == 4
    backed_up = []
    real_call = ops.StepOp.__call__

    def call(op, t, *args, **kwargs):
        if t.sources:
            backed_up.append((len(t.sources), len(t.params)))
        return real_call(op, t, *args, **kwargs)

    monkeypatch.setattr(ops.StepOp, "__call__", call)
    data = batches(6, torch.bfloat16)
    for w, (used, num_items) in enumerate([("ab", None), ("a", 4.0), ("ab", None)]):
        for m, o in ((ours, opt), (ref, ref_opt)):
            for j in range(2):
                x, y = data[2 * w + j]
                (sum(m[name](x) for name in used).float() - y).square().mean().backward()
            o.step(num_items=num_items)
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    offload = opt._window.placement
    assert (offload.committed, offload.redone) == (4, 2)  # window 0's 4 buckets committed, window 1's 2 redone
    # (master, weight, exp_avg, exp_avg_sq) of its one slot, per bucket: window 0's 4 speculated,
    # window 1's 2 speculated and 2 redone, window 2's 4 (only watched after a redo) at step()
    assert backed_up == [(4, 1)] * 12


# --- a step() that fails on the host --------------------------------------------------------


def _two_groups(dtype=torch.bfloat16, offload="cpu", **kwargs):
    """(model, optimizer): the first Linear in a param group of its own (a flat group of its
    own), one bucket per parameter."""
    model = net(dtype)
    groups = [dict(params=list(model[0].parameters())), dict(params=list(model[2:].parameters()))]
    kwargs = dict(dict(lr=1e-2, backend="cpu", bucket_cap_mb=1e-6, accum_steps=2), **kwargs)
    return model, fused_accum.AdamW(groups, offload=offload, **kwargs)


def _fail_task(n):
    """A WORKER_DELAY that raises before the worker's n-th task."""
    calls = []

    def delay():
        calls.append(1)
        if len(calls) == n:
            raise OSError("planted")

    return delay


def _snapshot(model, opt) -> list:
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in state_of(opt)]


def _before_the_failing_step(case):
    """Two flat groups (ours and the same without offload), trained into ``case``'s window up
    to just before its step(): "committed" (its speculation is the step), "redone" (an lr set
    after its last backward: its buckets step again at step()), "not speculated" (after a
    window stepped with num_items: stepped at step(), out of place into the twins its first
    window made)."""
    (ours, opt), (ref, ref_opt) = _two_groups(), _two_groups(offload=None)
    data = batches(6, torch.bfloat16)
    for w in range(3):
        for model, o in ((ours, opt), (ref, ref_opt)):
            for j in range(2):
                loss_of(model, data[2 * w + j]).div(2).backward()
            if w == 2 and case == "redone":
                o.param_groups[1]["lr"] = 5e-3
            if w < 2:
                o.step(num_items=2.0 if case == "not speculated" and w == 1 else None)
                o.zero_grad()
    return ours, opt, ref, ref_opt


@pytest.mark.parametrize("case", ["committed", "redone", "not speculated"])
def test_a_step_that_fails_on_the_host_leaves_weights_state_and_counts_as_they_were(case, monkeypatch, one_thread):
    """The worker fails before its n-th task of step(), for every n: step() raises, and every
    weight, master, moment and step count is as before it (a redone bucket's count included,
    and no twin swapped in: nothing runs after the failed task); the step() after it trains as
    the same optimizer without offload, bit for bit. Until n is past step()'s tasks."""
    for n in range(1, 100):
        ours, opt, ref, ref_opt = _before_the_failing_step(case)
        before = _snapshot(ours, opt)
        monkeypatch.setattr(host_module, "WORKER_DELAY", _fail_task(n))
        try:
            opt.step()
        except RuntimeError as error:
            assert "the host step failed" in str(error)
        else:
            break
        finally:
            monkeypatch.setattr(host_module, "WORKER_DELAY", None)
        for i, (now, then) in enumerate(zip(_snapshot(ours, opt), before)):
            assert torch.equal(now, then), f"task {n} failed: tensor {i} changed"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"the step after task {n} failed")
    ref_opt.step()
    assert_equal_runs(ours, opt, ref, ref_opt, "a step that did not fail")
    assert n == {"committed": 2, "redone": 6, "not speculated": 8}[case]  # (each of its tasks failed once)


def test_a_step_that_fails_where_nothing_speculated_says_its_steps_stand(monkeypatch, one_thread):
    """Without accum_steps nothing speculates, so the flat groups keep no twins and step in
    place: a failed host task cannot be undone, and step() says so."""
    ours, opt = _two_groups(accum_steps=None)
    loss_of(ours, batches(1, torch.bfloat16)[0]).backward()
    monkeypatch.setattr(host_module, "WORKER_DELAY", _fail_task(2))
    with pytest.raises(RuntimeError, match=r"flat groups \[0, 1\] step in place .* part of their step stands"):
        opt.step()


# --- the user's storage: opt.state shared or viewed from outside ------------------------------


def _share_first_group(model, opt) -> list:
    for p in model[0].parameters():  # A3C's SharedAdam: the state moved into shared memory
        for value in opt.state[p].values():
            value.share_memory_()
    return []


def _view_first_weight(model, opt) -> list:
    return [opt.state[model[0].weight]["exp_avg"].numpy()]  # (a NumPy view keeps the address)


@pytest.mark.parametrize("hold", [_share_first_group, _view_first_weight], ids=["share_memory", "numpy"])
def test_opt_state_moved_to_shared_memory_or_viewed_by_numpy_keeps_following_the_state(hold, one_thread):
    """After the first step the user shares the first group's state (share_memory_(), as
    A3C's SharedAdam does) or keeps a NumPy view of a moment: every later step() trains as
    without offload, and what the user holds follows opt.state (the commit copies the twins into
    that memory instead of swapping it away); the other flat group's buffers are still swapped
    (their memory alternates with their twins')."""
    (ours, opt), (ref, ref_opt) = _two_groups(), _two_groups(offload=None)
    data = batches(10, torch.bfloat16)
    held, ref_held, addresses = [], [], []
    for w in range(5):
        for model, o in ((ours, opt), (ref, ref_opt)):
            for j in range(2):
                loss_of(model, data[2 * w + j]).div(2).backward()
            o.step()
            o.zero_grad()
        if w == 0:
            held, ref_held = hold(ours, opt), hold(ref, ref_opt)
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
        for mine, theirs in zip(held, ref_held):
            assert (mine == theirs).all(), f"window {w}: the NumPy view stopped following"
        for p in ours[0].parameters() if hold is _share_first_group else ():
            assert all(v.is_shared() for k, v in opt.state[p].items() if k != "step"), w
        if w:
            addresses.append({(f.index, k): b.data_ptr() for f in opt._window.flat_groups for k, b in f.state.items()})
    # the memory the user holds stays where it is; every other buffer's alternates with its
    # twin's (swapped at each commit)
    held_buffers = [(0, "exp_avg"), (0, "exp_avg_sq")] if hold is _share_first_group else [(0, "exp_avg")]
    for key in addresses[0]:
        assert len({a[key] for a in addresses}) == (1 if key in held_buffers else 2), key
    assert opt._window.placement.committed > 0


# --- what the speculation read, changed after the last backward ------------------------------


def _swap_weight_rows(model, opt):
    w = model[0].weight
    w.data[[0, 1]] = w.data[[1, 0]]  # (same values, other places: the sums without position agree)


def _swap_grad_rows(model, opt):
    g = model[0].weight.grad
    g.data[[0, 1]] = g.data[[1, 0]]


def _new_weight_storage(model, opt):
    w = model[0].weight
    w.data = w.data.clone().mul_(0.5)  # (the kept alias still reads the old storage)


def _clear_one_grad(model, opt):
    model[2].bias.grad = None  # torch: this parameter is not stepped


@pytest.mark.parametrize(
    "edit",
    [_swap_weight_rows, _swap_grad_rows, _new_weight_storage, _clear_one_grad],
    ids=lambda f: f.__name__.strip("_"),
)
def test_what_the_speculation_read_changed_after_the_last_backward(edit, one_thread):
    """Between the window's last backward and step(), the user swaps two rows of a weight or of
    its .grad through .data (no counter moves), gives a weight new storage, or clears a .grad:
    the speculation read what was there before, so its bucket steps again (bit for bit as
    without offload)."""
    ours, opt, ref, ref_opt = _pair(accum_steps=2)
    data = batches(8, torch.bfloat16)
    for w in range(4):
        for model, o in ((ours, opt), (ref, ref_opt)):
            for j in range(2):
                loss_of(model, data[2 * w + j]).div(2).backward()
            if w in (1, 3):
                edit(model, o)
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    assert opt._window.placement.redone >= 2  # (the edited bucket, in windows 1 and 3)


STATE_EDITS = {
    "step": lambda entry: entry["step"].add_(10.0),
    "exp_avg": lambda entry: entry["exp_avg"].mul_(0.5),
}


# guards: HostLayout.versions reading only the state buffers, not flat.steps (whose 0-d views
# are opt.state[p]["step"]): an edit of the step count after the host stepped it speculatively
# would be silently overwritten (committed) instead of stepped from.
@pytest.mark.parametrize("edit", list(STATE_EDITS))
def test_an_in_place_edit_of_the_step_count_after_the_last_backward_is_stepped_from_as_of_exp_avg(edit, one_thread):
    """A first full window, then the second's backwards, ``edit`` on opt.state (of both
    optimizers), step(): the edit is what the step reads, as without offload, bit for bit (the
    host stepped the window speculatively into the twins, from the state before the edit: the
    edit is seen, through the version counters, and those buckets step again)."""
    k = 2
    ours, opt, ref, ref_opt = _pair(accum_steps=k)  # a speculation per parameter
    data = batches(2 * k, torch.bfloat16, seed=5)
    for model, o in ((ours, opt), (ref, ref_opt)):
        for batch in data[:k]:  # a first full window: opt.state's entries exist
            loss_of(model, batch).div(k).backward()
        o.step()
        o.zero_grad()
        for batch in data[k:]:  # the second window's backwards, its last included
            loss_of(model, batch).div(k).backward()
    weight, ref_weight = ours[0].weight, ref[0].weight
    assert set(opt.state[weight]) == {"step", "exp_avg", "exp_avg_sq"}
    redone = opt._window.placement.redone
    for o, w in ((opt, weight), (ref_opt, ref_weight)):
        STATE_EDITS[edit](o.state[w])
        o.step()
    assert opt._window.placement.redone > redone, edit  # (the window had speculated)
    assert_equal_runs(ours, opt, ref, ref_opt, edit)


@pytest.mark.parametrize("to", [torch.float16, torch.float32], ids=str)
def test_a_model_cast_after_windows_that_speculated(to, one_thread):
    """bf16 windows that speculated (their twins made for bf16 host copies and fp32 masters),
    then the model cast: the host copies, their twins and the masters follow the new dtype (an
    fp16 weight's bytes are a bf16's size: a twin kept from before would be swapped in and read
    as fp16), as without offload."""
    ours, opt, ref, ref_opt = _pair(accum_steps=2)
    data = batches(8, torch.bfloat16)
    for w in range(4):
        if w == 2:
            ours.to(to), ref.to(to)
        for model, o in ((ours, opt), (ref, ref_opt)):
            for j in range(2):
                x, y = data[2 * w + j]
                loss_of(model, (x.to(model[0].weight.dtype), y)).div(2).backward()
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
    assert opt._window.placement.committed > 6  # (after the cast too)


def test_the_middle_backwards_run_quietly_up_to_the_last_one(monkeypatch, one_thread):
    """The C++ hooks run a window's middle backwards without Python (quietly) while nothing
    changes; under offload the last backward must reach Python (its buckets are stepped as they
    complete), so the budget of quiet backwards is counted from the window's start: k = 4 has 2
    (its 2nd and 3rd), the hooks' running total 2, 4, 6 after 3 windows; each window still
    speculated and committed, bit for bit as without offload."""
    monkeypatch.delenv("FUSED_ACCUM_PYTHON_HOOKS", raising=False)
    if not hasattr(ext._C, "Arrivals"):
        pytest.skip("the C++ hooks are not built")
    ours, opt, ref, ref_opt = _pair(accum_steps=4)
    assert opt._window.ledger.fast is not None  # (the C++ table)
    data = batches(12, torch.bfloat16)
    quiet = []
    for w in range(3):
        for model, o in ((ours, opt), (ref, ref_opt)):
            for j in range(4):
                loss_of(model, data[4 * w + j]).div(4).backward()
            o.step()
            o.zero_grad()
        assert_equal_runs(ours, opt, ref, ref_opt, f"window {w}")
        quiet.append(int(opt._window.ledger.changes[1]))
    assert quiet == [2, 4, 6]
    assert opt._window.placement.committed == 3 * 6  # (each window's 6 buckets)
