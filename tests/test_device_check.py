"""benchmarks/device_check.sh, the one-shot GPU check, checked on the CPU through its dry run.

The GPU run is a one-shot (15 minutes of device time, at most 8 files back), so its plumbing is
tested here before a GPU is there: ``device_check.sh --dry-run`` runs every stage, with CPU
stand-ins for the GPU work, under the same limits, signals and file rules. One dry run has
three planted faults, each in a stage that writes no result file: a stage that fails (exit 3),
one that hangs until its SIGINT, and one that ignores SIGINT until the SIGKILL after the grace.
It must still run every later stage and leave exactly the 8 files, each CSV with its header and
rows. The same checks must fail on a copy of the script in which a failed stage stops the run.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device_check.sh"
STAGES = [
    "toolchain",
    "build",
    "gpu-core",
    "gpu-matrix",
    "kernels",
    "e2e",
    "triton-sweep",
    "triton-host",
    "wgrad",
    "goals",
]
FILES = {
    "device_check.log",
    "summary.md",
    "results.json",
    "kernels.csv",
    "end_to_end.csv",
    "triton_sweep.csv",
    "triton_host.csv",
    "wgrad.csv",
}
STOP_MARKER = "[[ $rc -eq 0 ]] || status=1  # a failed stage never stops the next"
PLANTED = dict(
    DEVICE_CHECK_PLANT="toolchain=fail,build=hang,gpu-matrix=hang-hard",
    DEVICE_CHECK_LIMITS="build=3,gpu-matrix=2",
    DEVICE_CHECK_KILL_AFTER="2",
)


def dry_run(out: Path, script: Path = SCRIPT, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "FUSED_ACCUM_GIT_COMMIT": "0123abc", **env}
    full_env.pop("TRITON_INTERPRET", None)  # as on the GPU machine: the triton-host stage sets none
    return subprocess.run(
        ["bash", str(script), "--dry-run"], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600
    )


def outcomes(log: str) -> dict:
    """stage -> its outcome line's text, from the log's '=== stage: outcome, exit N after T s'."""
    found = re.findall(r"^=== ([a-z0-9-]+): (.*?)(?:, exit -?\d+ after \d+ s)?$", log, flags=re.M)
    return {stage: outcome for stage, outcome in found if stage in STAGES}


def problems(out: Path) -> list:
    """What is wrong with a finished run's $OUT: a stage without an outcome, more than 8 files or
    no log, a CSV without its header and rows, no summary."""
    found = []
    names = {p.name for p in out.iterdir()}
    if "device_check.log" not in names:
        return ["no device_check.log in $OUT"]
    if len(names) > 8:
        found.append(f"{len(names)} files in $OUT, more than the 8 that come back: {sorted(names)}")
    if any(p.is_dir() for p in out.iterdir()):
        found.append("a folder in $OUT")
    log = (out / "device_check.log").read_text()
    ran = outcomes(log)
    missing = [s for s in STAGES if s not in ran]
    if missing:
        found.append(f"stages with no outcome in the log: {missing}")
    if not missing and list(ran) != STAGES:
        found.append(f"stages out of order: {list(ran)}")
    for path in sorted(out.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if len(rows) < 2 or not all(len(r) == len(rows[0]) for r in rows[1:]):
            found.append(f"{path.name}: want a header and rows of its width, got {len(rows)} lines")
    if "summary.md" not in names or "## Goals" not in (out / "summary.md").read_text():
        found.append("no summary.md with its goals")
    return found


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("planted")
    started = time.monotonic()
    proc = dry_run(out, **PLANTED)
    return proc, out, time.monotonic() - started


def test_planted_failure_and_hangs_do_not_stop_the_later_stages(planted):
    proc, out, _ = planted
    log = (out / "device_check.log").read_text()
    assert problems(out) == [], log[-3000:]
    ran = outcomes(log)
    assert ran["toolchain"] == "FAILED" and "planted failure" in log
    assert ran["build"] == "killed at its 3 s limit (SIGINT)"
    assert ran["gpu-matrix"] == "killed at its 2 s limit (SIGKILL after 2 s)"
    for stage in set(STAGES) - {"toolchain", "build", "gpu-matrix"}:  # every other stage ran and passed
        assert ran[stage] == "ok", (stage, log[-3000:])
    assert proc.returncode == 1  # not 0: three stages did not pass
    assert "planted" not in proc.stderr  # everything went to the log (stdout), which comes back


def test_the_eight_files_come_back_each_csv_with_its_header_and_rows(planted):
    _, out, _ = planted
    assert {p.name for p in out.iterdir()} == FILES
    for name in ("kernels.csv", "end_to_end.csv", "triton_sweep.csv", "triton_host.csv", "wgrad.csv"):
        with open(out / name, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, name
    # the commit given in the environment (.git does not travel to the GPU machine) is stamped
    assert {r["git_commit"] for r in csv.DictReader(open(out / "kernels.csv"))} == {"0123abc"}
    assert json.loads((out / "results.json").read_text())["meta"]["git_commit"] == "0123abc"
    assert all(r["commit"] == "0123abc" for r in csv.DictReader(open(out / "triton_host.csv")))


def test_the_summary_names_every_goal_and_each_stage(planted):
    _, out, _ = planted
    text = (out / "summary.md").read_text()
    assert "DRY RUN" in text and "commit 0123abc" in text
    goals = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and ("met" in line or "MISSED" in line or "not measured" in line)
    ]
    assert len(goals) == 8, text  # the eight GPU goals, each with a verdict
    # the stand-in capture test passed: its goal is read from the gpu-core junit file
    assert re.search(r"\| graph capture of a whole window replayed equal to eager \| met \|", text), text
    for stage in STAGES[:-1]:  # the goals stage writes the summary, so it lists those before it
        assert re.search(rf"^\| {stage} \|", text, flags=re.M), stage


def test_the_checks_fail_when_a_planted_failure_stops_the_script(tmp_path):
    """A copy of the script whose failed stage ends the run (a `set -e` or an `|| exit`, say)."""
    source = SCRIPT.read_text()
    assert source.count(STOP_MARKER) == 1
    stopping = REPO / "build" / f"device_check_stops_{os.getpid()}.sh"  # in a folder of the repo's root:
    stopping.parent.mkdir(exist_ok=True)  # the script finds the tree from its own path
    stopping.write_text(source.replace(STOP_MARKER, "[[ $rc -eq 0 ]] || exit 1"))
    try:
        dry_run(tmp_path, stopping, DEVICE_CHECK_PLANT="build=fail")
    finally:
        stopping.unlink()
    found = problems(tmp_path)
    assert any("stages with no outcome" in p and "kernels" in p for p in found), found


def test_the_budget_fits_eight_minutes():
    proc = subprocess.run(["bash", str(SCRIPT), "--budget"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    limits = dict(re.findall(r"^ {4}([a-z0-9-]+) +(\d+) s$", proc.stdout, flags=re.M))
    assert list(limits) == STAGES
    grace = int(re.search(r"\+ (\d+) s of SIGKILL grace", proc.stdout).group(1))
    total = sum(map(int, limits.values())) + grace
    assert grace == 15 and total <= 480 and f"= {total} s of 480 s" in proc.stdout, proc.stdout


def test_without_a_gpu_and_without_dry_run_it_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    env = {**os.environ, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}  # no nvidia-smi on this PATH
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dry-run" in proc.stdout


# --- the pieces that make a stage stopped at its limit keep its results ------------------------


def test_an_interrupted_benchmark_run_writes_what_it_measured(tmp_path):
    """SIGINT (what `timeout -s INT` sends at a stage's limit) after the first group: the run
    stops, and kernels.csv and results.json hold the rows measured so far."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "benchmarks/run.py",
            "--quick",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--suite",
            "accumulate",
            "--out",
            str(tmp_path),
            "--no-plot",
            "--seed",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "kernels.csv").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output  # interrupted, not finished (a --quick run takes a minute)
    assert "interrupted" in output
    with open(tmp_path / "kernels.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    payload = json.loads((tmp_path / "results.json").read_text())
    assert rows and payload["meta"]["interrupted"] is True
    assert len(payload["kernels"]) >= len(rows) > 0
    assert not (tmp_path / "kernels.png").exists()  # --no-plot
    assert not list(tmp_path.glob("*.tmp"))  # every write was completed and renamed


def test_csv_appender_writes_each_row_as_it_comes(tmp_path):
    from benchmarks import common

    path = tmp_path / "rows.csv"
    out = common.CsvAppender(path, {"git_commit": "c0ffee", "device_name": "d", "torch": "t", "date_utc": "now"})
    assert not path.exists()  # no rows, no file
    out.add({"a": 1, "b": 2.5})
    with open(path, newline="") as f:  # readable while still open: flushed per row
        assert list(csv.DictReader(f)) == [
            {"a": "1", "b": "2.5", "git_commit": "c0ffee", "device_name": "d", "torch": "t", "date_utc": "now"}
        ]
    out.add({"a": 3, "b": 4})
    with pytest.raises(ValueError):
        out.add({"a": 5, "c": 6})  # a row with other columns is a bug
    out.close()
    assert len(list(csv.DictReader(open(path)))) == 2


def test_a_spent_window_budget_builds_no_model(monkeypatch):
    """window.run checks the time budget before it builds a cell's models, not after."""
    from benchmarks import window

    built = []
    monkeypatch.setattr(window, "prepare_cell", lambda *args: built.append(args))
    skipped = []
    cfg = window.WindowConfig(models=("params",), dtypes=("fp32", "bf16"), threads=(1,), param_count=8, param_numel=32)
    assert window.run(cfg, torch.device("cpu"), over_budget=lambda: True, skipped=skipped) == []
    assert built == [] and skipped == ["window params_8x32 fp32 1 threads", "window params_8x32 bf16 1 threads"]
