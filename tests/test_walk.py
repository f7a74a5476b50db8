"""docs/walk.md ("Life of a gradient") held to what the default run executes.

The walk's tables are read from the doc, so that whoever changes the step path and then the
table is told which row no longer holds, by its number. A window of bf16 AdamW with
``accum_steps=2`` runs on the C++ hooks and the ``cpu`` backend (its second backward is the
last, and runs as every middle one does), each phase traced with ``sys.setprofile`` (the Python
called) and the torch profiler (the ops dispatched). Each row's ``where`` column names files,
each followed by its functions, and ops (``fused_accum_ext::...``); a table belongs to the phase
its ``<!-- walk: PHASE -->`` marker names. For every row:

- a Python function named is defined in its file and called in the row's phase;
- a C++ function named is in its file (each ``::`` part, as a word);
- an op named is dispatched in the row's phase;

and for every phase, each function the package was entered by from outside (autograd's engine,
torch.optim, the user's call) has a row: the walk cannot leave out what a phase runs first. The
quiet backward runs no Python of the package at all.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import pathlib
import re
import sys

import pytest
import torch

import fused_accum
from fused_accum.backends import ext

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "walk.md"
PACKAGE = str(ROOT / "fused_accum") + "/"
PHASES = ("backward 1", "backward 2", "step", "zero_grad")
QUIET = "backward 2"  # the phase that runs no Python of the package

Row = collections.namedtuple("Row", "number phase files ops")  # files: [(path, [names])]


def walk_rows(text: str) -> list:
    """The rows of the walk's tables, in order (see the module)."""
    rows, phase = [], None
    for line in text.splitlines():
        marker = re.fullmatch(r"<!-- walk: (.+) -->", line.strip())
        if marker:
            phase = marker.group(1)
            continue
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().isdigit():
            continue
        files, ops = [], []
        for token in re.findall(r"`([^`]+)`", cells[2]):
            if token.startswith("fused_accum_ext::"):
                ops.append(token)
            elif "/" in token:
                files.append((token, []))
            elif files:
                files[-1][1].append(token)
            else:
                files.append((None, [token]))  # (a function before any file: reported)
        rows.append(Row(int(cells[1]), phase, files, ops))
    return rows


def _code_of(path: str, name: str):
    """The code object of ``name`` (``Class.method`` or ``function``) in the module at ``path``
    (unwrapped: decorators, properties, context managers), or None where there is none."""
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    obj = module
    for part in name.split("."):
        obj = inspect.getattr_static(obj, part, None)
        if obj is None:
            return None
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    obj = inspect.unwrap(obj)
    return getattr(obj, "__code__", None)


def _in_cpp(source: str, name: str) -> bool:
    """Each ``::`` part of ``name`` (template arguments and ``()`` dropped) is a word of ``source``."""
    parts = re.sub(r"<[^>]*>|\(\)", "", name).split("::")
    return all(re.search(rf"\b{re.escape(p)}\b", source) for p in parts if p)


class _Tracer:
    """The package's Python calls of each phase (code objects), and its entries: the calls with
    no frame of the package under them (from autograd, torch.optim or the caller)."""

    def __init__(self) -> None:
        self.calls = collections.defaultdict(set)
        self.entries = collections.defaultdict(set)
        self.phase = None

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        self.calls[self.phase].add(frame.f_code)
        back = frame.f_back
        while back is not None and not back.f_code.co_filename.startswith(PACKAGE):
            back = back.f_back
        if back is None:
            self.entries[self.phase].add(frame.f_code)


def _run_window_traced():
    """One window (after two untraced ones) of bf16 AdamW, accum_steps=2: per phase, the Python
    called, the package's entries, and the ops dispatched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)).to(torch.bfloat16)
    opt = fused_accum.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, accum_steps=2)
    assert type(opt._window._arrivals).__module__ == "fused_accum._C"  # the C++ hooks
    assert {flat.backend for flat in opt._window.flat_groups} == {"cpu"}
    inputs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(2)]
    actions = {
        "backward 1": lambda: model(inputs[0]).float().square().mean().div(2).backward(),
        "backward 2": lambda: model(inputs[1]).float().square().mean().div(2).backward(),
        "step": opt.step,
        "zero_grad": opt.zero_grad,
    }
    for _ in range(2):
        for action in actions.values():
            action()
    tracer, ops = _Tracer(), {}
    for phase, action in actions.items():
        tracer.phase = phase
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sys.setprofile(tracer)
            try:
                action()
            finally:
                sys.setprofile(None)
        ops[phase] = {e.name for e in prof.events()}
    return tracer.calls, tracer.entries, ops


def _describe(code) -> str:
    return f"{pathlib.Path(code.co_filename).relative_to(ROOT)} {code.co_qualname}"


def walk_problems(rows: list, calls: dict, entries: dict, ops: dict) -> list:
    """What no longer holds of ``rows`` against a traced window, each line naming its row."""
    problems = []
    named = collections.defaultdict(set)  # phase -> the code objects its rows name
    for row in rows:
        where = f"row {row.number} ({row.phase})"
        for path, names in row.files:
            if path is None or not (ROOT / path).is_file():
                problems.append(f"{where}: `{path}` is not a file of the repository")
                continue
            for name in names:
                if not path.endswith(".py"):
                    if not _in_cpp((ROOT / path).read_text(), name):
                        problems.append(f"{where}: `{path}` has no `{name}`")
                    continue
                code = _code_of(path, name)
                if code is None:
                    problems.append(f"{where}: `{path}` defines no `{name}`")
                    continue
                named[row.phase].add(code)
                if code not in calls[row.phase]:
                    elsewhere = ", ".join(p for p in PHASES if code in calls[p]) or "none of the window"
                    problems.append(f"{where}: `{path}` `{name}` is not called in this phase (called in: {elsewhere})")
        for op in row.ops:
            if op not in ops[row.phase]:
                problems.append(f"{where}: the op `{op}` is not dispatched in this phase")
    for phase in PHASES:
        for code in sorted(entries[phase] - named[phase], key=_describe):
            problems.append(f"{phase}: entered at {_describe(code)}, which no row of this phase names")
    return problems


@pytest.fixture(scope="module")
def traced():
    if ext._C is None:
        pytest.skip("fused_accum._C is not built: the default run is the C++ hooks'")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny tensors: see conftest.one_thread)
    try:
        yield _run_window_traced()
    finally:
        torch.set_num_threads(threads)


def test_the_walk_rows_are_read_from_the_doc():
    rows = walk_rows(DOC.read_text())
    assert [r.number for r in rows] == list(range(1, len(rows) + 1)), "the rows are numbered 1, 2, ... in order"
    assert [r.phase for r in rows] == sorted((r.phase for r in rows), key=PHASES.index), "the phases in order"
    assert {r.phase for r in rows} == set(PHASES), "each phase has a table, after its <!-- walk: PHASE --> marker"
    assert all(r.files for r in rows)


def test_the_walk_is_the_path_the_default_run_takes(traced):
    calls, entries, ops = traced
    quiet = sorted(map(_describe, calls[QUIET]))
    assert quiet == [], f"the quiet backward ran the package's Python: {quiet}"
    problems = walk_problems(walk_rows(DOC.read_text()), calls, entries, ops)
    assert problems == [], "docs/walk.md no longer matches the default run:\n" + "\n".join(problems)


# A walk that went wrong in each way the test catches (not the doc's: that one changes with the
# code, and this must keep failing the same way).
WRONG_WALK = """
<!-- walk: backward 1 -->
| # | where | what happens |
|---|---|---|
| 1 | `fused_accum/window.py` `GradientWindow._before_backward`; `fused_accum/fold.py` `Folder.grant_folds` | renamed |
| 2 | `fused_accum/fold.py` `Folder.bucket_complete`; `csrc/hooks.cpp` `Arrivals::arrive`, `Arrivals::fold_quietly` | |
| 3 | `fused_accum/walk.py` `walk` | no such file |

<!-- walk: backward 2 -->
| # | where | what happens |
|---|---|---|
| 4 | `csrc/hooks.cpp` `Arrivals::end_quietly`, `fused_accum_ext::adam_step_` | another phase's op |

<!-- walk: step -->
| # | where | what happens |
|---|---|---|
| 5 | `fused_accum/ops.py` `StepOp.__call__` | the step's entries left out |
"""


def test_a_row_that_no_longer_holds_is_named_by_its_number(traced):
    problems = walk_problems(walk_rows(WRONG_WALK), *traced)
    assert [p for p in problems if p.startswith("row ")] == [
        "row 1 (backward 1): `fused_accum/fold.py` defines no `Folder.grant_folds`",
        (
            "row 2 (backward 1): `fused_accum/fold.py` `Folder.bucket_complete` is not called in this phase"
            " (called in: none of the window)"
        ),
        "row 2 (backward 1): `csrc/hooks.cpp` has no `Arrivals::fold_quietly`",
        "row 3 (backward 1): `fused_accum/walk.py` is not a file of the repository",
        "row 4 (backward 2): the op `fused_accum_ext::adam_step_` is not dispatched in this phase",
    ]
    entered = {p.split(":")[0] for p in problems if not p.startswith("row ")}
    assert entered == {"backward 1", "step", "zero_grad"}  # each phase's entries left out
