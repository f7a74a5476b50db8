"""Fixtures several test files share (the shared constants and builders are in helpers.py).

Also loaded for tests/integration: nothing here imports more than pytest and torch up front."""

import ast
import functools
import pathlib

import pytest
import torch


@pytest.fixture(params=["cpp", "python"])
def hooks(request, monkeypatch):
    """Both implementations of the hooks (read when an optimizer is built): the C++ ones can run
    a middle backward without Python, so what the user did to .grad must be seen there too."""
    if request.param == "cpp":
        from fused_accum.backends import ext

        if not (ext._C is not None and hasattr(ext._C, "Arrivals")):
            pytest.skip("fused_accum._C is not built")
        monkeypatch.delenv("FUSED_ACCUM_PYTHON_HOOKS", raising=False)
    else:
        monkeypatch.setenv("FUSED_ACCUM_PYTHON_HOOKS", "1")
    return request.param


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests of tiny tensors or many small steps: a second thread only
    adds hand-off cost (on 2 cores shared with other processes, 2 threads made test_stacked.py
    take 32 s instead of 2.4 s, and cost test_kernels.py's 100-step tests seconds of spinning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the quick loop: `slow` --------------------------------------------------------------------
#
# `./run test --quick` runs `pytest -m "not gpu and not slow"`. A test is slow when it starts processes that
# import torch (3-10 s each on 2 cores, before any work): ranks (helpers.spawn_ranks,
# torch.multiprocessing's spawn or start_processes, a multiprocessing Process) or a subprocess
# of this Python (sys.executable, a script run with it). That is found here from the test's code,
# for every test at collection, rather than marked by hand: a test that calls, directly or
# through functions and fixtures of its module, something that starts one is marked. An explicit
# @pytest.mark.slow marks any other, as _LONG_RUNS does here.

_STARTS_RANKS = {"spawn_ranks", "spawn", "start_processes", "Process"}
# Long runs that start no process: (file, test) -> why. Each took 35-80 s of the quick loop
# (load 15-20 on 2 cores): a training run, a benchmark, thousands of tensors under the Triton
# interpreter.
_LONG_RUNS = {
    ("test_remainder.py", "test_a_small_bf16_gpt_trains_in_the_remainder_mode_as_with_fp32_masters"): "200 windows",
    ("test_benchmarks.py", "test_window_phases_times_every_backward_and_the_step_for_both_providers"): "a benchmark",
    ("test_triton_extra.py", "test_triton_accumulates_2000_small_tensors_in_two_launches"): "2,000 tensors",
    ("test_triton_extra.py", "test_triton_step_over_many_tensors_is_one_launch"): "hundreds of tensors",
    ("test_triton_extra.py", "test_triton_adam_amsgrad_matches_reference"): "AMSGrad's steps interpreted",
}
_SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}


def _starts_processes(node: ast.AST, source: str) -> bool:
    """Whether ``node`` (a function) itself starts ranks or a subprocess of this Python."""
    own_python = "sys.executable" in (ast.get_source_segment(source, node) or "")
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _STARTS_RANKS:
            return True
        if (
            own_python
            and name in _SUBPROCESS
            and isinstance(func, ast.Attribute)
            and getattr(func.value, "id", "") == "subprocess"
        ):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _slow_functions(path: str) -> frozenset:
    """The module's functions (tests, helpers, fixtures) that start processes, directly or by
    calling (or taking as a fixture) one of the module's functions that does."""
    source = pathlib.Path(path).read_text()
    functions = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(node.name, node)
    uses = {}
    for name, node in functions.items():
        called = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}  # (calls, and functions passed on)
        called |= {a.arg for a in node.args.args}  # fixtures
        uses[name] = called & functions.keys() - {name}
    slow = {name for name, node in functions.items() if _starts_processes(node, source)}
    while True:
        more = {name for name, used in uses.items() if used & slow} - slow
        if not more:
            return frozenset(slow)
        slow |= more


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        if function.__name__ in _slow_functions(str(item.path)) or (item.path.name, function.__name__) in _LONG_RUNS:
            item.add_marker(pytest.mark.slow)
