"""GGUF block formats as the weight arena keeps them (`weight_format: gguf` or `q8_0` in a spec).

A quantized (N, K) projection is N rows of K / block_size blocks each, byte for byte as the GGUF file stores them
(row n is output feature n), held in the arena as a (N, row_bytes) uint8 tensor. `BLOCK_TYPES` names every type the
native kernels read (kernels/cpu_native.c: dequant_row) with its GGML id, block size and block bytes; F32 and F16
rows go through the same kernels, so a GGUF whose small tensors are stored unquantized needs no other path.

`dequantize` is the ground truth the kernels are tested against: the `gguf` package's own dequantization (numpy),
the same code `transformers` runs when it loads a GGUF. `quantize_q8_0` is the plan-time quantization for
safetensors models, again the `gguf` package's (bit-exact with ggml's reference quantizer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slabserve.runtime import plan as _plan


@dataclass(frozen=True, slots=True)
class BlockType:
    name: str         # GGML's name: "Q4_1", ...
    ggml_id: int      # gguf.GGMLQuantizationType value (the kernels' type code)
    block_size: int   # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.block_bytes


BLOCK_TYPES = {t.name: t for t in (
    BlockType("F32", 0, 8, 32), BlockType("F16", 1, 8, 16), BlockType("BF16", 30, 8, 16),
    BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20), BlockType("Q8_0", 8, 32, 34),
    BlockType("Q4_K", 12, 256, 144), BlockType("Q6_K", 14, 256, 210),
)}
# Weight formats a plan can choose (runtime.plan.EngineSection.weight_format): "float" dequantizes every tensor to
# the plan's dtype (the layout of `gemm`); "gguf" keeps each projection and the embedding in the file's own blocks;
# "q8_0" quantizes every projection and the embedding to Q8_0 at load (for safetensors models, or to requantize).
WEIGHT_FORMATS = _plan.WEIGHT_FORMATS
MAX_K = 65536  # the kernels' stack scratch (kernels/cpu_native.c: MAX_QUANT_K)


def block_type(name: str, what: str = "weights") -> BlockType:
    """The block type called `name`, or ValueError naming `what` and the types the kernels read."""
    if name not in BLOCK_TYPES:
        raise ValueError(f"{what}: block type {name} has no native kernel; the kernels read "
                         f"{', '.join(BLOCK_TYPES)} (use weight_format: float to dequantize it at load)")
    return BLOCK_TYPES[name]


def fits(name: str, k: int) -> bool:
    """Whether rows of k weights split into whole blocks of `name` (and fit the kernels' scratch)."""
    t = BLOCK_TYPES.get(name)
    return t is not None and k % t.block_size == 0 and 0 < k <= MAX_K


def by_id(ggml_id: int) -> BlockType:
    for t in BLOCK_TYPES.values():
        if t.ggml_id == ggml_id:
            return t
    raise ValueError(f"GGML type {ggml_id} has no native kernel; the kernels read {', '.join(BLOCK_TYPES)}")


def dequantize(rows: torch.Tensor | np.ndarray, name: str, k: int) -> torch.Tensor:
    """(N, row_bytes) uint8 rows of `name` blocks -> (N, k) float32, with the `gguf` package's dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    data = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    if name == "F32":
        out = data.view(np.float32)
    elif name == "F16":
        out = data.view(np.float16).astype(np.float32)
    elif name == "BF16":
        out = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        out = gguf_dequantize(data, GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(data.shape[0], k))


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float -> (N, K / 32 * 34) uint8 Q8_0 rows, with the `gguf` package's quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(w.detach().to(torch.float32).cpu().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(data))
