"""A dispatch mode that records the name of every op reaching the dispatcher (tests check that
eager calls skip the custom-op wrapper)."""

from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
