"""fused_accum.extension.swap_storages (issue 37): the O(1) swap of two host buffers' memory
that offload's double-buffered state commits with. Every view of either buffer follows it, no
version counter moves, both blocks are freed once; what is not a whole same-sized CPU storage
is refused. Run with the extension (the DataPtr swap) and with its fallback (a copy)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fused_accum import extension

IMPLS = ["copy"] + (["ext"] if extension._C is not None else [])


@pytest.fixture(params=IMPLS)
def swap(request, monkeypatch):
    if request.param == "copy":
        monkeypatch.setattr(extension, "_C", None)
    return extension.swap_storages


def test_views_follow(swap):
    a = torch.arange(12, dtype=torch.float32)
    b = -torch.arange(12, dtype=torch.float32)
    va, vb = a[2:6].view(2, 2), b[4:]
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    swap(a, b)
    assert torch.equal(a, -torch.arange(12.0)) and torch.equal(b, torch.arange(12.0))
    assert torch.equal(va, -torch.arange(2.0, 6.0).view(2, 2)) and torch.equal(vb, torch.arange(4.0, 12.0))
    if extension._C is not None:  # (the fixture unset it for the copy)
        assert (a.data_ptr(), b.data_ptr()) == (ptr_b, ptr_a)  # (the memory moved, not the values)
    va.add_(100)  # a write through a view lands in the memory the buffer now has
    assert a[2].item() == 98.0


@pytest.mark.skipif(extension._C is None, reason="the DataPtr swap needs the extension")
def test_versions_untouched_and_freed_once():
    a, b = torch.ones(1000), torch.zeros(1000)
    view = a[10:20]
    versions = (a._version, b._version, view._version)
    extension.swap_storages(a, b)
    assert (a._version, b._version, view._version) == versions
    assert view.sum().item() == 0 and b.sum().item() == 1000
    refs = [weakref.ref(a.untyped_storage()), weakref.ref(b.untyped_storage())]
    del a, b, view
    gc.collect()
    # (each DataPtr keeps its deleter: a double free or a leak would abort or show in ASan; here
    # both storages go)
    assert all(r() is None for r in refs)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.zeros(8), torch.zeros(9)),  # sizes differ
        lambda: (torch.zeros(8)[2:], torch.zeros(6)),  # a view, not its whole storage
        lambda: (torch.zeros(4, 4).t(), torch.zeros(4, 4)),  # not contiguous
        lambda: (torch.zeros(8, dtype=torch.float64)[:4], torch.zeros(8)),  # part of its storage
    ],
)
def test_refuses(swap, make):
    a, b = make()
    with pytest.raises(RuntimeError, match="swap_storages"):
        swap(a, b)


def test_refuses_one_storage(swap):
    a = torch.zeros(8)
    with pytest.raises(RuntimeError, match="share their storage"):
        swap(a, a.view(2, 4))


@pytest.mark.skipif(extension._C is None, reason="the copy swaps values, from any allocator")
def test_refuses_storages_from_different_allocators_naming_shared_memory():
    """A buffer moved into shared memory (share_memory_(): A3C's shared optimizer state) cannot
    exchange its memory with a pageable one; the refusal says so (it once named only pinned
    memory). Offload copies into such a buffer instead (tests/test_offload.py)."""
    a, b = torch.zeros(8), torch.zeros(8)
    a.share_memory_()
    with pytest.raises(RuntimeError, match=r"different allocators .*shared memory by share_memory_\(\)"):
        extension.swap_storages(a, b)
