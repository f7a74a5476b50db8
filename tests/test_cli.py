"""The command line: ``python -m fused_accum --help`` lists the commands and exits 0, an unknown
command prints the usage on stderr and exits 2, ``./run help`` lists its commands, and the demo
stops on SIGINT even when started with SIGINT ignored (as a background job of a script is)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fused_accum", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_lists_every_command_and_exits_0(flag):
    out = cli(flag)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m fused_accum")
    for command in ("demo", "bench"):
        assert f"\n  {command}  " in out.stdout, out.stdout
    assert "--quick" in out.stdout and "--plot PATH" in out.stdout
    assert out.stderr == ""


@pytest.mark.parametrize("args", [(), ("frobnicate",)])
def test_a_missing_or_unknown_command_prints_the_usage_on_stderr_and_exits_2(args):
    out = cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith("usage: python -m fused_accum")
    assert ("unknown command 'frobnicate'" if args else "no command given") in out.stderr


def test_a_commands_own_help_is_its_argparse_help():
    out = cli("demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--plot" in out.stdout


def test_run_help_lists_its_commands_and_sets_nothing_up():
    out = subprocess.run(["bash", str(ROOT / "run"), "help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "test", "bench"):
        assert f"\n  {command} " in out.stdout, out.stdout
    assert "[setup]" not in out.stdout + out.stderr
    bad = subprocess.run(["bash", str(ROOT / "run"), "frobnicate"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("usage: ./run")


def test_the_demo_stops_on_sigint_even_when_started_with_sigint_ignored():
    """A job that a non-interactive shell starts in the background inherits SIGINT as ignored:
    the entry point restores the default handler, so Ctrl-C (or `timeout -s INT`) still stops
    it, with one line instead of a traceback, and exit 130."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fused_accum", "demo"],  # the full demo: seconds, time to be interrupted
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while "measuring" not in seen:  # tqdm's bar: the demo has started measuring
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stderr.read(1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (seen + err)[-2000:]
    assert "fused_accum demo: interrupted" in err and "Traceback" not in err
    assert "Answer" not in out  # it stopped: the tables and the answer were not printed
