"""The CPU step kernels on torch's intra-op threads, from the main thread and from a worker thread
(what offload's host step runs on: fused_accum/offload.py, ``_Worker``), and the AdamW loop's
divide by the bias correction (csrc/cpu/kernels.cpp: ``DivideByConstant``) bit for bit.

The kernels split their elements with at::parallel_for, whose team is the calling thread's
OpenMP thread count. torch sets that count once per thread, at the thread's first parallel call,
from torch.set_num_threads's value then: a thread that called a kernel before a later
torch.set_num_threads keeps its old count until torch.set_num_threads runs on that thread.
The extension counts the distinct threads that ran the last call's ranges (a test hook,
``fused_accum_cpu_last_call_threads``, read here through ctypes). No timing: which threads ran
and which bits came out are deterministic.
"""

from __future__ import annotations

import ctypes
import queue
import threading

import pytest
import torch

from fused_accum import backends, ops
from fused_accum.backends import ext, reference

if backends.availability("cpu", "cpu"):
    pytestmark = pytest.mark.skip(reason=f"the C++ extension is not built: {ext.unavailable_reason('cpu')}")

GRAIN = 1 << 16  # csrc/cpu/kernels.cpp's kGrain: at::parallel_for gives each thread at least this many
N = 4 * GRAIN + 333  # elements: more than two ranges, and a tail


def _last_call_threads() -> int:
    fn = ctypes.CDLL(ext._C.__file__).fused_accum_cpu_last_call_threads
    fn.restype = ctypes.c_int
    return fn()


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _records(algo: str, masters: str, seed: int = 0):
    """One step's arguments: a large tensor and a small one, fp32 masters ("fp32"), fp32 masters
    with bf16 weights ("bf16_lp") or bf16 weights with int16 remainders ("remainder")."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (N, 1000)
    params = [torch.randn(n, generator=gen) for n in sizes]
    accs = [torch.randn(n, generator=gen) for n in sizes]
    lp, rem = [], []
    if masters == "bf16_lp":
        lp = [p.to(torch.bfloat16) for p in params]
    elif masters == "remainder":
        pairs = [reference.split_master(p) for p in params]
        params, rem = [w for w, _ in pairs], [r for _, r in pairs]
    t = ops.StepTensors(
        params,
        accs,
        torch.full((len(sizes),), 3.0),
        torch.tensor(1e-3, dtype=torch.float64),
        torch.tensor(0.5),
        lp_params=lp,
        remainders=rem,
    )
    if algo == "adam":
        states = ops.adam_step.states(
            [torch.rand(n, generator=gen) for n in sizes], [torch.rand(n, generator=gen) for n in sizes]
        )
        return t, states, ops.adam_step.hyper(0.9, 0.999, 1e-8, 0.01, True, False)
    states = ops.lion_step.states([torch.randn(n, generator=gen) for n in sizes])
    return t, states, ops.lion_step.hyper(0.9, 0.99, 0.01, False)


def _written(records):
    t, states, _ = records
    return [x.clone() for x in (*t.params, *t.lp_params, *t.remainders, *[s for lst in states for s in lst])]


def _step(algo: str, records):
    cpu = backends.get("cpu")
    cpu.step(ops.adam_step if algo == "adam" else ops.lion_step, *records)
    return _last_call_threads()


def _in_new_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


class _Worker:
    """One persistent thread that runs functions in order, as offload's _Worker does."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            fn = self.jobs.get()
            if fn is None:
                return
            self.results.put(fn())

    def call(self, fn):
        self.jobs.put(fn)
        return self.results.get()

    def stop(self):
        self.jobs.put(None)
        self.thread.join()


@pytest.mark.parametrize(
    "algo, masters", [("adam", "fp32"), ("adam", "bf16_lp"), ("adam", "remainder"), ("lion", "fp32")]
)
def test_a_worker_thread_steps_on_two_threads_bit_for_bit_as_one(algo, masters):
    """From a fresh thread with torch.set_num_threads(2), the step's ranges run on 2 threads, and
    the step writes the bits it writes on 1 thread from the main thread."""
    torch.set_num_threads(1)
    one = _records(algo, masters)
    assert _step(algo, one) == 1
    torch.set_num_threads(2)
    two = _records(algo, masters)
    assert _in_new_thread(lambda: (torch.get_num_threads(), _step(algo, two))) == (2, 2)
    for got, want in zip(_written(two), _written(one)):
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_the_main_thread_steps_on_two_threads():
    torch.set_num_threads(2)
    assert _step("adam", _records("adam", "fp32")) == 2
    torch.set_num_threads(1)
    assert _step("adam", _records("adam", "fp32")) == 1


def test_a_persistent_worker_keeps_its_count_until_it_sets_it():
    """Why offload's worker must call torch.set_num_threads itself: a thread that ran a parallel
    call at 1 thread stays at 1 after the main thread's torch.set_num_threads(2), until
    torch.set_num_threads runs on it."""
    worker = _Worker()
    try:
        torch.set_num_threads(1)
        assert worker.call(lambda: _step("adam", _records("adam", "fp32"))) == 1
        torch.set_num_threads(2)
        assert worker.call(lambda: (torch.get_num_threads(), _step("adam", _records("adam", "fp32")))) == (1, 1)

        def set_then_step():
            torch.set_num_threads(2)
            return torch.get_num_threads(), _step("adam", _records("adam", "fp32"))

        assert worker.call(set_then_step) == (2, 2)
    finally:
        worker.stop()


def test_accumulate_counts_its_threads_too():
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(N, generator=gen)]
    acc = torch.zeros(N)
    ops.accumulate(acc, torch.tensor([0], dtype=torch.int64), grads, 1.0, True, None, None, "cpu")
    assert _last_call_threads() == 2


def _special_values(n: int, gen) -> torch.Tensor:
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1e-38, 3e38, -3e38, 1e19, 1e-22]
    )
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
    x[: len(specials)] = specials
    x[len(specials) : 2 * len(specials)] = specials.flip(0)
    return x


@pytest.mark.parametrize("beta2", [0.999, 0.95, 0.9999999])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_divide_by_the_bias_correction_matches_the_reference_bit_for_bit(beta2, amsgrad):
    """The AVX-512 loops divide sqrt(v) by the bias correction with a reciprocal and two FMA
    corrections: the same bits as the divide, over steps 1..40 and 5,000 (the bias correction
    from far below 1 to 1), on gradients, moments and params with zeros, infinities, NaNs,
    subnormals and huge values, amsgrad or not (there a NaN is any NaN: the running max's NaN
    pattern is not the reference's, divide or not)."""
    n = 4099
    for step in [*range(1, 41), 5000]:
        gen = torch.Generator().manual_seed(step)
        grad, param = _special_values(n, gen), _special_values(n, gen)
        m, v = _special_values(n, gen), _special_values(n, gen).abs()
        v[:2] = torch.tensor([-0.0, float("nan")])  # -0.0: not from a step, but the kernel must agree
        outs = []
        for backend in ("cpu", "reference"):
            t = ops.StepTensors(
                [param.clone()],
                [grad.clone()],
                torch.tensor([float(step)]),
                torch.tensor(1e-3, dtype=torch.float64),
                torch.tensor(1.0),
            )
            states = ops.adam_step.states([m.clone()], [v.clone()], [v.clone() * 1.5] if amsgrad else [])
            backends.get(backend).step(
                ops.adam_step, t, states, ops.adam_step.hyper(0.9, beta2, 1e-8, 0.01, True, False)
            )
            outs.append([t.params[0], *states.exp_avgs, *states.exp_avg_sqs, *states.max_exp_avg_sqs])
        for got, want in zip(*outs):
            same = got.view(torch.int32) == want.view(torch.int32)
            if amsgrad:  # torch.maximum makes its own NaN pattern (0xFFFFFFFF), the kernel keeps one
                same |= got.isnan() & want.isnan()
            assert bool(same.all()), step


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_over_4m_elements_on_two_threads_matches_the_reference_bit_for_bit(amsgrad):
    """A large call (16K-element blocks: csrc/cpu/kernels.cpp's kUnstagedBlock) on two threads:
    the same bits as the reference, across tensors whose sizes are not multiples of a block or a
    vector, with tensors smaller than one."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(3)
    sizes = ((1 << 22) - 1000, 1013, 77)
    params = [torch.randn(n, generator=gen) for n in sizes]
    accs = [torch.randn(n, generator=gen) for n in sizes]
    ms = [torch.randn(n, generator=gen) for n in sizes]
    vs = [torch.rand(n, generator=gen) for n in sizes]
    outs = []
    for backend in ("cpu", "reference"):
        t = ops.StepTensors(
            [p.clone() for p in params],
            [a.clone() for a in accs],
            torch.tensor([7.0, 7.0, 2.0]),
            torch.tensor(1e-3, dtype=torch.float64),
            torch.tensor(0.25),
        )
        states = ops.adam_step.states(
            [m.clone() for m in ms], [v.clone() for v in vs], [v * 1.25 for v in vs] if amsgrad else []
        )
        backends.get(backend).step(ops.adam_step, t, states, ops.adam_step.hyper(0.9, 0.999, 1e-8, 0.01, True, False))
        outs.append([*t.params, *states.exp_avgs, *states.exp_avg_sqs, *states.max_exp_avg_sqs])
    for got, want in zip(*outs):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_offloads_worker_runs_with_the_submitters_thread_count():
    # fused_accum.host.Worker (offload's host steps): each task carries the intra-op thread
    # count of the thread that submitted it, so a torch.set_num_threads after the worker's first
    # task still reaches the host step (it kept its first count: the persistent worker above).
    from fused_accum.host import Worker

    before = torch.get_num_threads()
    worker = Worker()
    seen = []
    try:
        torch.set_num_threads(1)
        worker.submit(lambda: seen.append(torch.get_num_threads()))
        worker.drain()
        torch.set_num_threads(2)
        worker.submit(lambda: seen.append(torch.get_num_threads()))
        worker.drain()
    finally:
        worker.stop()
        torch.set_num_threads(before)
    assert seen == [1, 2]
