"""Backends: the one registry of what each backend is, and the one place that picks one.

A backend is a module exposing ``accumulate``, ``fold_pieces`` and ``step(op, t, s, h)``, which
runs any step op of :data:`fused_accum.ops.STEP_OPS` on the records ``t, s, h`` declared there,
with the contracts of :mod:`fused_accum.backends.reference`. Each is declared once in
``_REGISTRY`` below with everything the rest of the package asks about it, and asked through
these functions only: :func:`availability` (where it can run), :func:`get` (its module),
:func:`takes_plan`, :func:`fast_folds`, :func:`wgrad_kernel`. The backend modules are imported by
name when first asked for (``triton`` needs ``triton``, ``cpu``/``cuda`` the built extension).

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
from typing import Callable, NamedTuple, Optional

import torch

logger = logging.getLogger("fused_accum")


def _any_device(device_type: str) -> str:
    return ""


def _cuda_only(device_type: str) -> str:
    return "" if device_type == "cuda" else f"the cuda backend runs on CUDA tensors, these are on {device_type!r}"


def _cpu_only(device_type: str) -> str:
    return "" if device_type == "cpu" else f"the cpu backend runs on CPU tensors, these are on {device_type!r}"


def _cuda_or_interpreted(device_type: str) -> str:
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    return f"Triton runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), not {device_type!r}"


class Backend(NamedTuple):
    """What the package asks about one backend."""

    module: str  # the submodule (of this package) implementing the ops
    runs_on: Callable[[str], str]  # device type -> "" or why this backend cannot run there
    takes_plan: bool  # its ops take ``plan=`` (fused_accum.ops passes it to no other backend)
    fast_folds: bool  # its accumulate_ is one the C++ hooks can call themselves (_C's operators)
    wgrad: str  # "submodule:function": its weight-gradient GEMM (fused_accum.backends.wgrad)


# The order is NAMES' order, which error messages and benchmarks list.
_REGISTRY = {
    "reference": Backend("reference", _any_device, takes_plan=False, fast_folds=False, wgrad="wgrad:reference"),
    "triton": Backend(
        "triton", _cuda_or_interpreted, takes_plan=True, fast_folds=False, wgrad="triton.wgrad:wgrad_accumulate"
    ),
    "cpu": Backend("ext", _cpu_only, takes_plan=False, fast_folds=True, wgrad="wgrad:cpu"),
    "cuda": Backend("ext", _cuda_only, takes_plan=False, fast_folds=True, wgrad="wgrad:cuda"),
}
NAMES = tuple(_REGISTRY)
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "other": ("cpu", "reference")}
ENV_VAR = "FUSED_ACCUM_BACKEND"


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[Optional[ModuleType], str]:
    """Import backend ``name``; return (module, "") or (None, why it is unavailable)."""
    try:
        module = importlib.import_module(f"{__name__}.{_REGISTRY[name].module}")
    except ImportError as err:  # a missing optional dependency or an unbuilt extension
        return None, f"{type(err).__name__}: {err}"
    # A backend module may define unavailable_reason(name) -> "" or why it cannot run.
    why_not = getattr(module, "unavailable_reason", lambda _name: "")(name)
    return (None, why_not) if why_not else (module, "")


def availability(name: str, device_type: str) -> str:
    """Return "" when backend ``name`` can run on ``device_type`` tensors, else the reason."""
    if name not in _REGISTRY:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    module, why_not = _load(name)
    if module is None:
        return why_not
    return _REGISTRY[name].runs_on(device_type)


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


def takes_plan(name: str) -> bool:
    """Whether backend ``name``'s ops take ``plan=`` (a host-side cache key; see fused_accum.ops).
    False for a name that is not a backend: its call fails in :func:`get` instead."""
    backend = _REGISTRY.get(name)
    return backend is not None and backend.takes_plan


def fast_folds(name: str) -> bool:
    """Whether the window may fold a bucket on its fast path (grants, quiet backwards) on backend
    ``name``: its accumulate_ is one of fused_accum._C's operators, which the C++ hooks call
    themselves. False for a name that is not a backend."""
    backend = _REGISTRY.get(name)
    return backend is not None and backend.fast_folds


def wgrad_kernel(name: str, device: torch.device | str | None = None) -> Callable:
    """The weight-gradient GEMM of backend ``name`` (contract: :mod:`fused_accum.backends.wgrad`),
    or of the backend "auto" picks for ``device``. It needs nothing of the backend's own module
    (cpu and cuda's is torch BLAS, which runs without the extension), so it is not gated on
    :func:`availability`; triton's imports triton."""
    if name == "auto":
        if device is None:
            raise ValueError("wgrad_accumulate: backend 'auto' needs the device to resolve it on")
        name = resolve("auto", device)
    if name not in _REGISTRY:
        raise ValueError(f"wgrad_accumulate: backend must be one of {sorted(NAMES)} or 'auto', got {name!r}")
    return _wgrad_of(name)


@functools.lru_cache(maxsize=None)
def _wgrad_of(name: str) -> Callable:
    module, function = _REGISTRY[name].wgrad.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
