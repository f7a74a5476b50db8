"""shard="grads" with reduce_dtype="exact" (issue 38): the gradients go on the wire in their own
dtype and each rank folds the ranks' pieces of its shard in rank order, so N gloo ranks running
k micro-batches each train bit for bit as one process running the N x k micro-batches in the
order (micro-batch j, rank r) and stepping with ``num_items=N`` (the ranks' mean), or with the
ranks' summed ``num_items``.

One spawn of 4 processes runs every world size: groups of ranks [0], [0, 1], [0, 1, 2] and
[0, 1, 2, 3] (spawning costs seconds each). Each group trains every case (every fused algorithm;
clipping with a skipped non-finite window; ``num_items`` with the remainder mode), saves the
weights, the gathered state (masters, remainders, moments, step counts) and the norms; the parent
runs the one process (``reduce_dtype="exact"`` without a process group: the same norm) and
compares the bits. The same spawn counts the collectives' bytes (through the module's
``_all_to_all`` and ``_reduce_scatter``) and resumes, at N = 2, from a gathered checkpoint taken
at N = 4 and passed through torch.distributed.checkpoint's storage.

The model is bf16, its inputs spread over 2^-8 .. 2^8 (so the order of the fp32 adds shows), one
parameter only receives gradients from rank 0's micro-batches (the others send -0.0, the additive
identity), the sizes divide by nothing, and buckets are small (several per flat group).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import cases  # tests/cases.py: every algorithm, its cases, the modes it runs in
import fused_accum
import fused_accum.distributed as fd
from helpers import spawn_ranks  # tests/helpers.py

K, WINDOWS, SIZES = 2, 3, (1, 2, 3, 4)
CAP = 2e-3  # MB: a few buckets per flat group
ALGORITHMS = {c.algorithm: c.kwargs for c in cases.cases(cases.EXACT_WIRE)}  # each one's default case
# name: (algorithm, optimizer keywords, loss reduction, step's num_items, parameters' dtype)
CLIP_SKIP = dict(max_grad_norm=0.5, skip_nonfinite=True)
ITEMS_REMAINDER = dict(master_weights="remainder", max_grad_norm=50.0)
CASES = {
    **{f"{name}_clip_skip": (name, CLIP_SKIP, "mean", False, torch.bfloat16) for name in ALGORITHMS},
    **{f"{name}_items_remainder": (name, ITEMS_REMAINDER, "sum", True, torch.bfloat16) for name in ALGORITHMS},
    # fp32 gradients go on the wire in fp32
    "adamw_fp32_clip": ("adamw", dict(max_grad_norm=0.5), "mean", False, torch.float32),
}
NONFINITE = (1, 0)  # (window, micro-batch): the last rank's input holds an inf there (clip_skip)


class Net(nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(29, 67), nn.GELU(), nn.Linear(67, 5))
        self.rank0_only = nn.Linear(29, 5)  # only rank 0's micro-batches use it
        self.to(dtype)

    def forward(self, x, rank):
        out = self.body(x)
        return out + self.rank0_only(x) if rank == 0 else out


class Reentrant(nn.Module):
    """``inner`` runs inside and outside a reentrant checkpoint: its gradient arrives twice in a
    backward, the second time after its bucket's collective was launched."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self.inner(t).tanh(), x, use_reentrant=True)
        return self.inner(h) + self.outer(h)


def reentrant_run(rank, world, **extra):
    model = Reentrant()
    opt = fused_accum.SGD(model.parameters(), lr=1e-2, bucket_cap_mb=25.0, **extra)
    for micro in range(K):
        ranks = range(world) if "process_group" not in extra else [rank]
        for r in ranks:
            gen = torch.Generator().manual_seed(10 * r + micro)
            x = torch.randn(4, 8, generator=gen).requires_grad_()
            model(x).pow(2).sum().backward()
    opt.step(num_items=world if "process_group" not in extra else None)
    return [p.detach().clone() for p in model.parameters()]


class NegativeZero(nn.Module):
    """bf16; ``gate``'s gradient is -0.0 in every element, and only rank 0's micro-batches give
    it one; it shares its bucket with ``body``, which every rank's do. -0.0 is the additive
    identity only: a rank without a gradient must add -0.0 (one process's sum of rank 0's
    gradients is -0.0; +0.0 added makes it +0.0, which SGD's step turns into a -0.0 weight where
    -0.0 gives +0.0: -0.0 - lr x -0.0 = +0.0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 3)
        self.gate = nn.Parameter(torch.full((5,), -0.0))
        self.to(torch.bfloat16)

    def loss(self, rank, micro):
        gen = torch.Generator().manual_seed(10 * rank + micro)
        x = torch.randn(4, 6, generator=gen).to(torch.bfloat16)
        loss = self.body(x).float().square().sum()
        if rank == 0:  # d/d gate of (gate * -0.0).sum(): -0.0, elementwise (no reduction)
            loss = loss + (self.gate * torch.full((5,), -0.0, dtype=torch.bfloat16)).float().sum()
        return loss


def negative_zero_run(rank, world, **extra):
    """NegativeZero, SGD (no momentum, no decay), one window of K micro-batches per rank (one
    process: every rank's, in the order (micro-batch j, rank r)); the parameters' bits."""
    model = NegativeZero()
    opt = fused_accum.SGD(model.parameters(), lr=0.5, bucket_cap_mb=25.0, **extra)
    ranks = [rank] if "process_group" in extra else range(world)
    for micro in range(K):
        for r in ranks:
            model.loss(r, micro).backward()
    opt.step(num_items=None if "process_group" in extra else world)
    return [p.detach().clone() for p in model.parameters()]


class ReentrantFirst(nn.Module):
    """bf16; ``inner`` runs inside and outside a reentrant checkpoint; with FIRST_CAP the buckets
    are [inner, outer] and [first] (buckets launch in reverse registration order: [first]'s
    first), and ``first``, registered last, runs first: its gradient arrives last. The [inner,
    outer] bucket is complete after inner's outer piece but waits for [first] (the fixed order),
    so inner's reentrant piece is staged into the same buffer before launch: a sum no bf16 holds,
    which must go on the wire in fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer, self.first = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 8)
        self.to(torch.bfloat16)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self.inner(t).tanh(), self.first(x), use_reentrant=True)
        return self.inner(h) + self.outer(h)


FIRST_CAP = 1.25e-4  # MB: 32 elements (first: 72 alone; outer 9 + inner 72 together)


def reentrant_first_run(rank, world, **extra):
    """ReentrantFirst, SGD with fp32 masters, one window of K micro-batches per rank; the fp32
    update of every parameter (master after - weight before), gathered."""
    model = ReentrantFirst()
    before = [p.detach().float() for p in model.parameters()]
    opt = fused_accum.SGD(model.parameters(), lr=1.0, bucket_cap_mb=FIRST_CAP, master_weights=True, **extra)
    ranks = [rank] if "process_group" in extra else range(world)
    for micro in range(K):
        for r in ranks:
            gen = torch.Generator().manual_seed(10 * r + micro)
            model(torch.randn(4, 8, generator=gen).to(torch.bfloat16)).float().pow(2).sum().backward()
    opt.step(num_items=None if "process_group" in extra else world)
    saved = opt.gathered_state_dict()["state"]
    return [saved[i]["master"].reshape(b.shape) - b for i, b in enumerate(before)]


def data(rank, window, micro, world, inject):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * window + micro)
    n = 3 + rank
    scale = 2.0 ** torch.randint(-8, 9, (1, 29), generator=gen).float()
    x = torch.randn(n, 29, generator=gen) * scale
    if inject and (window, micro) == NONFINITE and rank == world - 1:
        x[0, 0] = math.inf
    return x, torch.randn(n, 5, generator=gen)


def items(rank):
    return K * (3 + rank)


def loss_of(model, rank, window, micro, world, reduction, inject):
    x, y = data(rank, window, micro, world, inject)
    err = ((model(x.to(model.rank0_only.weight.dtype), rank).float() - y) ** 2).sum(dim=1)
    return err.mean() if reduction == "mean" else err.sum()


def make(case, linears=False, **extra):
    """``linears``: fused_accum.nn's Linears (the weight gradient written in place in fp32 where
    the window can take it)."""
    algorithm, keywords, _, _, dtype = CASES[case]
    model = Net(dtype)
    if linears:
        fused_accum.nn.convert_linears_(model)
    opt = fused_accum.FusedAccumOptimizer(
        model.parameters(), algorithm, bucket_cap_mb=CAP, **ALGORITHMS[algorithm], **keywords, **extra
    )
    return model, opt


def inject_of(case):
    return "skip" in case


def run_window(model, opt, case, window, rank, world, group_items):
    _, _, reduction, with_items, _ = CASES[case]
    for micro in range(K):
        loss_of(model, rank, window, micro, world, reduction, inject_of(case)).backward()
    opt.step(num_items=torch.tensor(float(items(rank))) if with_items else None)
    opt.zero_grad()


def one_process(case, worlds, linears=False):
    """One process, reduce_dtype="exact": window w runs the micro-batches of ``worlds[w]`` ranks
    in the order (micro-batch j, rank r) and steps with num_items = the ranks' mean's count. One
    thread, as the ranks: the backward's fp32 matmuls (not ours) sum in an order that depends on
    the thread count (bf16 ones showed no difference here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(case, worlds, linears)
    finally:
        torch.set_num_threads(threads)


def _one_process(case, worlds, linears):
    _, _, reduction, with_items, _ = CASES[case]
    model, opt = make(case, linears, reduce_dtype="exact")
    norms = []
    for window, world in enumerate(worlds):
        for micro in range(K):
            for rank in range(world):
                loss_of(model, rank, window, micro, world, reduction, inject_of(case)).backward()
        n = sum(items(r) for r in range(world)) if with_items else world
        opt.step(num_items=n)
        norms.append(opt.last_grad_norm.clone())
        opt.zero_grad()
    return dict(params=[p.detach().clone() for p in model.parameters()], state=opt.state_dict(), norms=norms)


def _bits(t):
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same(a, b, where="") -> list:
    """Where ``a`` and ``b`` (nested dicts/lists of tensors and values) differ, bit for bit."""
    if isinstance(a, dict):
        keys = set(a) | set(b)
        return [d for k in sorted(keys, key=str) for d in same(a.get(k), b.get(k), f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {a!r:.60} vs {b!r:.60}"]
        if not torch.equal(_bits(a), _bits(b)):
            diff = (a.double() - b.double()).abs().nan_to_num(0).max().item() if a.is_floating_point() else "?"
            return [f"{where}: differs (max abs {diff})"]
        return []
    return [] if a == b or (a is None and b is None) else [f"{where}: {a!r} vs {b!r}"]


# --- the ranks ---------------------------------------------------------------------------------


def _count(counts):
    """Wrap the module's collectives: bytes each rank sends to the others ((N-1)/N of the input)."""
    all_to_all, reduce_scatter = fd._all_to_all, fd._reduce_scatter

    def counted(kind, collective):
        def run(output, input, group=None, **kwargs):
            n = dist.get_world_size(group)
            counts[kind] = counts.get(kind, 0) + input.numel() * input.element_size() * (n - 1) // n
            return collective(output, input, group=group, **kwargs)

        return run

    fd._all_to_all = counted("all_to_all", all_to_all)
    fd._reduce_scatter = counted("reduce_scatter", reduce_scatter)


def _worker(rank, path):
    dist.init_process_group("gloo", init_method=f"file://{path}.init", rank=rank, world_size=max(SIZES))
    torch.set_num_threads(1)
    try:
        groups = {n: dist.new_group(list(range(n))) for n in SIZES}  # (every rank makes every group)
        counts: dict = {}
        _count(counts)
        results = {}
        for world in SIZES:
            if rank >= world:
                continue
            group = groups[world]
            for case in CASES:
                model, opt = make(case, process_group=group, shard="grads", reduce_dtype="exact")
                norms = []
                for window in range(WINDOWS):
                    run_window(model, opt, case, window, rank, world, None)
                    norms.append(opt.last_grad_norm.clone())
                results[(world, case)] = dict(
                    params=[p.detach().clone() for p in model.parameters()],
                    state=opt.gathered_state_dict(),
                    norms=norms,
                )
        # bytes per micro-batch per element, and the receive buffers' peak, at every N > 1
        for world in SIZES[1:]:
            if rank >= world:
                continue
            for wire in ("exact", torch.float32, torch.bfloat16):
                counts.clear()
                model, opt = make("adamw_clip_skip", process_group=groups[world], shard="grads", reduce_dtype=wire)
                run_window(model, opt, "adamw_clip_skip", 0, rank, world, None)
                reducer = opt._window.topology.reducer
                elements = sum(flat.total for flat in opt._window.flat_groups)
                results[("bytes", world, str(wire))] = dict(
                    sent=sum(counts.values()) / (K * elements),
                    peak=reducer.wire["peak_in_flight"],
                    bucket_bytes=max(b.end - b.start for f in opt._window.flat_groups for b in f.buckets) * 2,
                )
        # offload="cpu" (its speculation, with the coefficient 1, is not the step: stepped again)
        # and accum_steps, at N = 2
        if rank < 2:
            for name, extra in (("offload", dict(offload="cpu")), ("accum_steps", dict(accum_steps=K))):
                case = "adamw_clip_skip"
                model, opt = make(case, process_group=groups[2], shard="grads", reduce_dtype="exact", **extra)
                for window in range(WINDOWS):
                    run_window(model, opt, case, window, rank, 2, None)
                results[name] = [p.detach().clone() for p in model.parameters()]
        # a gradient arriving twice in a backward (reentrant checkpoint), at N = 2
        if rank < 2:
            for wire in ("exact", None):
                results[("reentrant", wire)] = reentrant_run(
                    rank, 2, process_group=groups[2], shard="grads", reduce_dtype=wire
                )
            exact = dict(process_group=groups[2], shard="grads", reduce_dtype="exact")
            results["reentrant_first"] = reentrant_first_run(rank, 2, **exact)
            results["negative_zero"] = negative_zero_run(rank, 2, **exact)
            # fused_accum.nn's Linears, at N = 2 (the one process must not take their fp32 weight
            # gradient written in place: the ranks cannot)
            case = "adamw_clip_skip"
            model, opt = make(case, linears=True, **exact)
            for window in range(WINDOWS):
                run_window(model, opt, case, window, rank, 2, None)
            results["linears"] = [p.detach().clone() for p in model.parameters()]
        # resume at N = 2 from a gathered checkpoint of a window at N = 4, through
        # torch.distributed.checkpoint's storage (saved by the 4 ranks, loaded by 2 of them)
        case = "adamw_items_remainder"
        model, opt = make(case, process_group=groups[4], shard="grads", reduce_dtype="exact")
        run_window(model, opt, case, 0, rank, 4, None)
        saved = {"model": dict(model.state_dict()), "optim": opt.gathered_state_dict()}
        dcp.save(saved, checkpoint_id=f"{path}.dcp", process_group=groups[4])
        if rank < 2:
            model, opt = make(case, process_group=groups[2], shard="grads", reduce_dtype="exact")
            # what dcp.load fills: tensors of the saved shapes holding nothing of the checkpoint
            template = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.full_like(t, 7), saved)
            dcp.load(template, checkpoint_id=f"{path}.dcp", process_group=groups[2])
            model.load_state_dict(template["model"])
            opt.load_state_dict(template["optim"])
            for window in (1, 2):
                run_window(model, opt, case, window, rank, 2, None)
            results["resume"] = dict(
                params=[p.detach().clone() for p in model.parameters()], state=opt.gathered_state_dict()
            )
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("exact") / "run")
    return spawn_ranks(_worker, path, max(SIZES))


@pytest.mark.parametrize("case", list(CASES))
def test_every_world_size_equals_one_process_bit_for_bit(ranks, case):
    for world in SIZES:
        want = one_process(case, [world] * WINDOWS)
        for rank in range(world):
            got = ranks[rank][(world, case)]
            assert not same(got["params"], want["params"]), (world, rank, same(got["params"], want["params"]))
            assert not same(got["norms"], want["norms"]) or all(
                torch.isnan(a) and torch.isnan(b) for a, b in zip(got["norms"], want["norms"]) if not torch.equal(a, b)
            ), (world, got["norms"], want["norms"])
            diff = same(got["state"]["state"], want["state"]["state"], "state")
            diff += same(got["state"].get("master"), want["state"].get("master"), "master")
            assert not diff, (world, rank, diff[:5])
    if "skip" in case:  # the non-finite window was skipped (its norm is not finite), the others stepped
        norms = ranks[0][(2, case)]["norms"]
        assert not torch.isfinite(norms[NONFINITE[0]]) and torch.isfinite(norms[0]) and torch.isfinite(norms[2])


def test_bytes_on_the_wire_are_half_the_fp32_reduce_scatter(ranks):
    for world in SIZES[1:]:
        for rank in range(world):
            exact = ranks[rank][("bytes", world, "exact")]
            fp32 = ranks[rank][("bytes", world, str(torch.float32))]
            bf16 = ranks[rank][("bytes", world, str(torch.bfloat16))]
            # per element of the (padded) buffers, per micro-batch: 2 (N-1)/N for bf16 gradients
            assert exact["sent"] == pytest.approx(2 * (world - 1) / world), exact
            assert fp32["sent"] == pytest.approx(4 * (world - 1) / world), fp32
            assert bf16["sent"] == pytest.approx(2 * (world - 1) / world), bf16
            # at most EXACT_IN_FLIGHT + 1 buckets' send and receive buffers at once
            assert 0 < exact["peak"] <= (fd.EXACT_IN_FLIGHT + 1) * 2 * exact["bucket_bytes"], exact


@pytest.mark.parametrize("name", ["offload", "accum_steps"])
def test_offload_and_accum_steps_equal_one_process_bit_for_bit(ranks, name):
    want = one_process("adamw_clip_skip", [2] * WINDOWS)
    for rank in range(2):
        assert not same(ranks[rank][name], want["params"])


def test_a_gradient_arriving_twice_in_a_backward_is_summed(ranks):
    # The second arrival comes after its bucket's all-to-all was launched: a second round of
    # collectives for that bucket, added after the first (exact in fp32, in another order than
    # one process's: equal to rounding, not bit for bit). It was lost before (0.03 off here).
    want = reentrant_run(0, 2, reduce_dtype="exact")
    for rank in range(2):
        for wire in ("exact", None):
            for got, w in zip(ranks[rank][("reentrant", wire)], want):
                torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)


def test_a_gradient_only_rank_0_gives_keeps_its_negative_zero_in_a_shared_bucket(ranks):
    want = negative_zero_run(0, 2, reduce_dtype="exact")
    assert torch.equal(_bits(want[0]), _bits(torch.zeros_like(want[0])))  # gate (listed first): +0.0, see NegativeZero
    for rank in range(2):
        assert not same(ranks[rank]["negative_zero"], want)


def test_a_reentrant_piece_staged_before_its_bucket_launched_goes_on_the_fp32_wire(ranks):
    # The bucket's staged sum of the two bf16 pieces, sent in bf16, rounds to 8 bits (>= 2**-9
    # relative of the update); in fp32 it is the one process's sum but for the order of its fp32
    # adds (one process adds the pieces one by one: a few ulp, 1e-6 relative)
    want = reentrant_first_run(0, 2, reduce_dtype="exact")
    for rank in range(2):
        for got, w in zip(ranks[rank]["reentrant_first"], want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)


def test_fused_linears_on_the_exact_wire_equal_one_process_bit_for_bit(ranks):
    want = one_process("adamw_clip_skip", [2] * WINDOWS, linears=True)
    for rank in range(2):
        assert not same(ranks[rank]["linears"], want["params"])


def test_one_process_exact_norm_leaves_out_a_layer_without_a_gradient():
    """reduce_dtype="exact" in one process clips by the same norm as torch's clip_grad_norm_
    over the parameters that have a ``.grad``: a layer no micro-batch of a window used still
    holds the last window's sum in its slice, which the norm must not count. fp32 (the chunked
    norm's tree sum and torch's norm agree to a few ulp: 1e-5 relative after 3 AdamW steps, the
    stale slice moves them by > 1e-3)."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.branch, self.head = nn.Linear(6, 9), nn.Linear(6, 9), nn.Linear(9, 3)

        def forward(self, x, branch):
            h = self.body(x) + (self.branch(x) if branch else 0)
            return self.head(torch.tanh(h))

    ours, ref = Branchy(), Branchy()
    opt = fused_accum.AdamW(ours.parameters(), lr=1e-2, reduce_dtype="exact", max_grad_norm=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for window in range(3):
        for model in (ours, ref):
            for micro in range(K):
                gen = torch.Generator().manual_seed(10 * window + micro)
                x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
                ((model(x, branch=window != 1) - y) ** 2).mean().backward()
        norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert norm > 0.05, norm  # (the clip binds)
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-5, atol=0)
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resume_at_another_world_size(ranks):
    case = "adamw_items_remainder"
    want = one_process(case, [4, 2, 2])
    for rank in range(2):
        got = ranks[rank]["resume"]
        assert not same(got["params"], want["params"])
        assert not same(got["state"]["state"], want["state"]["state"])


def test_exact_is_checked():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="exact"):
        fused_accum.AdamW(model.parameters(), reduce_dtype="exactly")


def test_the_chunked_norm_depends_neither_on_rows_per_call_nor_on_threads():
    from fused_accum.topology.base import CHUNK, chunk_sums, tree_sum

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(37, CHUNK, generator=gen) * 2.0 ** torch.randint(-20, 20, (37, 1), generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            whole = chunk_sums(rows)
            parts = torch.cat([chunk_sums(rows[:1]), chunk_sums(rows[1:9]), chunk_sums(rows[9:])])
            results += [whole, parts, tree_sum(whole).reshape(1)]
            assert torch.equal(_bits(whole), _bits(parts))
        assert torch.equal(_bits(results[0]), _bits(results[3]))
        assert torch.equal(_bits(results[2]), _bits(results[5]))
    finally:
        torch.set_num_threads(threads)
    # (torch's x.square().sum() of these 37 x 1024 elements differs between 1 and 2 threads here)
