"""``master_weights="remainder"``: bf16 parameters trained as with an fp32 master, in 2 bytes.

The fp32 master is the bf16 parameter (its high half, rounded to nearest with ties away from
zero) plus an int16 remainder, split and rebuilt exactly in the step (the map and its proofs:
csrc/math.h, tests of every fp32 pattern in csrc/tests/test_math.cpp and of the kernels in
tests/test_kernels.py). Here, the optimizer:

- The oracle is the fp32-master mode (``master_weights=True``) with one change, its *tie twin*:
  after every step its bf16 weights are set (through ``.data``, which the optimizer does not
  watch) to the split's high half of its fp32 master, so its forward sees exactly the weights
  the remainder mode writes; the two modes differ in nothing else. The remainder mode must then
  equal the twin bit for bit: every weight, every rebuilt master, every loss, for every fused
  algorithm, with clipping, non-finite skips, ``num_items``, GradScaler and step_in_backward.
- Against the plain fp32-master mode the only difference is the tie rule: its weights are
  ``master.to(bfloat16)`` (ties to even), ours round exact ties away from zero (2^-17 of values
  per step for random low bits); a model run shows the losses it leaves, next to fp32 and to
  bf16 without masters.
- Checkpoints hold the rebuilt fp32 master (torch's shapes): they load into either mode.
- A weight written from outside restarts its remainder: the master is then the weight, exactly.
- Memory: 2 bytes per parameter less than the fp32-master mode, counted from the buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cases  # tests/cases.py: every algorithm, its cases, the modes it runs in
import fused_accum
from fused_accum.backends.reference import rebuild_master, split_master
from helpers import CPU_BACKENDS, data

BACKENDS = [b for b in CPU_BACKENDS if b != "triton"]  # (triton: in the interpreter process, -k triton)


def bf16_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)


def loss_of(model, batch):
    x, y = batch
    return (model(x.to(torch.bfloat16)).float() - y).square().mean()


ALGORITHMS = {c.id: c for c in cases.cases(cases.REMAINDER, every=True)}  # tests/cases.py
SGD = next(c.id for c in cases.cases(cases.REMAINDER) if c.algorithm == "sgd")  # (its default case)


def masters(opt) -> list:
    """Each parameter's fp32 master as the optimizer holds it (rebuilt in the remainder mode)."""
    window = opt._window
    return [window.flat_groups[s.flat_index].master_of(s).clone() for s in window.slots]


def set_twin_weights(opt, ties_away: bool = True) -> None:
    """The tie twin: every bf16 weight becomes its fp32 master's split high half (for the
    forward and backward), and its rounding to nearest even again before the step (``ties_away``
    False): the fp32-master step takes a weight that no longer rounds its master as a weight
    written from outside, and would restart that element's master from it."""
    for slot in opt._window.slots:
        if slot.master is not None:
            weight = split_master(slot.master)[0] if ties_away else slot.master.to(torch.bfloat16)
            slot.param.data.copy_(weight.view(slot.param.shape))


def run(model, opt, windows, *, twin=False, k=2, step_kwargs=None, poison=None, scaler=None, seed=3):
    """``windows`` windows of ``k`` micro-batches; the losses seen."""
    losses = []
    batches = data(windows * k, seed=seed)
    for w in range(windows):
        for j in range(k):
            loss = loss_of(model, batches[w * k + j]) / k
            if poison is not None and w == poison and j == 0:
                loss = loss * float("inf")  # a non-finite window: skipped with skip_nonfinite
            losses.append(loss.item())
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if twin:
            set_twin_weights(opt, ties_away=False)
        if scaler is not None:
            scaler.step(opt, **(step_kwargs or {}))
            scaler.update()
        else:
            opt.step(**(step_kwargs or {}))
        opt.zero_grad()
        if twin:
            set_twin_weights(opt)
    return losses


def assert_bit_equal(ours_model, ours_opt, twin_model, twin_opt, losses=None):
    for (name, p), q in zip(ours_model.named_parameters(), twin_model.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), f"weight {name}"
    for i, (m, t) in enumerate(zip(masters(ours_opt), masters(twin_opt))):
        assert torch.equal(m.view(torch.int32), t.view(torch.int32)), f"master {i}"
    if losses is not None:
        assert losses[0] == losses[1]


CASES = [pytest.param(a, {}, {}, id=a) for a in ALGORITHMS] + [
    pytest.param("adamw", {"max_grad_norm": 0.05}, {}, id="adamw-clip"),
    pytest.param(SGD, {"max_grad_norm": 0.05, "skip_nonfinite": True}, {}, id="sgd-clip-skip"),
    pytest.param("lion", {"skip_nonfinite": True}, {}, id="lion-skip"),
    pytest.param("adam", {}, {"num_items": torch.tensor(3.0)}, id="adam-num_items"),
    pytest.param("adamw", {"accum_steps": 2, "step_in_backward": True}, {}, id="adamw-step_in_backward"),
    pytest.param(SGD, {"accum_steps": 2, "step_in_backward": True}, {}, id="sgd-step_in_backward"),
    pytest.param("adamw", {"scaler": True}, {}, id="adamw-gradscaler"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algorithm, kwargs, step_kwargs", CASES)
def test_the_remainder_mode_steps_as_the_fp32_master_mode_with_tie_rounded_weights(
    algorithm, kwargs, step_kwargs, backend, one_thread
):
    case = ALGORITHMS[algorithm]
    kwargs = dict(kwargs)
    use_scaler = kwargs.pop("scaler", False)
    skip = kwargs.get("skip_nonfinite", False)
    ours, twin = bf16_net(), bf16_net()
    ours_opt = case.make(ours.parameters(), master_weights="remainder", backend=backend, **kwargs)
    twin_opt = case.make(twin.parameters(), master_weights=True, backend=backend, **kwargs)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**14) if use_scaler else None for _ in range(2)]
    poison = 2 if skip else None
    got = run(ours, ours_opt, 6, step_kwargs=step_kwargs, poison=poison, scaler=scalers[0])
    want = run(twin, twin_opt, 6, twin=True, step_kwargs=step_kwargs, poison=poison, scaler=scalers[1])
    assert_bit_equal(ours, ours_opt, twin, twin_opt, (got, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_step_leaves_weight_and_remainder_untouched(backend):
    model = bf16_net()
    opt = fused_accum.AdamW(
        model.parameters(), lr=1e-2, master_weights="remainder", skip_nonfinite=True, backend=backend
    )
    run(model, opt, 2)
    weights = [p.detach().clone() for p in model.parameters()]
    remainders = [s.master.clone() for s in opt._window.slots]
    batch = data(1, seed=9)[0]
    (loss_of(model, batch) * float("nan")).backward()
    opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(s.master, r) for s, r in zip(opt._window.slots, remainders))


def test_a_weight_written_from_outside_keeps_its_remainder_within_half_an_ulp():
    """``mul_(0.5)`` under ``no_grad`` (any write from outside: no version counter tells every
    one, and no copy tells the old value): the remainder stays under the new weight, so the
    master is the new weight plus less than half its ulp, never a value that does not round to
    it (here, an exponent step down: exactly half the old master); a checkpoint holds that
    master and resumes from it bit for bit."""
    model = bf16_net()
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, master_weights="remainder")
    run(model, opt, 3)
    assert any(s.master.any() for s in opt._window.slots)  # (the remainders hold something)
    before = opt.state_dict()["state"][0]["master"]
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    saved = opt.state_dict()["state"][0]["master"]
    weight = model[0].weight.detach()
    assert torch.equal(saved, before * 0.5)  # (normal values: the exponent moved, the bits below stayed)
    split_weight, _ = split_master(saved)
    assert torch.equal(split_weight.view(torch.int16), weight.view(torch.int16))  # it rounds to the weight
    twin = bf16_net()
    twin.load_state_dict(model.state_dict())
    twin_opt = fused_accum.AdamW(twin.parameters(), lr=1e-2, master_weights="remainder")
    twin_opt.load_state_dict(opt.state_dict())
    run(model, opt, 2)
    run(twin, twin_opt, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("into", ["remainder", True])
@pytest.mark.parametrize("source", ["remainder", True])
def test_checkpoints_hold_fp32_masters_and_load_into_either_mode(source, into, tmp_path):
    """state_dict() shows the rebuilt fp32 master (no int16, nothing mode-specific): a checkpoint
    of one mode loads into the other (weights_only), and resumes where the source's master was."""
    model = bf16_net()
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, master_weights=source)
    run(model, opt, 3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    for entry in saved["state"].values():
        assert entry["master"].dtype == torch.float32 and set(entry) <= {"step", "exp_avg", "exp_avg_sq", "master"}
    resumed = bf16_net()
    resumed.load_state_dict(model.state_dict())
    resumed_opt = fused_accum.AdamW(resumed.parameters(), lr=1e-2, master_weights=into)
    resumed_opt.load_state_dict(saved)
    for got, want in zip(masters(resumed_opt), masters(opt)):
        assert torch.equal(got, want)  # the same fp32 master, in either mode
    if into == source == "remainder":
        run(model, opt, 2)
        run(resumed, resumed_opt, 2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


def _checkpoint_without_master(source: str, model, opt) -> dict:
    if source == "ours":  # our own state dict, its "master" entries dropped
        saved = copy.deepcopy(opt.state_dict())
        for entry in saved["state"].values():
            del entry["master"]
        return saved
    # a torch.optim.AdamW state dict of the same model (a copy of it trained by torch; bf16 state)
    other = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in data(2, seed=11):
        loss_of(other, batch).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    saved = copy.deepcopy(torch_opt.state_dict())
    assert all("master" not in entry for entry in saved["state"].values())
    return saved


# guards: FlatGroup.set_master(slot, None) in the remainder mode leaving the old remainder in place
# (its `slot.master.zero_()` dropped): the master would be the weight plus a stale low half,
# not the weight, and the run would then differ from the fp32-master twin.
@pytest.mark.parametrize("source", ["torch", "ours"], ids=["torch-adamw-state_dict", "ours-without-master"])
def test_a_checkpoint_without_master_restarts_the_remainder_from_the_weight(source, one_thread):
    """A checkpoint without ``master`` (torch.optim.AdamW's, or ours with it dropped) loaded into
    the remainder mode: every master is then its weight, exactly (the remainder restarts at
    zero), as the fp32-master mode's is, and both step on from there bit for bit."""
    ours, twin = bf16_net(), bf16_net()
    hyper = dict(lr=1e-2, weight_decay=0.1)
    ours_opt = fused_accum.AdamW(ours.parameters(), master_weights="remainder", **hyper)
    twin_opt = fused_accum.AdamW(twin.parameters(), master_weights=True, **hyper)
    run(ours, ours_opt, 3)
    run(twin, twin_opt, 3, twin=True)
    # (the precondition: remainders to lose, and the twin where ours is, bit for bit)
    assert any(s.master.any() for s in ours_opt._window.slots)
    for p, q in zip(ours.parameters(), twin.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    saved = _checkpoint_without_master(source, ours, ours_opt)
    ours_opt.load_state_dict(copy.deepcopy(saved))  # the model untouched: no model.load_state_dict
    twin_opt.load_state_dict(copy.deepcopy(saved))
    for flat in ours_opt._window.flat_groups:
        for slot in flat.slots:
            weight = slot.param.detach().float().reshape(-1)
            same = torch.equal(flat.master_of(slot).view(torch.int32), weight.view(torch.int32))
            assert same, f"remainder mode: master of {slot.name} is not its weight"
            assert not slot.master.any(), slot.name
    for slot in twin_opt._window.slots:
        assert torch.equal(slot.master, slot.param.detach().float().reshape(-1)), f"fp32 master of {slot.name}"
    # and both step on from there alike: every weight and master bit for bit after 2 windows
    run(ours, ours_opt, 2, seed=4)
    run(twin, twin_opt, 2, twin=True, seed=4)
    assert_bit_equal(ours, ours_opt, twin, twin_opt)


def test_bytes_per_parameter_held_by_the_optimizer():
    """bf16 AdamW: accumulator 4 + remainder 2 + two moments 8 = 14 B beside the 2 B weight
    (16 in all), against 4 + 4 + 8 = 16 (18) with fp32 masters, counted from the buffers."""
    per_param = {}
    for mode in ("remainder", True):
        model = nn.Linear(1000, 1000).to(torch.bfloat16)
        opt = fused_accum.AdamW(model.parameters(), master_weights=mode)
        n = sum(p.numel() for p in model.parameters())
        held = sum(flat.nbytes() - flat.steps.numel() * 4 for flat in opt._window.flat_groups)
        per_param[mode] = held / n
    # (the slices are padded to 64 elements: 1000 x 1000 + 1000 -> at most 64 more per tensor)
    assert 14 <= per_param["remainder"] < 14.001 and 16 <= per_param[True] < 16.001, per_param


def test_what_the_mode_refuses():
    with pytest.raises(TypeError, match="bfloat16 parameters only"):
        fused_accum.AdamW(nn.Linear(2, 2).half().parameters(), master_weights="remainder")
    with pytest.raises(ValueError, match="needs a fused algorithm"):
        fused_accum.FusedAccumOptimizer(
            bf16_net().parameters(), torch.optim.RMSprop, master_weights="remainder", lr=0.1
        )
    with pytest.raises(ValueError, match="master_weights must be"):
        fused_accum.AdamW(bf16_net().parameters(), master_weights="bf16")
    fused_accum.AdamW(nn.Linear(2, 2).parameters(), master_weights="remainder")  # fp32: its own master


# --- a model run: 200 windows of 8 micro-batches ---------------------------------------------------


def _gpt_run(mode, windows=200, k=8):
    from benchmarks.end_to_end import E2EConfig, TinyGPT, make_batches

    cfg = E2EConfig(
        d_model=32, n_layers=2, n_heads=2, vocab=64, seq_len=16, micro_batch=2, accum_steps=k, windows=windows
    )
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if mode != "fp32":
        model = model.to(torch.bfloat16)
    master = {"fp32": None, "master": True, "twin": True, "remainder": "remainder", "none": False}[mode]
    opt = fused_accum.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, master_weights=master)
    losses = []
    for window in make_batches(cfg, torch.device("cpu")):
        total = 0.0
        for idx, targets in window:
            loss = model(idx, targets) / k
            total += loss.item()
            loss.backward()
        if mode == "twin":
            set_twin_weights(opt, ties_away=False)
        opt.step()
        opt.zero_grad()
        if mode == "twin":
            set_twin_weights(opt)
        losses.append(total)
    return model, opt, losses


def test_a_small_bf16_gpt_trains_in_the_remainder_mode_as_with_fp32_masters(one_thread):
    """200 windows of k = 8: the remainder mode equals the tie twin bit for bit (every window's
    loss, every weight and master at the end), so what separates it from the fp32-master mode is
    the tie rule alone; both stay nearer to fp32 training than bf16 without masters."""
    ours, ours_opt, losses = _gpt_run("remainder")
    twin, twin_opt, twin_losses = _gpt_run("twin")
    assert_bit_equal(ours, ours_opt, twin, twin_opt, (losses, twin_losses))
    _, _, master_losses = _gpt_run("master")
    _, _, fp32_losses = _gpt_run("fp32")
    _, _, none_losses = _gpt_run("none")
    tail = slice(-20, None)  # the last 20 windows' mean loss

    def mean(xs):
        return sum(xs[tail]) / len(xs[tail])

    gap = {
        name: abs(mean(xs) - mean(fp32_losses))
        for name, xs in dict(remainder=losses, master=master_losses, none=none_losses).items()
    }
    assert gap["remainder"] < gap["none"] and gap["master"] < gap["none"], gap
    assert mean(losses) < losses[0] - 0.5  # (it trains: from ~ln 64 = 4.16 down)


# --- what users do between steps, drawn (hypothesis) -------------------------------------------

from hypothesis import given, note, settings  # noqa: E402 (a test dependency: requirements-dev.txt)
from hypothesis import strategies as st  # noqa: E402

EVENTS = ("none", "edit_weight", "clip_grad_value", "clear_grad", "zero_grad_mid_window", "checkpoint", "state_clear")


def _with_events(cfg, mode):
    """``cfg``'s loop on a fresh bf16 net in ``mode`` ("remainder", or "twin"); its weights."""
    master = "remainder" if mode == "remainder" else True
    model = bf16_net(cfg["seed"])
    opt = ALGORITHMS[cfg["algorithm"]].make(model.parameters(), master_weights=master, max_grad_norm=cfg["clip"])
    batches = data(len(cfg["windows"]) * 3, seed=cfg["seed"])
    for w, (k, event) in enumerate(zip(cfg["windows"], cfg["events"])):
        for j in range(k):
            if event == "zero_grad_mid_window" and j == 1:
                opt.zero_grad()
            loss_of(model, batches[3 * w + j]).div(k).backward()
        if mode == "twin":  # (before the events: an edit of the weight is the user's)
            set_twin_weights(opt, ties_away=False)
        if event == "edit_weight":
            with torch.no_grad():
                model[0].weight.mul_(0.5)
            if mode == "twin":
                # The remainder mode keeps the remainder under a weight written from outside (no
                # copy tells its old value): halving the weight halves the master exactly. The
                # twin's fp32 master would restart from the weight; it follows that rule instead.
                next(s for s in opt._window.slots if s.param is model[0].weight).master.mul_(0.5)
        elif event == "clip_grad_value":
            nn.utils.clip_grad_value_(model.parameters(), 0.01)
        elif event == "clear_grad":
            model[2].bias.grad = None
        elif event == "state_clear":
            opt.state.clear()
        opt.step()
        opt.zero_grad()
        if mode == "twin":
            set_twin_weights(opt)
        if event == "checkpoint":  # a fresh model and optimizer from the checkpoints, as a resume
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            model = bf16_net(cfg["seed"] + 1)
            model.load_state_dict(saved[0])
            opt = ALGORITHMS[cfg["algorithm"]].make(
                model.parameters(), master_weights=master, max_grad_norm=cfg["clip"]
            )
            opt.load_state_dict(saved[1])
    return model


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    cfg=st.fixed_dictionaries(
        dict(
            algorithm=st.sampled_from(sorted(ALGORITHMS)),
            seed=st.integers(0, 100),
            clip=st.sampled_from([None, 0.05]),
            windows=st.lists(st.integers(1, 3), min_size=3, max_size=3),
            events=st.lists(st.sampled_from(EVENTS), min_size=3, max_size=3),
        )
    )
)
def test_the_remainder_mode_equals_the_tie_twin_whatever_the_user_does_between_steps(cfg):
    note(repr(cfg))
    ours, twin = _with_events(cfg, "remainder"), _with_events(cfg, "twin")
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name


# --- writes the masters must follow (found by a review; each failed before its fix) -----------


def _master_follows_the_weight(opt, param, before) -> bool:
    """After an outside write (``before``: the weight it overwrote) the master follows the
    weight, never undoing the write: it rounds to the weight (its mode's rounding), and an fp32
    master restarts from the weight exactly wherever the write changed the value (elsewhere it
    keeps its precision); a remainder stays under its new weight (no copy tells the old one)."""
    slot = next(s for s in opt._window.slots if s.param is param)
    flat = opt._window.flat_groups[slot.flat_index]
    flat.refresh_masters()
    master, weight = flat.master_of(slot), param.detach().reshape(-1)
    if slot.master.dtype == torch.int16:  # (the remainder mode: its low halves)
        return torch.equal(split_master(master)[0].view(torch.int16), weight.view(torch.int16))
    changed = weight.view(torch.int16) != before.reshape(-1).view(torch.int16)
    follows = torch.where(changed, weight.float(), master)
    return torch.equal(master.to(torch.bfloat16), weight) and torch.equal(master, follows)


@pytest.mark.parametrize("master", ["remainder", True])
def test_a_weight_written_after_a_backward_that_stepped_is_followed(master, one_thread):
    """step_in_backward: the window's last backward stepped; the user writes a weight before
    step(), which then only steps what joined late: the write is kept, as a write after step()."""
    runs = {}
    for where in ("before_step", "after_step"):
        model = bf16_net()
        opt = fused_accum.AdamW(
            model.parameters(), lr=1e-2, master_weights=master, accum_steps=2, step_in_backward=True
        )
        batches = data(8, seed=3)
        for w in range(4):
            for b in batches[2 * w : 2 * w + 2]:
                (loss_of(model, b) / 2).backward()
            if w == 2:
                before = model[0].weight.detach().clone()
            if w == 2 and where == "before_step":
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
            opt.step()
            if w == 2 and where == "after_step":
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
            if w == 2:
                assert _master_follows_the_weight(opt, model[0].weight, before), where
            opt.zero_grad()
        runs[where] = (model, opt)
    assert_bit_equal(*runs["before_step"], *runs["after_step"])


@pytest.mark.parametrize("master", ["remainder", True])
def test_a_parameter_a_checkpoint_has_no_state_for_follows_the_loaded_weight(master, one_thread):
    """A torch.optim checkpoint in which a bias never had a gradient: after model then
    optimizer load_state_dict, that bias's master follows the loaded weight."""
    src = bf16_net(7).float()
    torch_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src[2].bias.requires_grad_(False)  # no state entry for it in the checkpoint
    for b in data(3, seed=5):
        (src(b[0]) - b[1]).square().mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    src[2].bias.requires_grad_(True)
    model = bf16_net()
    opt = fused_accum.AdamW(model.parameters(), lr=1e-2, master_weights=master)
    run(model, opt, 3)
    before = model[2].bias.detach().clone()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()})
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert _master_follows_the_weight(opt, model[2].bias, before)


def test_a_checkpoints_state_adopted_when_its_parameter_is_unfrozen_keeps_its_remainder(one_thread):
    """Frozen at construction, a checkpoint loaded, unfrozen, a window: the master the
    checkpoint held is the one stepped from (as with fp32 masters), not restarted."""
    source = bf16_net()
    source_opt = fused_accum.AdamW(source.parameters(), lr=1e-2, master_weights="remainder")
    run(source, source_opt, 3)
    saved = copy.deepcopy((source.state_dict(), source_opt.state_dict()))
    held = saved[1]["state"][0]["master"]
    assert not torch.equal(held, source[0].weight.detach().float())  # (a remainder to keep)
    results = {}
    for master in ("remainder", True):
        model = bf16_net()
        model.load_state_dict(saved[0])
        model[0].weight.requires_grad_(False)
        opt = fused_accum.AdamW(model.parameters(), lr=1e-2, master_weights=master)
        opt.load_state_dict(copy.deepcopy(saved[1]))
        model[0].weight.requires_grad_(True)
        loss_of(model, data(1, seed=9)[0]).backward()
        opt._members.adopt_unfrozen(opt)  # (what step() does first)
        slot = next(s for s in opt._window.slots if s.param is model[0].weight)
        flat = opt._window.flat_groups[slot.flat_index]
        assert torch.equal(flat.master_of(slot), held.reshape(-1)), master
        opt.step()
        results[master] = flat.master_of(slot).clone()
    assert torch.equal(results["remainder"], results[True])


def test_an_fp16_parameter_is_refused_before_anything_is_built():
    """add_param_group with bf16 and fp16 parameters, and an fp16 parameter frozen at
    construction (it would be refused only when unfrozen, by then dropped): refused at once,
    and the optimizer stays as it was."""
    model = bf16_net()
    opt = fused_accum.AdamW(model.parameters(), master_weights="remainder")
    extra = [nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4, dtype=torch.float16))]
    with pytest.raises(TypeError, match="exact for bfloat16 parameters only"):
        opt.add_param_group({"params": extra})
    assert len(opt.param_groups) == 1 and len(opt._window.flat_groups) == 1
    run(model, opt, 2)  # (still trains)
    frozen = nn.Parameter(torch.ones(4, dtype=torch.float16), requires_grad=False)
    with pytest.raises(TypeError, match="exact for bfloat16 parameters only"):
        fused_accum.AdamW([*bf16_net().parameters(), frozen], master_weights="remainder")
