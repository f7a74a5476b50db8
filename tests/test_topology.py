"""The topologies' fixed points: the table in fused_accum/topology/base.py is the interface.

The window, its folds and the step call a topology only at the fixed points the base class
declares; the table in the base module's docstring names each one. These tests hold the table,
the base class and every topology to each other, so a fixed point added (or a helper made
public) in one place only fails here.
"""

from __future__ import annotations

import inspect
import re

import pytest

from fused_accum.topology import base
from fused_accum.topology import Local
from fused_accum.topology.base import Topology
from fused_accum.topology.fsdp import FSDP2
from fused_accum.topology.native import Native
from fused_accum.topology.replicated import Replicated
from fused_accum.topology.zero import Zero


def _table() -> set:
    """The names in the first column of the base module's table."""
    return set(re.findall(r"^``(\w+)``  ", base.__doc__, flags=re.MULTILINE))


def _public(cls) -> set:
    return {name for name in vars(cls) if not name.startswith("_") and name != "name"}


def test_the_table_names_every_fixed_point_of_the_base_and_nothing_else():
    assert _table() == _public(Topology)


@pytest.mark.parametrize("cls", [Local, Native, Replicated, Zero, FSDP2])
def test_a_topology_defines_no_public_member_the_base_does_not_declare(cls):
    assert _public(cls) <= _public(Topology), _public(cls) - _public(Topology)
    for name in _public(cls):
        declared, defined = getattr(Topology, name), getattr(cls, name)
        if callable(declared) and not isinstance(declared, type):
            assert list(inspect.signature(defined).parameters) == list(inspect.signature(declared).parameters), name
