"""A guard that fails a test on any host read of a tensor value (a GPU sync in a decode step)."""

import contextlib

import torch


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync():
    """Any read of a tensor value on the host raises inside the block."""
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def raiser(name):
        def f(self, *a, **k):
            raise HostSync(f"host sync: Tensor.{name}")
        return f

    for n in names:
        setattr(torch.Tensor, n, raiser(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
