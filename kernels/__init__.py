"""slabserve kernels: Triton kernels for the model step, each beside a PyTorch reference with the same signature,
and native CPU kernels in C for the fp32 CPU path (`kernels.cpu_native`, built on first use).

Imports nothing of the project's other packages. Three names per op:

  rms_norm / rope / silu_mul / kv_write / slab_prefill_attention / slab_decode_attention
      dispatching functions over the `torch.ops.slabserve.*` custom ops (CPU: native where it runs, else the
      reference; CUDA: Triton); `linear` (CPU, panel-packed weights) is in `kernels.ops`
  <op>_ref      the PyTorch reference (the ground truth, and the CPU path where the native kernels do not run)
  <op>_triton   the Triton wrapper (asserts the contract, then launches)

Importing `kernels` is cheap and needs no GPU: the `*_triton` names load Triton on first access.
Contracts (shapes, dtypes, strides) live in `kernels.contracts`; the decode workspace in `kernels.workspace`.
"""

from __future__ import annotations

import importlib

from slabserve.kernels.ops import (
                                   kv_write,
                                   rms_norm,
                                   rope,
                                   silu_mul,
                                   slab_decode_attention,
                                   slab_prefill_attention,
                                   )
from slabserve.kernels.reference import (
                                         kv_write_ref,
                                         rms_norm_ref,
                                         rope_ref,
                                         silu_mul_ref,
                                         slab_decode_attention_ref,
                                         slab_prefill_attention_ref,
                                         prefill_workspace_numel,
                                         cpu_workspace_numel,
                                         )
from slabserve.kernels.workspace import (DecodeWorkspaceSpec, decode_num_splits, decode_workspace_shape,
                                        new_decode_workspace)

_TRITON_EXPORTS = {
    "rms_norm_triton": "slabserve.kernels.triton_rmsnorm",
    "rope_triton": "slabserve.kernels.triton_rope",
    "silu_mul_triton": "slabserve.kernels.triton_silu_mul",
    "kv_write_triton": "slabserve.kernels.triton_kv_write",
    "slab_prefill_attention_triton": "slabserve.kernels.triton_slab_attention",
    "slab_decode_attention_triton": "slabserve.kernels.triton_slab_attention",
}

__all__ = [
    "rms_norm", "rope", "silu_mul", "kv_write", "slab_prefill_attention", "slab_decode_attention",
    "rms_norm_ref", "rope_ref", "silu_mul_ref", "kv_write_ref", "slab_prefill_attention_ref", "prefill_workspace_numel", "cpu_workspace_numel",
    "slab_decode_attention_ref",
    *_TRITON_EXPORTS,
    "DecodeWorkspaceSpec", "decode_num_splits", "decode_workspace_shape", "new_decode_workspace",
]


def __getattr__(name: str):
    """Load a Triton wrapper on first access, so CPU-only processes never import Triton."""
    if name in _TRITON_EXPORTS:
        return getattr(importlib.import_module(_TRITON_EXPORTS[name]), name)
    raise AttributeError(f"module 'slabserve.kernels' has no attribute {name!r}")
