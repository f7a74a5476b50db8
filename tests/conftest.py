"""Fixtures several test files share (the shared constants and builders are in helpers.py).

Also loaded for tests/integration: nothing here imports more than pytest and torch up front."""

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
