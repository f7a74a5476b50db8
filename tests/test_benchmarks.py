"""The benchmark machinery: byte model, timing, rotation, checks, metadata, and the files a
tiny run writes. Benchmark *numbers* are not asserted (they depend on the machine); what makes
them numbers is: the arithmetic from time to GB/s to % of copy to speedup, and the contents.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # benchmarks/ is not installed with the package; bare `pytest` needs this
    sys.path.insert(0, str(REPO))

from benchmarks import common, end_to_end, kernels, window  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


# --- byte model (docs/design.md, "The byte model") ------------------------------------------


def test_byte_model_reproduces_the_design_table():
    assert common.accumulate_bytes(bf16, overwrite=False) == 10
    assert common.accumulate_bytes(bf16, overwrite=True) == 6
    assert common.accumulate_bytes(fp32, overwrite=False) == 12
    # (the step reads the bf16 weight too, to follow a write from outside: 32 and 34, 2 more
    # than before the masters followed the weights)
    assert common.step_bytes("adamw") == 32
    assert common.unfused_torch_bytes("adamw") == 48
    assert common.step_bytes("adamw", grad_dtype=bf16) == 34


def test_byte_model_other_dtypes_and_optimizers():
    assert common.accumulate_bytes(fp16, overwrite=False) == 10  # 2-byte grads like bf16
    assert common.accumulate_bytes(fp32, overwrite=True) == 8
    # SGD-momentum and Lion: read acc, master, one state, bf16 (14); write master, state (8), bf16 (2).
    assert common.step_bytes("sgd") == common.step_bytes("lion") == 24
    # A one-micro-batch window: the gradient replaces acc, which is then never read.
    assert common.step_bytes("adamw", grad_dtype=bf16, grads_overwrite=True) == 30
    assert common.step_bytes("adamw", lp_dtype=fp16) == 32


def test_gbps_is_decimal_bytes_per_second():
    assert common.gbps(1e9, 1000.0) == pytest.approx(1.0)
    assert common.gbps(10 * 4096, 0.002) == pytest.approx(10 * 4096 / 2e-6 / 1e9)


# --- flat buffers ----------------------------------------------------------------------------


def test_padded_offsets_align_every_slice():
    offsets, total = common.padded_offsets([1, 64, 65, 130])
    assert offsets == [0, 64, 128, 256]
    assert total == 448  # 130 -> 192


def test_flat_views_alias_the_buffer_at_the_padded_offsets():
    shapes = [(3, 5), (64,), (2, 2)]
    flat = torch.zeros(common.padded_offsets([15, 64, 4])[1])
    views_1d = common.flat_views(flat, shapes)
    views_nd = common.flat_views(flat, shapes, shaped=True)
    assert [tuple(v.shape) for v in views_1d] == [(15,), (64,), (4,)]
    assert [tuple(v.shape) for v in views_nd] == shapes
    for i, v in enumerate(views_nd):
        v.fill_(i + 1)
    assert flat[:15].eq(1).all() and flat[15:64].eq(0).all()  # padding untouched
    assert flat[64:128].eq(2).all() and flat[128:132].eq(3).all()
    with pytest.raises(ValueError, match="layout needs"):
        common.flat_views(torch.zeros(100), shapes)


def test_rotation_spans_four_times_the_cache():
    mib = 2**20
    assert common.rotation_count(1 * mib, 32 * mib) == 128
    assert common.rotation_count(3 * mib, 32 * mib) == 43  # ceil(128 / 3)
    assert common.rotation_count(200 * mib, 32 * mib) == 1
    assert common.rotation_count(1024, 32 * mib, max_sets=16) == 16
    with pytest.raises(ValueError, match="set_bytes"):
        common.rotation_count(0, 32 * mib)


def test_rel_error():
    ref = torch.tensor([3.0, 4.0])
    assert common.rel_error(ref.clone(), ref) == 0.0
    assert common.rel_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert common.rel_error(torch.tensor([float("nan"), 4.0]), ref) == math.inf


def test_random_tensor_is_random_and_positive_when_asked():
    t = common.random_tensor((10_000,), bf16, "cpu")
    assert t.dtype == bf16 and t.count_nonzero() > 9_900 and t.float().std() > 0.5
    v = common.random_tensor((10_000,), fp32, "cpu", positive=True)
    assert bool((v > 0).all())


# --- timing ----------------------------------------------------------------------------------


def test_timing_statistics():
    t = common.Timing(samples_ms=[1.0, 2.0, 3.0, 10.0], calls_per_sample=4, rotations=2)
    assert t.median_ms == 2.5 and t.min_ms == 1.0 and t.max_ms == 10.0
    assert t.spread_pct == pytest.approx(100 * 9 / 2.5)


def test_measure_reports_per_call_time():
    # 2 ms sleeps in samples of >= 30 ms: ~15 calls each. A sample total instead of a per-call
    # time would be >= 30 ms; a sleep never returns early, so < 2 ms would be a wrong clock.
    cfg = common.TimingConfig(samples=3, warmup_ms=5.0, min_sample_ms=30.0)
    timing = common.measure(lambda _: time.sleep(0.002), [None], torch.device("cpu"), cfg)
    assert 2.0 <= timing.median_ms < 10.0
    assert len(timing.samples_ms) == 3
    assert 3 <= timing.calls_per_sample <= 15


def test_measure_rotates_through_every_set_in_order():
    seen = []
    sets = ["a", "b", "c"]
    cfg = common.TimingConfig(samples=4, warmup_ms=0.0, min_sample_ms=0.0)
    timing = common.measure(seen.append, sets, torch.device("cpu"), cfg)
    assert timing.rotations == 3
    # Warm-up of 1 + 2 calls, then 4 samples of calls_per_sample calls, never restarting at "a".
    assert len(seen) == 3 + 4 * timing.calls_per_sample
    assert seen == [sets[i % 3] for i in range(len(seen))]


def test_measure_needs_an_argument_set():
    with pytest.raises(ValueError, match="at least one"):
        common.measure(lambda _: None, [], torch.device("cpu"))


def test_copy_ceiling_counts_read_plus_write():
    cfg = common.TimingConfig(samples=3, warmup_ms=1.0, min_sample_ms=2.0)
    copy = common.copy_ceiling(torch.device("cpu"), 4 * 2**20, cfg)
    assert copy["bytes_moved"] == 2 * 4 * 2**20
    assert copy["gbps"] == pytest.approx(copy["bytes_moved"] / (copy["ms"] * 1e-3) / 1e9)
    assert copy["gbps"] > 0.1  # even a loaded CPU copies 8 MB in well under 80 ms


# --- metadata and writing --------------------------------------------------------------------


def test_metadata_names_the_machine_versions_and_commit(monkeypatch):
    monkeypatch.delenv("FUSED_ACCUM_GIT_COMMIT", raising=False)
    meta = common.metadata(torch.device("cpu"), ["--quick"])
    assert meta["torch"] == torch.__version__
    assert meta["device_type"] == "cpu" and meta["device_name"] == meta["cpu"]
    assert meta["argv"] == ["--quick"]
    assert meta["backends"]["reference"] == ""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert meta["git_commit"] == expected
    assert isinstance(meta["git_dirty"], bool) if head.returncode == 0 else meta["git_dirty"] is None
    monkeypatch.setenv("FUSED_ACCUM_GIT_COMMIT", "abc123")
    assert common.metadata(torch.device("cpu"))["git_commit"] == "abc123"


def test_write_csv_unions_columns_and_stamps_rows(tmp_path):
    meta = {"git_commit": "c0ffee", "device_name": "dev", "torch": "t", "date_utc": "d"}
    common.write_csv(tmp_path / "x.csv", [{"a": 1, "b": 2.5}, {"a": 3, "c": "z"}], meta)
    with open(tmp_path / "x.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["a", "b", "c", "git_commit", "device_name", "torch", "date_utc"]
    assert rows[0]["b"] == "2.5" and rows[1]["b"] == "" and rows[1]["c"] == "z"
    assert {r["git_commit"] for r in rows} == {"c0ffee"}


def test_write_json_turns_non_finite_into_null(tmp_path):
    common.write_json(tmp_path / "x.json", {"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


# --- workloads -------------------------------------------------------------------------------


def test_workloads_have_the_shapes_they_claim():
    gpt2 = kernels.gpt2()
    assert len(gpt2.shapes) == 148
    assert gpt2.numel == 124_439_808  # GPT-2 small with its head tied to the embedding
    llama = kernels.llama(blocks=1)
    assert len(llama.shapes) == 9 and llama.numel == 202_383_360  # one block of Llama-2-7B
    small = kernels.many_small(2048, 65536, seed=0)
    sizes = [s[0] for s in small.shapes]
    assert len(sizes) == 2048 and min(sizes) >= 1 and max(sizes) <= 65536
    assert small == kernels.many_small(2048, 65536, seed=0)  # the same list every run
    assert kernels.flat(1000).padded_numel == 1024


# --- the correctness check inside the benchmark ----------------------------------------------


def _ctx():
    return kernels.Context(
        torch.device("cpu"),
        common.TimingConfig(samples=2, warmup_ms=0.0, min_sample_ms=0.0),
        cache_bytes=2**16,
        copy_gbps=10.0,
        seed=0,
        max_rotations=2,
    )


def _fake_backend(monkeypatch, module):
    real_get = kernels.backends.get
    monkeypatch.setattr(kernels.backends, "get", lambda name: module if name == "fake" else real_get(name))


def _reference_with(**changes):
    """The reference backend with some of its functions replaced: ``accumulate``, or a step op's
    spec by the op's name (``lion_step=...``), which its ``step`` then runs."""
    from fused_accum.backends import reference

    def step(op, t, s, h):
        return changes.get(op.name, getattr(reference, op.name))(t, s, h)

    return types.SimpleNamespace(accumulate=changes.get("accumulate", reference.accumulate), step=step)


@pytest.mark.parametrize("op", ["accumulate_add", "accumulate_first"])
def test_accumulate_check_flags_a_wrong_kernel(monkeypatch, op):
    from fused_accum.backends import reference

    def doubled(acc, offsets, grads, alpha, overwrite, found_inf=None, sumsq=None):
        reference.accumulate(acc, offsets, grads, 2 * alpha, overwrite, found_inf, sumsq)

    _fake_backend(monkeypatch, _reference_with(accumulate=doubled))
    group = kernels.Group(op, kernels.many_small(20, 300), bf16, ("torch_loop", "reference", "fake"))
    rows = {r["provider"]: r for r in kernels.run_group(group, _ctx())}
    assert rows["torch_loop"]["ok"] and rows["reference"]["ok"]
    assert rows["reference"]["max_rel_err"] < 1e-6
    assert not rows["fake"]["ok"] and rows["fake"]["max_rel_err"] > 0.1
    assert math.isfinite(rows["fake"]["ms"])  # still timed: the row says it is wrong


def test_step_check_flags_an_unwritten_bf16_param(monkeypatch):
    from fused_accum.backends import reference

    def no_lp(t, s, h):
        reference.adam_step(t._replace(lp_params=()), s, h)

    _fake_backend(monkeypatch, _reference_with(adam_step=no_lp))
    group = kernels.Group("adamw", kernels.many_small(20, 300), None, ("torch_fused", "torch_foreach", "fake"))
    rows = {r["provider"]: r for r in kernels.run_group(group, _ctx())}
    # torch's AdamW (zero state, step 1) matches the reference oracle; the fake leaves the bf16
    # params as they were (their old masters' rounding: the step adopts any element that is
    # not its master's rounding, so the inputs cannot be poisoned): its masters are right, and
    # every element whose rounding the step moved is wrong.
    assert rows["torch_fused"]["ok"] and rows["torch_foreach"]["ok"]
    assert rows["fake"]["max_rel_err"] <= kernels.CHECK_TOL
    numel = kernels.many_small(20, 300).numel
    # (Adam's first step moves every element by about lr: 555 of the 1,417 roundings here)
    assert not rows["fake"]["ok"] and rows["fake"]["lp_mismatch"] > 0.25 * numel


def _adam_then(edit):
    """reference.adam_step followed by ``edit(params, lp_params)``: a provider that computes
    its update differently."""
    from fused_accum.backends import reference

    def adam(t, s, h):
        reference.adam_step(t, s, h)
        edit(t.params, t.lp_params)

    return adam


def test_step_check_takes_a_master_one_rounding_away_with_its_own_bf16_copy(monkeypatch):
    """torch's CUDA fused AdamW computes the step in double: its fp32 masters land ~1e-7 from
    the oracle's, and some of their bf16 copies round the other way. A provider like that is
    right: its masters are within CHECK_TOL and its bf16 params are its own masters rounded.
    (Comparing the bf16 params with the oracle's failed it: ~30 of 65,536 flip at 2**-20.)"""

    def nudge(params, lp_params):
        for p, lp in zip(params, lp_params):
            p.mul_(1 + 2**-20)  # ~1e-6 relative: far inside CHECK_TOL
            lp.copy_(p.view(lp.shape))

    _fake_backend(monkeypatch, _reference_with(adam_step=_adam_then(nudge)))
    group = kernels.Group("adamw", kernels.flat(65536), None, ("fake",))
    (row,) = kernels.run_group(group, _ctx())
    assert 1e-7 < row["max_rel_err"] < kernels.CHECK_TOL
    assert row["lp_mismatch"] == 0 and row["ok"], row
    # the same provider's bf16 params against the oracle's would have differed somewhere
    oracle_lp = lambda x: x.to(bf16).float()  # noqa: E731
    master = torch.randn(65536, generator=torch.Generator().manual_seed(0))
    assert int((oracle_lp(master) != oracle_lp(master * (1 + 2**-20))).sum()) > 0


def test_step_check_flags_a_bf16_copy_of_the_old_master(monkeypatch):
    """A provider that writes the bf16 params before its update (right masters, stale copy)."""

    def stale(t, s, h):
        from fused_accum.backends import reference

        for p, lp in zip(t.params, t.lp_params):
            lp.copy_(p.view(lp.shape))
        reference.adam_step(t._replace(lp_params=()), s, h)

    _fake_backend(monkeypatch, _reference_with(adam_step=stale))
    group = kernels.Group("adamw", kernels.flat(4096), None, ("reference", "fake"))
    rows = {r["provider"]: r for r in kernels.run_group(group, _ctx())}
    assert rows["reference"]["ok"] and rows["reference"]["lp_mismatch"] == 0
    assert rows["fake"]["max_rel_err"] <= kernels.CHECK_TOL  # its masters are right
    assert rows["fake"]["lp_mismatch"] > 100 and not rows["fake"]["ok"]
    assert "bf16 params not their own master rounded" in kernels.format_row(rows["fake"])


def test_steps_after_torch_never_run_on_a_zeroed_accumulator(monkeypatch):
    from fused_accum.backends import reference

    zero_fractions = []

    def watching(t, s, h):
        zero_fractions.append(float(torch.cat(t.accs).eq(0).float().mean()))
        reference.adam_step(t, s, h)

    _fake_backend(monkeypatch, _reference_with(adam_step=watching))
    # torch_fused zeroes every set's accumulator after each of its steps, as torch must.
    group = kernels.Group("adamw", kernels.flat(4096), None, ("torch_fused", "fake"))
    rows = list(kernels.run_group(group, _ctx()))
    assert all(r["ok"] for r in rows)
    assert len(zero_fractions) > 3 and max(zero_fractions) < 0.01


def test_a_raising_provider_becomes_a_failed_row(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    _fake_backend(monkeypatch, _reference_with(lion_step=broken))
    group = kernels.Group("lion", kernels.flat(1000), None, ("torch_foreach", "fake"))
    rows = list(kernels.run_group(group, _ctx()))
    kernels.add_speedups(rows)
    fake = rows[1]
    assert fake["ok"] is False and "kernel exploded" in fake["note"] and math.isnan(fake["ms"])
    assert rows[0]["ok"] and rows[0]["speedup_vs_torch"] == 1.0
    assert "FAILED" in kernels.format_row(fake)


def test_speedup_is_best_torch_time_over_row_time():
    base = dict(op="accumulate_add", workload="flat", numel=10, grad_dtype="bf16")
    rows = [
        dict(base, provider="torch_loop", kind="torch", ms=4.0),
        dict(base, provider="torch_foreach", kind="torch", ms=2.0),
        dict(base, provider="cuda", kind="fused_accum", ms=0.5),
        dict(base, numel=20, provider="cuda", kind="fused_accum", ms=1.0),
    ]  # no torch row
    kernels.add_speedups(rows)
    assert [r["speedup_vs_torch"] for r in rows[:3]] == [0.5, 1.0, 4.0]
    assert all(r["best_torch"] == "torch_foreach" for r in rows[:3])
    assert math.isnan(rows[3]["speedup_vs_torch"]) and rows[3]["best_torch"] == ""


# --- a whole tiny run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    try:
        rc = bench_run.main(["--smoke", "--out", str(out), "--seed", "3", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    with open(out / "kernels.csv") as f:
        kernel_rows = list(csv.DictReader(f))
    with open(out / "end_to_end.csv") as f:
        e2e_rows = list(csv.DictReader(f))
    return rc, out, kernel_rows, e2e_rows, json.loads((out / "results.json").read_text())


def test_smoke_run_succeeds_and_writes_every_file(smoke_run):
    rc, out, _, _, _ = smoke_run
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "cpu_adam.csv",
        "end_to_end.csv",
        "kernels.csv",
        "kernels.png",
        "results.json",
        "window.csv",
        "window.png",
    ]
    assert (out / "kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "window.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_run_covers_every_op_provider_and_workload(smoke_run):
    _, _, rows, _, _ = smoke_run
    cfg = bench_run.make_config(torch.device("cpu"), "smoke")
    ours = kernels.our_backends(torch.device("cpu"))
    assert "reference" in ours
    expected = set()
    for w in [kernels.flat(n) for n in cfg["flat_sizes"]] + cfg["lists"]:
        for op in kernels.ACC_OPS:
            expected |= {(op, w.name, str(w.numel), "bf16", p) for p in ("torch_loop", "torch_foreach", *ours)}
    for w in cfg["step_workloads"]:
        for op, torch_side in [
            ("sgd", ("torch_fused", "torch_foreach")),
            ("adamw", ("torch_fused", "torch_foreach")),
            ("lion", ("torch_foreach",)),
            ("adagrad", ("torch_fused", "torch_foreach")),
            ("ademamix", ()),  # torch has no AdEMAMix
            ("adamw_fused_last", ("torch_fused", "torch_foreach")),
            ("adamw_remainder", ()),  # torch has no remainder mode
            ("adamw_fused_last_remainder", ()),
            ("muon_prologue", ()),  # torch has no half of Muon's step alone
            ("muon_epilogue", ()),
        ]:
            dt = "bf16" if op in kernels.FUSED_LAST_OPS else "-"
            expected |= {(op, w.name, str(w.numel), dt, p) for p in (*torch_side, *ours)}
    got = {(r["op"], r["workload"], r["numel"], r["grad_dtype"], r["provider"]) for r in rows}
    assert got == expected
    assert all(r["ok"] == "True" and r["note"] == "" for r in rows), [r for r in rows if r["ok"] != "True"]


def test_smoke_run_numbers_are_consistent(smoke_run):
    _, _, rows, _, payload = smoke_run
    copy_gbps = payload["copy"]["start"]["gbps"]
    best = {}
    for r in rows:
        key = (r["op"], r["workload"], r["numel"], r["grad_dtype"])
        if r["kind"] == "torch":
            best[key] = min(best.get(key, math.inf), float(r["ms"]))
    for r in rows:
        ms, numel, nbytes = float(r["ms"]), int(r["numel"]), int(r["bytes_per_elem"])
        assert float(r["ms_min"]) <= ms <= float(r["ms_max"]) and ms > 0
        if r["op"].startswith("accumulate"):
            dt = common.DTYPES[r["grad_dtype"]]
            assert nbytes == common.accumulate_bytes(dt, overwrite=r["op"] == "accumulate_first")
        elif r["op"] == "adamw_fused_last":
            assert nbytes == common.step_bytes("adamw", grad_dtype=bf16)
        elif r["op"] == "adamw_remainder":  # docs/design.md, "The byte model": 28, and 30 fused
            assert nbytes == 28 == common.step_bytes("adamw") - 4
        elif r["op"] == "adamw_fused_last_remainder":
            assert nbytes == 30 == common.step_bytes("adamw", grad_dtype=bf16) - 4
        elif r["op"] in kernels.MUON_OPS:  # no weight in the prologue, a bf16 input in the epilogue
            assert nbytes == {"muon_prologue": 16, "muon_epilogue": 14}[r["op"]]
        else:
            assert nbytes == common.step_bytes(r["op"])
        assert float(r["gbps"]) == pytest.approx(nbytes * numel / (ms * 1e-3) / 1e9, rel=1e-9)
        assert float(r["pct_of_copy"]) == pytest.approx(100 * float(r["gbps"]) / copy_gbps, rel=1e-9)
        twin = kernels.REMAINDER_OPS.get(r["op"])  # a remainder row: torch's best is its twin's
        key = (twin or r["op"], r["workload"], r["numel"], r["grad_dtype"])
        if key in best:
            assert float(r["speedup_vs_torch"]) == pytest.approx(best[key] / ms, rel=1e-9)
        else:  # torch has no such step (AdEMAMix, Muon's halves)
            assert r["op"] in ("ademamix", *kernels.MUON_OPS) and math.isnan(float(r["speedup_vs_torch"]))
        if twin:
            at = lambda t: (t["op"], t["provider"], t["workload"], t["numel"], t["grad_dtype"])  # noqa: E731
            twin_ms = next(float(t["ms"]) for t in rows if at(t) == (twin, *at(r)[1:]))
            assert float(r["speedup_vs_fp32_master"]) == pytest.approx(twin_ms / ms, rel=1e-9)
        assert float(r["max_rel_err"]) <= kernels.CHECK_TOL
        if r["section"] == "step":  # every step's bf16 params are its own masters, rounded
            assert r["lp_mismatch"] == "0", r
        assert int(r["samples"]) == 3 and int(r["calls_per_sample"]) >= 1 and int(r["rotations"]) >= 1


def test_smoke_run_json_matches_csv_and_records_the_machine(smoke_run):
    _, _, rows, e2e_rows, payload = smoke_run
    meta = payload["meta"]
    assert meta["torch"] == torch.__version__ and meta["mode"] == "smoke" and meta["seed"] == 3
    assert meta["torch_threads"] == 1 and meta["device_type"] == "cpu"
    assert meta["argv"] == ["--smoke", "--out", meta["argv"][2], "--seed", "3", "--threads", "1"]
    assert len(payload["kernels"]) == len(rows) and len(payload["end_to_end"]) == len(e2e_rows)
    assert [r["provider"] for r in payload["kernels"]] == [r["provider"] for r in rows]
    assert all(r["git_commit"] == meta["git_commit"] and r["torch"] == meta["torch"] for r in rows)
    assert payload["skipped"] == []
    start, end = payload["copy"]["start"], payload["copy"]["end"]
    assert payload["copy"]["drift_pct"] == pytest.approx(100 * (end["gbps"] / start["gbps"] - 1))


def test_smoke_cpu_adam_rows_interleave_providers_at_one_and_two_threads(smoke_run):
    """issue 11's comparison: every provider at 1 and 2 threads in one process, checked against
    torch's step, with the ratios computed from the same run's medians."""
    _, out, _, _, payload = smoke_run
    with open(out / "cpu_adam.csv") as f:
        rows = list(csv.DictReader(f))
    # ops x providers x thread counts, and the remainder mode beside the bf16-master op's cpu
    assert len(rows) == len(payload["cpu_adam"]) == 2 * 2 * 2 + 2
    got = {(r["op"], r["provider"], r["threads"]) for r in rows}
    want = {(op, p, t) for op in kernels.CPU_ADAM_OPS for p in ("cpu", "torch_fused") for t in ("1", "2")}
    assert got == want | {("adamw_bf16_master", "cpu_remainder", t) for t in ("1", "2")}
    ms = {(r["op"], r["provider"], r["threads"]): float(r["ms"]) for r in rows}
    for r in rows:
        if r["provider"] == "cpu_remainder":  # 28 bytes against 30, in the same rounds as cpu
            assert r["bytes_per_elem"] == "28"
            cpu_ms = ms[("adamw_bf16_master", "cpu", r["threads"])]
            assert float(r["speedup_vs_fp32_master"]) == pytest.approx(cpu_ms / float(r["ms"]), rel=1e-9)
    for r in payload["cpu_adam"]:  # what the run printed: no "vs deepspeed nanx"
        line = kernels.format_cpu_adam_row(r)
        assert "vs deepspeed not run" in line and "nan" not in line, line
    for r in rows:
        assert r["ok"] == "True" and float(r["max_rel_err_vs_torch"]) <= kernels.CHECK_TOL
        assert r["deepspeed"] == "not run"  # the smoke run leaves DeepSpeed out
        key = (r["op"], "torch_fused", r["threads"])
        assert float(r["speedup_vs_torch"]) == pytest.approx(ms[key] / float(r["ms"]), rel=1e-9)
        one = ms[(r["op"], r["provider"], "1")]
        assert float(r["thread_scaling"]) == pytest.approx(one / float(r["ms"]), rel=1e-9)


def test_measure_interleaved_alternates_providers_within_each_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = common.measure_interleaved(fns, common.TimingConfig(samples=4, warmup_ms=0.0, min_sample_ms=0.0), seed=1)
    assert set(timings) == {"a", "b", "c"} and all(len(t.samples_ms) == 4 for t in timings.values())
    timed = calls[-12:]  # after warm-up: 4 rounds, each provider once per round (one call per sample)
    for i in range(0, 12, 3):
        assert sorted(timed[i : i + 3]) == ["a", "b", "c"]
    assert len({tuple(timed[i : i + 3]) for i in range(0, 12, 3)}) > 1  # the order changes


def test_deepspeed_is_an_optional_provider(monkeypatch):
    """Without deepspeed the provider is a row that says why, and the others still run."""
    monkeypatch.setattr(kernels, "deepspeed_unavailable", lambda: "ModuleNotFoundError: no deepspeed")
    timing = common.TimingConfig(samples=2, warmup_ms=0.0, min_sample_ms=0.0)
    rows = kernels.run_cpu_adam(kernels.flat(1000), "adamw", (1,), timing, ("cpu", "torch_fused", "deepspeed"))
    by = {r["provider"]: r for r in rows}
    assert by["deepspeed"]["note"] == "unavailable: ModuleNotFoundError: no deepspeed"
    assert not math.isfinite(by["deepspeed"]["ms"])
    assert math.isfinite(by["cpu"]["ms"]) and by["cpu"]["ok"] and by["torch_fused"]["ok"]
    # the other rows say DeepSpeed is not installed, not "vs deepspeed nanx"
    line = kernels.format_cpu_adam_row(by["cpu"])
    assert "vs deepspeed not installed" in line and "nan" not in line, line
    assert by["cpu"]["deepspeed"] == "not installed"


def test_deepspeed_status_says_why_there_is_no_ratio():
    assert kernels.deepspeed_status(("cpu", "torch_fused"), "") == "not run"
    assert kernels.deepspeed_status(("cpu", "deepspeed"), "") == "ran"
    why = "ModuleNotFoundError: No module named 'deepspeed'"
    assert kernels.deepspeed_status(("cpu", "deepspeed"), why) == "not installed"
    assert kernels.deepspeed_status(("deepspeed",), "RuntimeError: ninja") == "unavailable (RuntimeError: ninja)"


def test_smoke_end_to_end_trains_the_same_model_three_ways(smoke_run):
    _, _, _, e2e_rows, _ = smoke_run
    rows = {r["variant"]: r for r in e2e_rows}
    assert set(rows) == set(end_to_end.VARIANTS)
    for r in rows.values():
        assert float(r["window_ms"]) > 0 and int(r["timed_windows"]) == 2
        assert math.isfinite(float(r["final_loss"]))
    # Same initial weights and data: the first window's loss (before any step) is identical.
    assert len({r["first_loss"] for r in rows.values()}) == 1
    assert len({r["n_params"] for r in rows.values()}) == 1
    # fp32 accumulation and fp32 master AdamW both ways: the same training, up to rounding.
    assert float(rows["fused_accum"]["final_loss"]) == pytest.approx(
        float(rows["torch_native"]["final_loss"]), abs=1e-2
    )
    assert float(rows["fused_accum"]["final_loss"]) < float(rows["fused_accum"]["first_loss"])
    native_ms = float(rows["torch_native"]["window_ms"])
    for r in rows.values():
        assert float(r["speedup_vs_native"]) == pytest.approx(native_ms / float(r["window_ms"]), rel=1e-9)


WINDOW_COLUMNS = [
    "section",
    "model",
    "dtype",
    "n_tensors",
    "numel",
    "accum_steps",
    "provider",
    "threads",
    "window_ms",
    "ms_min",
    "ms_max",
    "ms_q1",
    "ms_q3",
    "iqr_pct",
    "rounds",
    "speedup_vs_native",
    "speedup_vs_native_paired",
    "extra_us_per_param_mb",
    "check_update_err",
    "check_loss_rel_diff",
    "check_loss",
    "ok",
    "hooks",
    "note",
    "speedup_vs_native_fp32acc",
    "speedup_vs_native_fp32acc_paired",
    "thread_scaling",
    "git_commit",
    "device_name",
    "torch",
    "date_utc",
]


def test_smoke_window_rows_cover_every_model_dtype_and_provider(smoke_run):
    """issue 11's end-to-end window: both models, fp32 and bf16, every provider, checked
    against the reference training, ratios taken from the same run's medians."""
    _, out, _, _, payload = smoke_run
    with open(out / "window.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert sorted(reader.fieldnames) == sorted(WINDOW_COLUMNS)
    assert len(rows) == len(payload["window"]) == 3 + 4 + 3 + 4  # fp32: no native_fp32acc
    cfg = bench_run.make_config(torch.device("cpu"), "smoke")["window"]
    labels = [window.model_label(m, cfg) for m in window.MODELS]
    assert {(r["model"], r["dtype"], r["provider"]) for r in rows} == {
        (m, d, p) for m in labels for d in ("fp32", "bf16") for p in window.providers_for(d)
    }
    assert {r["model"]: int(r["n_tensors"]) for r in rows} == {labels[0]: 16, labels[1]: 1 * 12 + 4}
    median = {(r["model"], r["dtype"], r["provider"]): float(r["window_ms"]) for r in rows}
    for r in rows:
        assert r["ok"] == "True", r
        assert r["threads"] == "1" and int(r["rounds"]) == 2 and r["section"] == "window"
        assert (
            float(r["ms_min"]) <= float(r["ms_q1"]) <= float(r["window_ms"]) <= float(r["ms_q3"]) <= float(r["ms_max"])
        )
        native = median[(r["model"], r["dtype"], "native")]
        assert float(r["speedup_vs_native"]) == pytest.approx(native / float(r["window_ms"]), rel=1e-9)
        assert float(r["thread_scaling"]) == 1.0
        assert r["git_commit"] == payload["meta"]["git_commit"] and r["torch"] == torch.__version__
        assert (r["speedup_vs_native_fp32acc"] != "") == (r["dtype"] == "bf16")
    # torch's own accumulation has no hooks; ours names which hooks took the gradients
    from fused_accum.backends import ext

    ours = "c++" if ext._C is not None else "python"
    expected = {"native": "none", "native_fp32acc": "none", "fused_accum": ours, "fused_accum_pyhooks": "python"}
    assert all(r["hooks"] == expected[r["provider"]] for r in rows), [(r["provider"], r["hooks"]) for r in rows]


def _tiny_window(**kw):
    sizes = dict(
        accum_steps=2,
        rounds=3,
        warmup_windows=1,
        param_count=8,
        param_numel=32,
        gpt_layers=1,
        gpt_d=16,
        gpt_heads=2,
        gpt_vocab=32,
        gpt_seq=8,
        gpt_micro_batch=1,
    )
    return window.WindowConfig(**{**sizes, **kw})


def test_window_times_one_and_two_threads_in_one_process():
    threads = torch.get_num_threads()
    cfg = _tiny_window(models=("params",), dtypes=("fp32",), threads=(2, 1))
    rows = window.run(cfg, torch.device("cpu"))
    assert torch.get_num_threads() == threads  # restored
    assert [(r["threads"], r["provider"]) for r in rows] == [
        (n, p) for n in (1, 2) for p in ("native", "fused_accum", "fused_accum_pyhooks")
    ]  # fewest threads first
    one = {r["provider"]: r["window_ms"] for r in rows if r["threads"] == 1}
    for r in rows:
        assert r["ok"] and r["rounds"] == 3
        assert r["thread_scaling"] == pytest.approx(one[r["provider"]] / r["window_ms"], rel=1e-12)


def test_window_time_budget_cuts_rounds_then_skips_cells():
    cfg = _tiny_window(models=("params",), dtypes=("fp32", "bf16"), threads=(1,), rounds=10)
    skipped, answers = [], iter([False])  # within budget when the first cell starts, over it after
    rows = window.run(cfg, torch.device("cpu"), over_budget=lambda: next(answers, True), skipped=skipped)
    # the first cell stops after MIN_ROUNDS, the next one does not start
    assert {r["dtype"] for r in rows} == {"fp32"} and {r["rounds"] for r in rows} == {window.MIN_ROUNDS}
    assert skipped == ["window params_8x32 bf16 1 threads"]


def test_window_check_fails_a_provider_that_skips_work(monkeypatch):
    """A provider that drops a micro-batch's gradient is faster and wrong: ok=False."""
    make_step = window._make_step

    def lazy(provider, params, cfg, device):
        step, note = make_step(provider, params, cfg, device)
        if provider != "fused_accum":
            return step, note

        def step_without_last_grad():
            for p in params[: len(params) // 2]:
                p.grad = None  # as if the last micro-batch's hooks never ran for half the params
            step()

        return step_without_last_grad, note

    monkeypatch.setattr(window, "_make_step", lazy)
    rows = window.run(_tiny_window(models=("params",), dtypes=("fp32",), threads=(1,), rounds=1), torch.device("cpu"))
    by = {r["provider"]: r for r in rows}
    assert by["native"]["ok"] and by["fused_accum_pyhooks"]["ok"]
    assert not by["fused_accum"]["ok"] and by["fused_accum"]["check_update_err"] > window.UPDATE_TOL["fp32"]
    assert "WRONG" in window.format_row(by["fused_accum"])


def test_window_pyhooks_provider_sets_the_knob_only_while_building(monkeypatch):
    import fused_accum

    seen = []
    real = fused_accum.AdamW

    def recording(*args, **kwargs):
        seen.append(os.environ.get(window.PYTHON_HOOKS_ENV))
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_accum, "AdamW", recording)
    monkeypatch.delenv(window.PYTHON_HOOKS_ENV, raising=False)
    params = [torch.nn.Parameter(torch.randn(4))]
    window._make_step("fused_accum", params, _tiny_window(), torch.device("cpu"))
    window._make_step("fused_accum_pyhooks", [torch.nn.Parameter(torch.randn(4))], _tiny_window(), torch.device("cpu"))
    assert seen == [None, "1"] and window.PYTHON_HOOKS_ENV not in os.environ


def test_time_budget_skips_groups_but_still_writes(tmp_path):
    threads = torch.get_num_threads()
    rc = bench_run.main(
        [
            "--smoke",
            "--out",
            str(tmp_path),
            "--time-budget",
            "0",
            "--suite",
            "accumulate,e2e",
            "--threads",
            str(threads + 1),
        ]
    )
    payload = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    assert payload["meta"]["torch_threads"] == threads + 1
    assert torch.get_num_threads() == threads  # restored for the rest of this process
    assert payload["kernels"] == [] and payload["end_to_end"] == []
    assert "end_to_end" in payload["skipped"]
    assert len(payload["skipped"]) == 1 + 2 * 3  # e2e + 2 accumulate ops x 3 smoke workloads


def test_unknown_suite_is_rejected():
    with pytest.raises(SystemExit) as exc:
        bench_run.main(["--suite", "accumulate,nope"])
    assert exc.value.code == 2


def test_runs_as_a_script(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/run.py",
            "--smoke",
            "--suite",
            "accumulate",
            "--out",
            str(tmp_path),
            "--seed",
            "1",
            "--threads",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "kernels.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["op"] for r in rows} == set(kernels.ACC_OPS)
    assert "summary" in proc.stdout and "copy ceiling" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]  # the run ends with its one-line verdict
    assert last.startswith(f"verdict: OK: all {len(rows)} rows ran and matched their oracles; ours faster than"), last


def _kernel_row(op, workload, numel, provider, ms=1.0, ok=True, grad_dtype="bf16", n_tensors=1):
    kind = "torch" if provider.startswith("torch_") else "fused_accum"
    return dict(
        section="accumulate" if op.startswith("accumulate") else "step",
        op=op,
        workload=workload,
        numel=numel,
        n_tensors=n_tensors,
        grad_dtype=grad_dtype,
        provider=provider,
        kind=kind,
        ms=ms,
        gbps=10.0 / ms,
        ok=ok,
        max_rel_err=0.0 if ok else 1.0,
    )


def test_verdict_names_the_first_failure_and_counts_the_wins():
    rows = [
        _kernel_row("accumulate_add", "flat", 1024, "torch_loop", ms=2.0),
        _kernel_row("accumulate_add", "flat", 1024, "cpu", ms=1.0),
        _kernel_row("adamw", "flat", 1024, "torch_fused", ms=1.0, grad_dtype="-"),
        _kernel_row("adamw", "flat", 1024, "cpu", ms=4.0, grad_dtype="-"),
    ]
    kernels.add_speedups(rows)
    line = bench_run.verdict(rows, [])
    assert line == (
        "verdict: OK: all 4 rows ran and matched their oracles; "
        "ours faster than torch's best in 1 of 2 kernel groups (median 1.12x)"
    ), line
    rows[3]["ok"] = False
    line = bench_run.verdict(rows, [], skipped=["adamw gpt2 124M -"])
    assert line.startswith("verdict: FAILED: 1 of 4 rows failed or wrong (first: adamw flat 1K - cpu)"), line
    assert "1 skipped by the time budget" in line
    assert bench_run.verdict(rows, [], interrupted=True).startswith("verdict: INTERRUPTED: 4 rows measured")


def test_kernel_panels_draw_a_sweep_as_lines_and_everything_else_as_bars():
    """The step ops time one flat size: a line of one point on a log axis says nothing (the
    committed kernels.png had six such panels); they are bars per workload, as the lists are."""
    rows = [_kernel_row("accumulate_add", "flat", n, p) for n in (2**16, 2**20, 2**24) for p in ("torch_loop", "cpu")]
    rows += [_kernel_row("accumulate_add", "uniform_2048x256", 2**19, p, n_tensors=2048) for p in ("torch_loop", "cpu")]
    rows += [
        _kernel_row("adamw", w, n, p, grad_dtype="-")
        for w, n in (("flat", 2**20), ("gpt2", 2**27))
        for p in ("torch_fused", "cpu")
    ]
    panels = common.kernel_panels(rows)
    assert [(p["op"], p["kind"]) for p in panels] == [
        ("accumulate_add", "lines"),
        ("accumulate_add", "bars"),
        ("adamw", "bars"),
    ]
    assert {r["workload"] for r in panels[0]["rows"]} == {"flat"} and len(panels[0]["rows"]) == 6
    assert {r["workload"] for r in panels[1]["rows"]} == {"uniform_2048x256"}
    assert {r["workload"] for r in panels[2]["rows"]} == {"flat", "gpt2"}  # the single flat size as a bar
    assert common.workload_label(panels[1]["rows"][0]) == "uniform_2048x256\n512K\n2048 tensors"


def test_plots_write_pngs_from_rows(tmp_path):
    rows = [_kernel_row("adamw", "flat", 2**20, p, grad_dtype="-") for p in ("torch_fused", "cpu")]
    assert common.plot_gbps(tmp_path / "k.png", rows, 20.0, "title")
    window_rows = [
        dict(
            model="m",
            dtype="bf16",
            threads=1,
            provider=p,
            window_ms=ms,
            ms_q1=ms * 0.9,
            ms_q3=ms * 1.1,
            speedup_vs_native=10.0 / ms,
            n_tensors=3,
            numel=300,
            accum_steps=8,
        )
        for p, ms in (("native", 10.0), ("fused_accum", 8.0))
    ]
    assert common.plot_window(tmp_path / "w.png", window_rows, "title")
    for name in ("k.png", "w.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not common.plot_window(tmp_path / "none.png", [], "title") and not (tmp_path / "none.png").exists()


def test_replot_draws_the_pngs_again_from_results_json(smoke_run, tmp_path):
    _, out, _, _, _ = smoke_run
    folder = tmp_path / "again"
    folder.mkdir()
    (folder / "results.json").write_bytes((out / "results.json").read_bytes())
    assert bench_run.main(["--replot", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["kernels.png", "results.json", "window.png"]
    (folder / "results.json").write_text(json.dumps({"meta": {}, "copy": {}, "kernels": [], "window": []}))
    (folder / "kernels.png").unlink()
    assert bench_run.main(["--replot", str(folder)]) == 1 and not (folder / "kernels.png").exists()


def test_the_gpu_goal_groups_run_first(monkeypatch):
    """The full GPU plan has 72 groups and its kernel stage stops starting them at a 30 s budget:
    the bf16 accumulate and AdamW groups the goals read (flat, >= 16M elements) come first,
    largest first, where they once ran 28th to 30th."""
    monkeypatch.setattr(common, "last_level_cache_bytes", lambda device: 50 * 2**20)
    cuda = torch.device("cuda")  # the plan only names providers; nothing runs on it
    cfg = bench_run.make_config(cuda, "full")
    groups = kernels.plan(cuda, cfg["flat_sizes"], cfg["lists"], cfg["grad_dtypes"][:1], cfg["step_workloads"])
    # 42, the 2 remainder ops, Adagrad, AdEMAMix and Muon's 2 split-step ops on the 5 step workloads
    assert len(groups) == 72
    head = [(g.op, g.workload.numel) for g in groups[:5]]
    assert head == [
        ("accumulate_add", 2**28),
        ("adamw", 2**28),
        ("accumulate_add", 2**26),
        ("accumulate_add", 2**24),
        ("adamw", 2**24),
    ]
    assert not any(kernels.is_goal_group(g) for g in groups[5:])
    # then what device_goals.py reports of the remainder mode, with its fp32-master twin
    report = [(g.op, g.workload.numel) for g in groups[5:11]]
    assert report == [
        (op, n) for n in (2**28, 2**24) for op in ("adamw_fused_last", "adamw_remainder", "adamw_fused_last_remainder")
    ]
    assert not any(kernels.is_report_group(g) for g in groups[11:])
    assert sorted(map(str, groups)) == sorted(map(str, set(groups)))  # each group once


def test_triton_sweep_varies_one_setting_at_a_time():
    from benchmarks import triton_sweep

    default = (1024, 4, 16)
    configs = triton_sweep.configurations(default)
    assert configs[0] == ("default", default)
    assert len(configs) == 1 + (len(triton_sweep.BLOCKS) - 1) + (len(triton_sweep.WARPS) - 1) + (
        len(triton_sweep.PROGRAMS_PER_SM) - 1
    )
    for varied, config in configs[1:]:
        differs = [i for i in range(3) if config[i] != default[i]]
        assert len(differs) == 1 and triton_sweep.SETTINGS[differs[0]] == varied
    assert {c[0] for _, c in configs} == set(triton_sweep.BLOCKS)  # every BLOCK, 2048 included
    assert {c[2] for _, c in configs} == set(triton_sweep.PROGRAMS_PER_SM)


# --- on a GPU (run by benchmarks/device_check.sh) --------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_event_timing_agrees_with_the_wall_clock():
    dev = torch.device("cuda")
    cycles = 5_000_000  # a spin of 2.5 ms at the H200's 1.98 GHz: launch overhead is noise beside it
    for _ in range(20):  # context creation, and clocks up from idle (345 MHz seen) before timing
        torch.cuda._sleep(cycles)
    cfg = common.TimingConfig(samples=5, warmup_ms=5.0, min_sample_ms=20.0)
    timing = common.measure(lambda _: torch.cuda._sleep(cycles), [None], dev, cfg)
    calls = 10
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    assert timing.median_ms == pytest.approx(wall_ms, rel=0.3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_run_on_cuda(tmp_path):
    rc = bench_run.main(
        ["--smoke", "--device", "cuda", "--out", str(tmp_path), "--seed", "5", "--suite", "accumulate,step"]
    )
    payload = json.loads((tmp_path / "results.json").read_text())
    providers = {r["provider"] for r in payload["kernels"]}
    assert rc == 0, [r for r in payload["kernels"] if not r["ok"]]
    assert payload["meta"]["device_type"] == "cuda" and payload["meta"]["device_name"] == torch.cuda.get_device_name()
    assert {"torch_loop", "torch_foreach", "torch_fused", "reference"} <= providers
    assert set(kernels.our_backends(torch.device("cuda"))) <= providers
    # device_check.sh builds the extension first: a failed CUDA build must not pass unseen
    assert {"cuda", "triton"} <= providers, providers
    # torch's CUDA fused AdamW steps in double: its masters are held to the oracle's at
    # CHECK_TOL, its bf16 params to its own masters (kernels.LP_MISMATCH_TOL), never to the
    # oracle's bf16, which some of them round away from
    steps = [r for r in payload["kernels"] if r["section"] == "step"]
    assert steps and all(r["lp_mismatch"] == 0 and r["max_rel_err"] <= kernels.CHECK_TOL for r in steps)


def test_window_phases_times_every_backward_and_the_step_for_both_providers():
    from benchmarks import window_phases

    times = window_phases.phases("gpt2", torch.float32, rounds=2)
    k = window.WindowConfig().accum_steps
    assert set(times) == set(window_phases.PROVIDERS)
    for rows in times.values():
        assert len(rows) == 2 and all(len(row) == k + 1 and min(row) > 0 for row in rows)


def test_every_benchmark_script_is_reachable_from_the_runner():
    """Each module of benchmarks/ is a suite of run.py, one of its TOOLS, or a library of theirs:
    a script no command reaches is one nobody reruns."""
    import pathlib

    from benchmarks import run

    libraries = {"__init__", "common", "run", "kernels", "end_to_end", "window"}  # (the suites' code)
    scripts = {p.stem for p in pathlib.Path(run.__file__).parent.glob("*.py")} - libraries
    assert scripts == set(run.TOOLS.values())
    for module in run.TOOLS.values():
        assert callable(getattr(__import__(f"benchmarks.{module}", fromlist=["main"]), "main"))


def test_the_offload_benchmark_writes_its_host_step_rows_into_a_new_folder(tmp_path):
    """benchmarks/offload.py --quick on the CPU: one row per bucket size, each with the step's
    time, the copy's (live over twins) and GB/s at the AdamW step's 30 B/param; --out may name a folder that
    does not exist yet (the device check's scratch folder did, a user's may not)."""
    from benchmarks import offload

    out = tmp_path / "new" / "folder"
    assert offload.main(["--quick", "--out", str(out)]) == 0
    with open(out / "offload.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["numel"]) for r in rows] == [2**17, 2**20]
    for r in rows:
        assert r["what"] == "host step of one bucket" and r["threads"] == "1"
        step_ms, numel = float(r["step_ms"]), int(r["numel"])
        assert step_ms > 0 and float(r["copy_ms"]) > 0
        assert float(r["step_gbs"]) == pytest.approx(numel * 30 / step_ms / 1e6, rel=0.01)  # (rounded)
        assert r["git_commit"] and r["date_utc"] and r["torch"] == torch.__version__


def test_the_offload_window_rows_time_the_host_work_and_count_the_speculation():
    """benchmarks/offload.py's window rows (a GPU's, here on the CPU at a tiny size; issue 34):
    the host work is the steps (out of place where the window speculated) timed on the worker (not its waits for the
    copies), over the windows after the warm-up; the rows count the windows that speculated and
    the buckets committed or redone; the timing patches are gone after."""
    from benchmarks import offload
    from benchmarks.end_to_end import E2EConfig
    from fused_accum import host
    from fused_accum.step import Stepper

    out_of_place, prepare = host.HostLayout.out_of_place, Stepper.prepare_step
    cfg = E2EConfig(d_model=32, n_layers=1, n_heads=2, vocab=64, seq_len=16, micro_batch=2, accum_steps=8, windows=5)
    seen = []
    base, ours = offload.window_rows(torch.device("cpu"), cfg=cfg, out=seen.append)
    assert seen == [base, ours] and (base["offload"], ours["offload"]) == ("none", "cpu")
    assert base["what"] == ours["what"] == "k = 8 window, bf16 TinyGPT" and ours["windows"] == 3
    assert ours["host_work_ms"] > 0 and 0.0 <= ours["hidden_fraction"] <= 1.0
    assert ours["speculated_windows"] == 3 and ours["committed_buckets"] >= 3 and ours["redone_buckets"] == 0
    assert base["host_work_ms"] == "" and base["speculated_windows"] == ""
    assert host.HostLayout.out_of_place is out_of_place and Stepper.prepare_step is prepare


def test_the_offload_benchmark_writes_each_row_as_it_comes(tmp_path, monkeypatch):
    """Stopped at its limit (SIGINT) after its first row, offload.csv holds that row (issue 34:
    it was written only at the end)."""
    from benchmarks import offload

    real = offload.host_step_rows

    def first_then_interrupt(sizes, threads, out=None):
        real(sizes[:1], threads, out=out)
        raise KeyboardInterrupt

    monkeypatch.setattr(offload, "host_step_rows", first_then_interrupt)
    assert offload.main(["--quick", "--out", str(tmp_path)]) == 1
    with open(tmp_path / "offload.csv") as f:
        assert [int(r["numel"]) for r in csv.DictReader(f)] == [2**17]


def test_the_compile_benchmark_checks_each_recipe_and_counts_its_graphs(tmp_path):
    """benchmarks/compile.py --smoke (aot_eager, a tiny GPT): a row per recipe and optimizer, the
    one-graph window's fused_accum row one graph per window with no break, bit for bit with its
    eager loop; torch's one-graph function breaks at its step (two graphs); the CSV holds them."""
    from benchmarks import compile as compile_bench

    path = tmp_path / "compile.csv"
    recipes = ("eager", "compiled_autograd", "compiled_step", "one_graph")
    assert compile_bench.main(["--smoke", "--recipes", ",".join(recipes), "--csv", str(path)]) == 0
    with open(path) as f:
        rows = {(r["recipe"], r["optimizer"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(r, o) for r in recipes for o in ("fused_accum", "torch")}
    for recipe in recipes:  # (aot_eager: every recipe of ours bit for bit with our eager loop)
        ours = rows[(recipe, "fused_accum")]
        assert ours["error"] == "" and ours["exact"] == "True" and ours["breaks"] == "0", ours
    ours = rows[("one_graph", "fused_accum")]
    assert float(ours["graphs_per_window"]) == 1.0 and ours["graphs_compiled"] == "1"
    # (k = 2 compiled forwards, and the step)
    assert float(rows[("compiled_step", "fused_accum")]["graphs_per_window"]) == 3.0
    theirs = rows[("one_graph", "torch")]
    assert float(theirs["graphs_per_window"]) == 2.0 and int(theirs["breaks"]) > 0, theirs
    assert float(rows[("eager", "fused_accum")]["vs_ours_eager"]) > 0
