"""Large host arenas, zeroed and committed at start-up, fast.

The KV arena of the default plan is 3.5 GiB. `torch.zeros` commits it by writing every byte from user space, one
page fault per 4 KiB page: about 5 s on this repository's 2-core VM (3.2 s at one thread: the two threads' faults
contend). The same pages mapped fresh (anonymous memory is zero) and populated by the kernel in one call,
`madvise(MADV_POPULATE_WRITE)` (Linux 5.14+), take about 1.5 s. Either way every page is resident before serving,
so a plan that fits at start cannot fail for memory under traffic (runtime.memcheck) and no step pays a page fault.
Where the call is refused (an older kernel), the arena is zeroed by writing it, as before.
"""
from __future__ import annotations

import ctypes
import math
import mmap

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK_BYTES = 16 << 20


def _madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def committed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape` and `dtype` in memory of its own (an anonymous mapping, which its storage
    keeps alive: torch.frombuffer holds a reference to the mmap object), every page resident on return."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    base = tensor.data_ptr()
    for start in range(0, nbytes, CHUNK_BYTES):  # in chunks: each call holds the process's mmap lock, which every
        # allocation of the thread beside it (reading the model while this runs: runtime.engine.KVCommit) waits on
        if _MADVISE is None or _MADVISE(base + start, min(CHUNK_BYTES, nbytes - start), MADV_POPULATE_WRITE) != 0:
            tensor.view(-1).view(torch.uint8)[start:].zero_()  # commit by writing: fresh pages are zero already
            break
    return tensor
