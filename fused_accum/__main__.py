"""Command line: ``python -m fused_accum demo|bench [args]``."""

from __future__ import annotations

import importlib.util
import pathlib
import sys


def _bench_main():
    """The benchmark suite lives in the source checkout's benchmarks/, next to the package."""
    runner = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not runner.exists():
        raise SystemExit(
            f"benchmarks/run.py not found next to the package ({runner}); run the benchmarks from a source checkout"
        )
    sys.path.insert(0, str(runner.parent.parent))
    spec = importlib.util.spec_from_file_location("benchmarks.run", runner)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("demo", "bench"):
        print("usage: python -m fused_accum demo|bench [args]  (add --help after the command)")
        return 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    return _bench_main()(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
