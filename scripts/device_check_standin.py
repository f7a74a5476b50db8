"""CPU stand-ins for the GPU work of benchmarks/device_check.sh's dry run (--dry-run).

The dry run checks the script's plumbing without a GPU: stage limits, a failed or hung stage not
stopping the next, the files that land in $OUT, the summary. Stages whose real work runs on a CPU
run for real at smoke sizes (the kernel, e2e and wgrad benchmarks, the Triton host time, the goals
summary); the rest get a stand-in from here that does what the real stage does to its outputs:

  build DIR         prints what the real build would do; builds nothing
  write-tests DIR   writes DIR/core and DIR/matrix: small pytest files marked ``gpu``, standing in
                    for the GPU test files, with the capture tests' names (the summary's goal reads
                    their outcomes), a skip, and (matrix) parametrised cases
  triton-sweep OUT  writes OUT/triton_sweep.csv a row at a time, with the real sweep's columns
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFTEST = """def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: stand-in for a GPU test (device_check.sh --dry-run)")
"""

CORE = '''"""Stand-in for the core GPU test files (device_check.sh --dry-run)."""
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_window_replays_like_eager(backend):
    assert backend in ("cuda", "triton")


@pytest.mark.parametrize("master_weights", [True, "remainder"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_bf16_window_with_masters_replays_like_eager(backend, master_weights):
    assert backend in ("cuda", "triton")


def test_skipped_without_a_device():
    pytest.skip("stand-in: a test that skips")
'''

MATRIX = '''"""Stand-in for the big GPU test matrices (device_check.sh --dry-run)."""
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", range(6))
def test_matrix_case(case):
    assert case * case >= 0
'''


def write_tests(folder: Path) -> None:
    for sub, name, text in (("core", "test_optimizer_gpu.py", CORE), ("matrix", "test_matrix_standin.py", MATRIX)):
        d = folder / sub
        d.mkdir(parents=True, exist_ok=True)
        (d / "conftest.py").write_text(CONFTEST)
        (d / name).write_text(text)


def triton_sweep(out: Path) -> None:
    from benchmarks import common, triton_sweep as sweep

    rows = common.CsvAppender(out / "triton_sweep.csv")
    copy = 100.0
    try:  # the real sweep's configurations, around the Triton backend's defaults
        for i, (varied, (block, warps, pps)) in enumerate(sweep.configurations((1024, 4, 16))):
            for op, per_elem in sweep.BYTES_PER_ELEMENT.items():
                gbps = 50.0 + i
                rows.add(
                    dict(
                        op=op,
                        varied=varied,
                        numel=2**16,
                        block=block,
                        num_warps=warps,
                        programs_per_sm=pps,
                        chunk=4096,
                        programs=16,
                        ms=round(per_elem * 2**16 / gbps / 1e6, 4),
                        gbps=gbps,
                        pct_of_copy=round(100 * gbps / copy, 1),
                        copy_gbps=copy,
                    )
                )
    finally:
        rows.close()
    print(f"triton-sweep stand-in: wrote {out / 'triton_sweep.csv'}")


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in ("build", "write-tests", "triton-sweep"):
        print(__doc__, file=sys.stderr)
        return 2
    what, where = argv[0], Path(argv[1])
    if what == "build":
        print(
            f"build stand-in: the real stage runs `setup.py build_ext --inplace` with FUSED_ACCUM_BUILD_CUDA=1 in {where}"
        )
    elif what == "write-tests":
        write_tests(where)
    else:
        triton_sweep(where)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
