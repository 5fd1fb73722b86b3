"""Memory of a function as it runs: the bytes autograd saves for backward (:func:`saved_activation_bytes`,
which the tests compare with the activation model) and the peak of live tensor storages, also on CPU
(:func:`peak_memory_bytes`, which the tests and ``tensorpar train``'s ``tensor_peak`` measurement use).
"""
from __future__ import annotations


def saved_activation_bytes(fn, params=()) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, bytes of the distinct storages autograd saves for backward
    while it runs), leaving out the storages of ``params`` (a linear layer saves a view of its weight)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def peak_memory_bytes(fn, baseline=()) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, the peak bytes of live tensor storages while it ran, above
    those of ``baseline`` tensors, e.g. the parameters). Works on CPU, where torch keeps no allocator
    statistics: every operator's outputs are recorded through a dispatch mode and dropped once their
    storage is freed. Slow (a Python call per operator); meant for small models in tests."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveStorages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
            self.current = self.peak = 0

        def track(self, tensors) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in self.refs:
                        self.refs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                        self.current += st.nbytes()
            self.peak = max(self.peak, self.current)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
                self.current -= self.refs.pop(key)[1]  # freed before the outputs reuse its address
            self.track(tree_flatten(out)[0])
            return out

    mode = LiveStorages()
    mode.track(baseline)
    start = mode.current
    with mode:
        result = fn()
    return result, mode.peak - start
