"""LiveBytes, a dispatch mode that counts the bytes of the storages ops allocate (tests/test_infra.py's refresh peak,
tests/test_memory.py's plan checks)."""
import weakref

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops allocate while the mode is on and that are still alive (now), and their most
    at once (peak); storages that existed before the mode (`old`: parameters, whose views cost nothing) are not
    counted, nor an async collective's result (no storage of its own)."""

    def __init__(self, old=()):
        super().__init__()
        self.live, self.now, self.peak, self.old = {}, 0, 0, set(old)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, AsyncCollectiveTensor):
                st = getattr(t, "_local_tensor", t).untyped_storage()
                if st.data_ptr() not in self.live and st.data_ptr() not in self.old and st.nbytes():
                    self.live[st.data_ptr()] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self.free, st.data_ptr())
        return out

    def free(self, ptr):
        self.now -= self.live.pop(ptr)
