"""Command line: ``python -m fused_accum COMMAND [args]`` (``--help`` lists the commands)."""

from __future__ import annotations

import importlib.util
import pathlib
import signal
import sys
import threading

USAGE = "usage: python -m fused_accum {demo,bench} [args]  (python -m fused_accum COMMAND --help: its options)"
HELP = f"""{USAGE}

commands:
  demo   which accumulation loop, and which learning rate? Measures loop A (backward per
         micro-batch), loop B (one backward of the concatenated outputs) and fused_accum on
         synthetic data and small models (GPU if there is one, else CPU), prints four tables and
         answers both questions. Options: --quick (seconds), --plot PATH (loss curves; matplotlib)
  bench  the benchmark suite (benchmarks/run.py, from a source checkout): kernels, end-to-end
         training, CPU AdamW and whole windows against torch; writes CSV/JSON (and kernels.png)
         to benchmarks/results. Options: --quick, --smoke, --suite, --out, --device, ...
"""
COMMANDS = ("demo", "bench")


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


def _default_sigint() -> None:
    """Ctrl-C (or `timeout -s INT`) raises KeyboardInterrupt again. A job started in the
    background by a non-interactive shell inherits SIGINT as ignored, and Python then installs
    no handler of its own: both commands would run to the end instead of stopping."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(HELP, end="")
        return 0
    if not argv or argv[0] not in COMMANDS:
        why = "no command given" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\npython -m fused_accum: error: {why} (--help lists the commands)", file=sys.stderr)
        return 2
    _default_sigint()
    if argv[0] == "demo":
        from .demo import main as demo_main

        try:
            return demo_main(argv[1:])
        except KeyboardInterrupt:  # nothing to keep: the tables print at the end
            print("\nfused_accum demo: interrupted", file=sys.stderr)
            return 130
    return _bench_main()(argv[1:])  # an interrupt there ends the run and still writes its files


if __name__ == "__main__":
    sys.exit(main())
