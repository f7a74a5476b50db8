"""The `slow` marker (tests/conftest.py), which `./run test --quick` leaves out: found from each
test's code, it marks what starts ranks or a subprocess of this Python, directly or through the
module's own functions and fixtures, and nothing else."""

from __future__ import annotations

import pathlib

import pytest
from conftest import _slow_functions

MODULE = """
import subprocess, sys
import pytest
import torch.multiprocessing as mp
from helpers import spawn_ranks


def _run_two_ranks(path):
    return spawn_ranks(_worker, path, 2)


def _worker(rank, path):
    pass


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True)


@pytest.fixture
def ranks(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2)


def test_through_a_helper(tmp_path):
    _run_two_ranks(str(tmp_path))


def test_through_two_helpers():
    assert _python("print(1)").returncode == 0


def test_through_a_fixture(ranks):
    pass


def test_a_process_of_its_own():
    import multiprocessing
    multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_shell_is_not_this_python():
    subprocess.run(["bash", "-c", "true"], check=True)


def test_plain():
    assert _worker(0, "") is None
"""


def test_what_starts_ranks_or_this_python_is_slow_and_nothing_else(tmp_path):
    path = tmp_path / "test_module.py"
    path.write_text(MODULE)
    tests = {name for name in _slow_functions(str(path)) if name.startswith("test_")}
    assert tests == {
        "test_through_a_helper",
        "test_through_two_helpers",
        "test_through_a_fixture",
        "test_a_process_of_its_own",
    }


@pytest.mark.parametrize(
    "module, test",
    [
        ("test_distributed.py", "test_fifty_short_runs_neither_hang_nor_abort"),  # torch.multiprocessing
        ("test_sharding.py", "test_two_ranks_equal_one_process"),  # a module-scoped fixture's ranks
        ("test_fsdp.py", "test_max_grad_norm_is_global"),
        ("test_host_cost.py", "test_every_topology_never_syncs_and_its_op_count_does_not_grow_with_the_parameters"),
        ("test_cli.py", "test_the_demo_stops_on_sigint_even_when_started_with_sigint_ignored"),  # this Python
    ],
)
def test_the_suites_rank_and_subprocess_tests_are_slow(module, test):
    assert test in _slow_functions(str(pathlib.Path(__file__).parent / module))


def test_the_one_process_tests_beside_them_are_not():
    here = pathlib.Path(__file__).parent
    assert "test_a_steady_state_step_never_syncs_and_its_op_count_does_not_grow_with_the_parameters" not in (
        _slow_functions(str(here / "test_host_cost.py"))
    )
    assert "test_shard_arguments_are_checked" not in _slow_functions(str(here / "test_sharding.py"))
