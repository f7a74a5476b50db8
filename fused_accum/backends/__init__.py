"""Backend selection: the one place that decides which implementation runs an op.

A backend is a module exposing ``accumulate``, ``sgd_step``, ``adam_step`` and ``lion_step`` with
the signatures and contracts of :mod:`fused_accum.backends.reference`.

Auto selection (``backend="auto"``):
  CUDA tensors -> ``cuda`` (C++/CUDA extension), else ``triton``, else ``reference``;
  other tensors -> ``cpu`` (C++ extension), else ``reference``.
Triton is never chosen automatically for CPU tensors: under ``TRITON_INTERPRET=1`` it runs
there, but only as a test of the kernels, thousands of times slower than the reference.

``FUSED_ACCUM_BACKEND`` (environment) or an explicit name forces a backend. Forcing one that is
not available is an error; falling back during auto selection is logged once per reason.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Optional

import torch

logger = logging.getLogger("fused_accum")

NAMES = ("reference", "triton", "cpu", "cuda")
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "other": ("cpu", "reference")}
ENV_VAR = "FUSED_ACCUM_BACKEND"


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[Optional[ModuleType], str]:
    """Import backend ``name``; return (module, "") or (None, why it is unavailable)."""
    module_name = {"reference": "reference", "triton": "triton", "cpu": "ext", "cuda": "ext"}[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as err:  # a missing optional dependency or an unbuilt extension
        return None, f"{type(err).__name__}: {err}"
    # A backend module may define unavailable_reason(name) -> "" or why it cannot run.
    why_not = getattr(module, "unavailable_reason", lambda _name: "")(name)
    return (None, why_not) if why_not else (module, "")


def availability(name: str, device_type: str) -> str:
    """Return "" when backend ``name`` can run on ``device_type`` tensors, else the reason."""
    if name not in NAMES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    module, why_not = _load(name)
    if module is None:
        return why_not
    if name == "cuda" and device_type != "cuda":
        return f"the cuda backend runs on CUDA tensors, these are on {device_type!r}"
    if name == "cpu" and device_type != "cpu":
        return f"the cpu backend runs on CPU tensors, these are on {device_type!r}"
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), not {device_type!r}"
    return ""


@functools.lru_cache(maxsize=None)
def _log_fallback_once(name: str, why_not: str) -> None:
    logger.info("fused_accum: backend %r is not available (%s); falling back", name, why_not)


def resolve(requested: str, device: torch.device | str) -> str:
    """Turn ``requested`` ("auto" or a backend name) into a concrete backend name for ``device``."""
    device_type = torch.device(device).type
    requested = os.environ.get(ENV_VAR, requested) if requested == "auto" else requested
    if requested != "auto":
        why_not = availability(requested, device_type)
        if why_not:
            raise RuntimeError(f"backend {requested!r} was requested but is not available: {why_not}")
        return requested
    for name in _AUTO_ORDER["cuda" if device_type == "cuda" else "other"]:
        why_not = availability(name, device_type)
        if not why_not:
            return name
        _log_fallback_once(name, why_not)
    raise AssertionError("the reference backend is always available")


def get(name: str) -> ModuleType:
    """The module implementing backend ``name`` (already resolved and available)."""
    module, why_not = _load(name)
    if module is None:
        raise RuntimeError(f"backend {name!r} is not available: {why_not}")
    return module
