#!/usr/bin/env python
"""The window suite's k = 8 window (benchmarks/window.py), one commit against another, interleaved.

Issue 20 asks that the redesign leave "the k = 8 window benchmark (both models, fp32 and bf16) no
slower than before, in one interleaved run against the commit before the change". This script
is that run:

  python scripts/compare_window_commits.py                  # 6bbb6e6 against the working tree
  python scripts/compare_window_commits.py --quick          # the same, 10 rounds (~1 min once
                                                            # both _C are cached; + ~2 min to build)
  python scripts/compare_window_commits.py --old 6bbb6e6 --new HEAD --json out.json
  (full: 60 rounds in 6 pairs of workers, ~5 min with both _C cached; + ~2 min to build them)
  options: --rounds N, --segments S (pairs of fresh workers), --budget-s S (timing seconds in all),
           --providers fused_accum,native (any of window.PROVIDERS), --models params,gpt2,
           --dtypes fp32,bf16, --no-cache (rebuild both extensions), --keep (leave the copies)

How old and new are kept apart:
  * Each side is a clean copy in a temporary directory outside the repository: a commit by
    `git archive`, the working tree (--new worktree, the default) by copying the files git
    tracks or would track (`git ls-files -co --exclude-standard`; so no build outputs, no .so).
    The copy is taken once, at the start: edits made in the repository during the run do not
    reach it. Nothing is written into the repository.
  * Each copy gets its own C++ extension, built into the copy (`setup.py build_ext --inplace`,
    the build ./run does through pip, minus the install). The built _C and its _C.build.json are
    cached in ~/.cache/fused_accum_compare/, keyed by the hash of setup.py, csrc/ and the torch
    version, so a rerun rebuilds only when the C++ changed.
  * Each side runs in its own long-lived worker process (python from this venv, PYTHONPATH and
    sys.path[0] = its copy, cwd = its copy), which imports that copy's fused_accum, its _C
    (two _C cannot share one process: both register the same TORCH_LIBRARY) and that copy's
    benchmarks.window. A worker checks that what it imported lives in its copy and says so.
  * FUSED_ACCUM_* variables are removed from the workers' environment, and each worker runs
    with torch.set_num_threads(1) (OMP_NUM_THREADS=MKL_NUM_THREADS=1 too): the machine's cores
    are shared with other work, and one thread is the row the suite measures first.

How they are interleaved:
  * Each worker builds every (model, dtype) cell with the suite's own prepare_cell (the same
    WindowConfig as `--suite window`: k = 8, params_2048x256 and gpt2_d64), which also trains
    the check windows and compares every provider's update with torch's (ok=False on a wrong
    result, reported below). Then one untimed round, then timed rounds.
  * The rounds are shared among --segments pairs of fresh workers (old and new started anew,
    their cells rebuilt, one untimed round, which one starts first alternating). Why: an A/A
    run (--old 6bbb6e6 --new 6bbb6e6, one pair of workers, 40 rounds, a loaded machine) found
    the "new" worker of identical code 3% faster on gpt2_d64 bf16 in 30 rounds of 40 (sign
    test p = 0.002): a process runs the same code a few % faster or slower than another
    (allocation, layout), steadily, so rounds within one pair are not independent samples of
    the difference between the trees. Several pairs put that effect on both sides.
  * Only one worker computes at any time: the coordinator asks one worker for one timed window
    (the suite's _window: 8 forward + backward, step, zero_grad, timed by perf_counter in the
    worker) and waits for its answer before it asks the next. The other worker sleeps on its
    pipe.
  * A round = for every cell, every (side, provider) once, back to back; the order of those
    units is rotated by one every round (and the cell order too), so each side goes first and
    last equally often and load that comes and goes lands on both.
  * `native` (torch's own accumulation + AdamW(fused=True)) is timed in both workers as a
    control: it runs no fused_accum code, so its new/old ratio shows how far two processes
    running the same code differ on this machine (allocator, cache, load). A fused_accum ratio
    is only a difference where it is outside that.

Reported per (model, dtype, provider): the median window (ms) of old and new with the
interquartile range, new/old of the medians, and the median of the per-round ratios (each round
pairs windows run seconds apart, so slow drift cancels) with its IQR and min..max, and in how
many rounds new was the slower one; and the range of the per-pair paired medians. Ratio > 1:
new is slower. The verdict says "slower" or "faster" only where a two-sided sign test over the
rounds gives p < 0.05 (the count of rounds new was slower, against a fair coin) AND every pair
of workers (3 or more) saw it the same way; otherwise "within noise". Compare it with the
native control's lines: a fused_accum difference no larger than the control's is not one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OLD = "6bbb6e6"  # the commit before issue 20's redesign
WORKTREE = "worktree"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fused_accum_compare")
THREADS = 1
MIN_SEGMENT_ROUNDS = 2  # a time budget cuts a segment, but not below this many rounds


def log(msg: str) -> None:
    print(msg, flush=True)


def git(*args: str, **kw) -> str:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, text=True, **kw).stdout


# ---------------------------------------------------------------------------------------------
# The copies and their extensions
# ---------------------------------------------------------------------------------------------


def snapshot(rev: str, dest: str) -> Dict[str, str]:
    """A clean copy of ``rev`` (a commit, or WORKTREE) in ``dest``; what it is, in words."""
    os.makedirs(dest)
    if rev == WORKTREE:
        head = git("rev-parse", "--short", "HEAD").strip()
        files = [f for f in git("ls-files", "-z", "-co", "--exclude-standard").split("\0") if f]
        digest = hashlib.sha256()
        copied = 0
        for f in sorted(set(files)):
            src = os.path.join(REPO, f)
            if not os.path.isfile(src) or os.path.islink(src):
                continue  # tracked but deleted in the working tree
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, f))
            with open(src, "rb") as fh:
                digest.update(f.encode() + b"\0" + hashlib.sha256(fh.read()).digest())
            copied += 1
        dirty = git("status", "--porcelain", "--untracked-files=normal").strip()
        changed = len(dirty.splitlines()) if dirty else 0
        return {
            "rev": WORKTREE,
            "label": f"worktree (HEAD {head}, {changed} paths changed vs HEAD)",
            "head": head,
            "content_sha": digest.hexdigest()[:12],
            "files": str(copied),
        }
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", "--format=tar", sha], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    subject = git("log", "-1", "--format=%s", sha).strip()
    return {"rev": rev, "label": f"{sha[:7]} ({subject[:60]})", "head": sha[:7], "content_sha": sha[:12]}


def _ext_key(tree: str) -> str:
    import torch

    h = hashlib.sha256(f"{torch.__version__}|{torch.version.git_version}|{sys.version}".encode())
    paths = ["setup.py"]
    for root, _, names in os.walk(os.path.join(tree, "csrc")):
        paths += [os.path.relpath(os.path.join(root, n), tree) for n in names]
    for p in sorted(paths):
        with open(os.path.join(tree, p), "rb") as fh:
            h.update(p.encode() + b"\0" + hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def _ext_files(tree: str) -> List[str]:
    pkg = os.path.join(tree, "fused_accum")
    return sorted(n for n in os.listdir(pkg) if n.startswith("_C.") and (n.endswith(".so") or n == "_C.build.json"))


def build_extension(tree: str, use_cache: bool, name: str) -> str:
    """Build fused_accum._C into ``tree`` (or take it from the cache); how, in words."""
    key = _ext_key(tree)
    cached = os.path.join(CACHE, key)
    pkg = os.path.join(tree, "fused_accum")
    if use_cache and os.path.isdir(cached) and any(n.endswith(".so") for n in os.listdir(cached)):
        for n in os.listdir(cached):
            shutil.copy2(os.path.join(cached, n), os.path.join(pkg, n))
        return f"_C from the cache ({cached})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSED_ACCUM_")}
    env.setdefault("MAX_JOBS", str(min(8, os.cpu_count() or 1)))
    t0 = time.perf_counter()
    log(f"[{name}] building fused_accum._C in {tree} (setup.py build_ext --inplace) ...")
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-6000:] + out.stderr[-6000:])
        raise SystemExit(f"[{name}] the extension build failed in {tree}")
    files = _ext_files(tree)
    if not any(n.endswith(".so") for n in files):
        raise SystemExit(f"[{name}] the build made no fused_accum/_C*.so in {tree}")
    if use_cache:
        tmp = cached + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        for n in files:
            shutil.copy2(os.path.join(pkg, n), os.path.join(tmp, n))
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    return f"_C built in {time.perf_counter() - t0:.0f} s"


# ---------------------------------------------------------------------------------------------
# The worker: one per side, in its own copy
# ---------------------------------------------------------------------------------------------


def worker_main(tree: str) -> None:
    """Answer the coordinator's JSON lines on stdin, one JSON line each on the original stdout
    (the package's own prints go to stderr)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [tree] + [p for p in sys.path if os.path.abspath(p or ".") not in (here, REPO, tree)]
    os.chdir(tree)
    import torch

    torch.set_num_threads(THREADS)
    import fused_accum
    from fused_accum.backends import ext
    from benchmarks import common, window as W

    def inside(path: Optional[str]) -> bool:
        return bool(path) and os.path.realpath(path).startswith(os.path.realpath(tree) + os.sep)

    c_file = getattr(ext._C, "__file__", None) if ext._C is not None else None
    hello = {
        "fused_accum": fused_accum.__file__,
        "window_py": W.__file__,
        "C": c_file,
        "C_unavailable": getattr(ext, "_WHY_NOT", ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    hello["isolated"] = inside(fused_accum.__file__) and inside(W.__file__) and inside(c_file)
    proto.write(json.dumps(hello) + "\n")

    device = torch.device("cpu")
    cells: Dict[str, object] = {}
    cfg = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "prepare":
            cfg = W.WindowConfig(threads=(THREADS,), **req.get("cfg", {}))
            checks = {}
            for model_name, dtype in W.cells(cfg):
                cell = W.prepare_cell(model_name, dtype, cfg, device)
                label = f"{cell.base['model']} {dtype}"
                cells[label] = cell
                checks[label] = {
                    p: {k: c[k] for k in ("ok", "hooks", "check_update_err", "check_loss_rel_diff")}
                    for p, c in cell.checks.items()
                }
            import gc

            gc.collect()
            proto.write(json.dumps({"cells": list(cells), "checks": checks, "accum_steps": cfg.accum_steps}) + "\n")
        elif op == "window":
            cell = cells[req["cell"]]
            p = req["provider"]
            common.synchronize(device)
            t0 = time.perf_counter()
            W._window(cell.models[p], cell.steps[p], cell.batches)
            common.synchronize(device)
            proto.write(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}) + "\n")
        elif op == "quit":
            break


class Worker:
    def __init__(self, name: str, tree: str, logdir: str):
        self.name, self.tree = name, tree
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUSED_ACCUM_")}
        env.update(
            PYTHONPATH=tree, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONDONTWRITEBYTECODE="1"
        )
        self.log_path = os.path.join(logdir, f"worker-{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), "--worker", tree],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )

    def send(self, **req) -> None:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Dict:
        line = self.proc.stdout.readline()
        if not line:
            self._log.flush()
            with open(self.log_path) as f:
                tail = f.read()[-4000:]
            raise SystemExit(f"[{self.name}] worker died (rc {self.proc.poll()}); its log:\n{tail}")
        return json.loads(line)

    def ask(self, **req) -> Dict:
        self.send(**req)
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------------------------
# The coordinator
# ---------------------------------------------------------------------------------------------


def quartiles(s: Sequence[float]) -> Tuple[float, float, float]:
    if len(s) < 2:
        return s[0], s[0], s[0]
    q1, q2, q3 = statistics.quantiles(s, n=4, method="inclusive")
    return q1, q2, q3


def sign_test(above: int, below: int) -> float:
    """Two-sided exact sign test: P(a split at least this uneven | each side equally likely)."""
    n, k = above + below, min(above, below)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def summarize(samples, cells, providers, segment_of: Sequence[int]) -> List[Dict]:
    rows = []
    for cell in cells:
        for p in providers:
            old, new = samples[cell]["old"][p], samples[cell]["new"][p]
            ratios = [b / a for a, b in zip(old, new)]
            oq, nq, rq = quartiles(old), quartiles(new), quartiles(ratios)
            slower = sum(x > 1 for x in ratios)
            p_sign = sign_test(slower, sum(x < 1 for x in ratios))
            segs = sorted(set(segment_of))
            seg_ratios = [statistics.median(x for x, s in zip(ratios, segment_of) if s == g) for g in segs]
            # every pair of processes has to agree, on top of the rounds (see the module docstring)
            verdict = "within noise"
            if len(segs) >= 3 and p_sign < 0.05:
                if min(seg_ratios) > 1:
                    verdict = "slower"
                elif max(seg_ratios) < 1:
                    verdict = "faster"
            rows.append(
                dict(
                    cell=cell,
                    provider=p,
                    rounds=len(ratios),
                    old_ms=statistics.median(old),
                    old_q1=oq[0],
                    old_q3=oq[2],
                    new_ms=statistics.median(new),
                    new_q1=nq[0],
                    new_q3=nq[2],
                    ratio=statistics.median(new) / statistics.median(old),
                    paired=rq[1],
                    paired_q1=rq[0],
                    paired_q3=rq[2],
                    paired_min=min(ratios),
                    paired_max=max(ratios),
                    new_slower_rounds=slower,
                    p_sign=p_sign,
                    segment_ratios=seg_ratios,
                    verdict=verdict,
                    old_samples=old,
                    new_samples=new,
                )
            )
    return rows


def print_table(rows: List[Dict]) -> None:
    log("")
    log(
        f"{'model dtype':<21} {'provider':<12} {'old ms [IQR]':>22} {'new ms [IQR]':>22} "
        f"{'new/old':>7} {'paired [IQR] (min..max)':>32} {'new slower':>10} {'pairs of workers':>16}  verdict"
    )
    for r in rows:
        log(
            f"{r['cell']:<21} {r['provider']:<12} "
            f"{r['old_ms']:7.1f} [{r['old_q1']:6.1f}..{r['old_q3']:6.1f}] "
            f"{r['new_ms']:7.1f} [{r['new_q1']:6.1f}..{r['new_q3']:6.1f}] "
            f"{r['ratio']:7.3f} {r['paired']:6.3f} [{r['paired_q1']:.3f}..{r['paired_q3']:.3f}] "
            f"({r['paired_min']:.2f}..{r['paired_max']:.2f}) {r['new_slower_rounds']:>4}/{r['rounds']:<3} "
            f"   {min(r['segment_ratios']):.3f}..{max(r['segment_ratios']):.3f}  {r['verdict']}"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", default=DEFAULT_OLD, help=f"commit (default {DEFAULT_OLD})")
    ap.add_argument("--new", default=WORKTREE, help=f"commit, or '{WORKTREE}' (default): the working tree as it is now")
    ap.add_argument("--quick", action="store_true", help="10 rounds in 2 pairs of workers, 40 s of timing at most")
    ap.add_argument("--rounds", type=int, help="timed rounds in all (default 60, --quick 10)")
    ap.add_argument(
        "--segments",
        type=int,
        help="pairs of fresh workers the rounds are shared among (default 6, --quick 2; a verdict needs 3 or more)",
    )
    ap.add_argument(
        "--budget-s", type=float, help="timing seconds in all, shared among the segments (default 200, --quick 40)"
    )
    ap.add_argument(
        "--providers",
        default="fused_accum,native",
        help="window.PROVIDERS to time (default fused_accum,native: native is the control)",
    )
    ap.add_argument("--models", default="params,gpt2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--no-cache", action="store_true", help="rebuild both extensions")
    ap.add_argument("--keep", action="store_true", help="leave the temporary copies (their path is printed)")
    ap.add_argument("--json", help="write the rows and the run's facts here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0

    rounds = args.rounds or (10 if args.quick else 60)
    budget = args.budget_s if args.budget_s is not None else (40.0 if args.quick else 200.0)
    segments = max(1, min(rounds, args.segments or (2 if args.quick else 6)))
    providers = [p for p in args.providers.split(",") if p]
    cfg = {
        "models": tuple(m for m in args.models.split(",") if m),
        "dtypes": tuple(d for d in args.dtypes.split(",") if d),
    }
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    log(
        f"compare_window_commits: old={args.old} new={args.new}; torch threads = {THREADS} in each worker "
        f"(torch.set_num_threads({THREADS}), OMP/MKL_NUM_THREADS={THREADS}); "
        f"{os.cpu_count()} cores; load {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}"
    )

    tmp = tempfile.mkdtemp(prefix="fa-compare-window-")
    workers: Dict[str, Worker] = {}
    try:
        info = {}
        for side, rev in (("old", args.old), ("new", args.new)):
            tree = os.path.join(tmp, side)
            info[side] = snapshot(rev, tree)
            info[side]["build"] = build_extension(tree, not args.no_cache, side)
            log(f"[{side}] {info[side]['label']}: copy in {tree}, {info[side]['build']}")
        samples = None  # [cell][side][provider] -> ms per timed round, all segments
        segment_of: List[int] = []  # the segment of each timed round
        bad: List[str] = []
        prepared: Dict[str, Dict] = {}
        cells: List[str] = []
        units = [(s, p) for p in providers for s in ("old", "new")]
        per_segment = max(1, -(-rounds // segments))  # rounds per segment, rounded up
        done = 0
        timing_s = 0.0  # seconds spent in timed rounds (the budget counts these)
        for seg in range(segments):
            if done >= rounds:
                break
            # A fresh pair of processes each segment (the one started first alternates): how fast
            # one process runs the same code differs by a few % from another (allocation, layout),
            # and pooling several pairs keeps that from passing for a difference between the trees.
            order = ("old", "new") if seg % 2 == 0 else ("new", "old")
            workers = {side: Worker(side, os.path.join(tmp, side), tmp) for side in order}
            for side, w in workers.items():
                hello = w.recv()
                info[side]["worker"] = hello
                if not hello["isolated"]:
                    raise SystemExit(
                        f"[{side}] the worker did not import fused_accum, its _C and "
                        f"benchmarks.window from its copy {w.tree}: {hello}"
                    )
                if seg == 0:
                    log(
                        f"[{side}] worker: fused_accum from {hello['fused_accum']}, _C {hello['C']}, "
                        f"{hello['threads']} thread(s), torch {hello['torch']}"
                    )
            for w in workers.values():  # both build their cells at once: untimed
                w.send(op="prepare", cfg=cfg)
            prepared = {side: w.recv() for side, w in workers.items()}
            if seg == 0:
                cells = prepared["old"]["cells"]
                samples = {c: {s: {p: [] for p in providers} for s in ("old", "new")} for c in cells}
            if prepared["new"]["cells"] != cells or prepared["old"]["cells"] != cells:
                raise SystemExit(
                    f"old and new build different cells: {prepared['old']['cells']} vs {prepared['new']['cells']}"
                )
            for side in ("old", "new"):
                for cell, checks in prepared[side]["checks"].items():
                    for p in providers:
                        if p not in checks:
                            raise SystemExit(f"provider {p!r} is not in {side}'s {cell}: {sorted(checks)}")
                    if seg:
                        continue  # the same code, the same seeds: checked once
                    for p, c in checks.items():
                        if not c["ok"] or (p.startswith("fused_accum") and c["hooks"] == "none"):
                            bad.append(f"{side} {cell} {p}: {c}")
                if seg == 0:
                    hooks = {p: sorted({c[p]["hooks"] for c in prepared[side]["checks"].values()}) for p in providers}
                    log(
                        f"[{side}] cells checked against torch: "
                        f"{'all ok' if not any(b.startswith(side) for b in bad) else 'SOME WRONG'}; hooks {hooks}"
                    )
            if seg == 0:
                for b in bad:
                    log(f"CHECK FAILED: {b}")
                log(
                    f"[setup] {time.perf_counter() - t_start:.0f} s; k = {prepared['old']['accum_steps']}, "
                    f"{len(cells)} cells x {len(providers)} providers x 2 sides per round; {segments} segments "
                    f"of up to {per_segment} rounds, each with a fresh pair of workers"
                )
            seg_rounds = 0
            for r in range(args.warmup_rounds + per_segment):
                timed = r >= args.warmup_rounds
                t_round = time.perf_counter()
                k = r % len(cells)
                for ci, cell in enumerate(cells[k:] + cells[:k]):
                    j = (r + ci + seg) % len(units)
                    for side, p in units[j:] + units[:j]:
                        ms = workers[side].ask(op="window", cell=cell, provider=p)["ms"]
                        if timed:
                            samples[cell][side][p].append(ms)
                if timed:
                    timing_s += time.perf_counter() - t_round
                    done += 1
                    seg_rounds += 1
                    segment_of.append(seg)
                    if done % 10 == 0 or done == rounds:
                        log(
                            f"[timing] segment {seg + 1}/{segments}: {done}/{rounds} rounds, "
                            f"{timing_s:.0f} s timed, load {os.getloadavg()[0]:.2f}"
                        )
                    if done >= rounds:
                        break
                    # the budget is shared out: this segment's part of it, past its own start
                    if seg_rounds >= MIN_SEGMENT_ROUNDS and timing_s > budget * (seg + 1) / segments:
                        log(
                            f"[timing] segment {seg + 1}: its share of the {budget:.0f} s budget is spent "
                            f"after {seg_rounds} rounds"
                        )
                        break
            for w in workers.values():
                w.close()
            workers = {}

        load1 = os.getloadavg()
        rows = summarize(samples, cells, providers, segment_of)
        log(
            f"\nold = {info['old']['label']}\nnew = {info['new']['label']}"
            + (f", content {info['new']['content_sha']}" if args.new == WORKTREE else "")
        )
        log(
            f"one thread per worker; {done} timed rounds in {len(set(segment_of))} fresh worker pairs "
            f"(+{args.warmup_rounds} untimed each), interleaved; "
            f"ms per window of k = {prepared['old']['accum_steps']} (8 fwd+bwd, step, zero_grad); "
            f"ratio new/old > 1: new slower"
        )
        print_table(rows)
        ctrl = [r for r in rows if r["provider"] == "native"]
        if ctrl:
            lo, hi = min(r["paired"] for r in ctrl), max(r["paired"] for r in ctrl)
            slo = min(min(r["segment_ratios"]) for r in ctrl)
            shi = max(max(r["segment_ratios"]) for r in ctrl)
            log(
                f"\ncontrol: native runs the same torch code in both workers; its paired new/old is "
                f"{lo:.3f}..{hi:.3f} over the cells ({slo:.3f}..{shi:.3f} per pair of workers): a fused_accum "
                f"ratio inside that is not a difference this run resolves"
            )
        log(
            f"load average: {load0[0]:.2f} at the start, {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end; "
            f"{time.perf_counter() - t_start:.0f} s in all"
        )
        if bad:
            log(f"{len(bad)} provider checks FAILED (see above)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "old": info["old"],
                        "new": info["new"],
                        "threads": THREADS,
                        "rounds": done,
                        "segments": segments,
                        "segment_of_round": segment_of,
                        "load_start": load0,
                        "load_end": load1,
                        "checks_failed": bad,
                        "rows": rows,
                        "checks": {s: prepared[s]["checks"] for s in prepared},
                    },
                    f,
                    indent=1,
                )
            log(f"wrote {args.json}")
        return 1 if bad else 0
    finally:
        for w in workers.values():
            w.close()
        if args.keep:
            log(f"copies kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
