"""The step traced at every bucket, as the planners see it: intermediates with lifetimes, and a graph fingerprint.

Contract: `trace_buckets(config, dtype, buckets, max_seqs, kv_rows, rope_positions, device)` exports the
runtime's step (runtime.trace) once per bucket without reading a weight or allocating memory, whatever the model
and the target, so a CPU-only machine traces an 8B model for an H100:
- for a `cuda` target, on a step whose weights live on the `meta` device (runtime.trace.meta_step): the step takes
  the same branches on meta as on CUDA, and the fingerprint leaves devices out;
- for a `cpu` target, under a FakeTensorMode with CPU fake weights and inputs: the step takes its CPU branches
  (the CPU attention scratch is a graph node there and not on CUDA), so the graph is the one the server traces at
  start-up with real weights, fingerprint included (tests/test_build_plan.py checks both agree).

The activations do not depend on `kv_rows` (the KV caches are graph inputs); the fingerprint does, through the
caches' shapes. The compiler therefore traces once to size the activation arena, plans the KV slabs in what is
left, and traces again at the planned rows for the fingerprints, checking the activations came out the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from slabserve.runtime.config import ModelConfig
from slabserve.runtime.model import LlamaStep, empty_packed
from slabserve.runtime.trace import activation_tensors, export_step, graph_fingerprint, k_cache_tiled, meta_step


@dataclass(frozen=True, slots=True)
class Intermediate:
    name: str  # node name, the executor's key
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", ...
    nbytes: int  # bytes its traced strides span
    first_use: int
    last_use: int


@dataclass(frozen=True, slots=True)
class TracedBucket:
    tokens: int
    tensors: tuple[Intermediate, ...]  # graph order
    fingerprint: str
    program: Any  # the torch.export ExportedProgram (for the ONNX export); not part of equality
    kv_rows: int


def trace_buckets(config: ModelConfig, dtype: torch.dtype, buckets: Sequence[int], max_seqs: int, *,
                  kv_rows: int, rope_positions: int, device: str, gemm: str = "aten",
                  kv_dtype: torch.dtype | None = None, blocks: dict[str, str] | None = None) -> list[TracedBucket]:
    """`kv_dtype`: the KV caches' dtype (the plan's kv_dtype; default `dtype`); `blocks`: the block types of a
    quantized weight format (runtime.model.weight_blocks)."""
    kv_dtype = kv_dtype or dtype
    tiled = k_cache_tiled(config, device, dtype, kv_dtype)  # the K cache's layout on the target, as Engine has it
    if device != "cpu":
        step = meta_step(config, dtype, rope_positions, gemm, blocks)
        return [trace_bucket(step, tokens, max_seqs, kv_rows, kv_dtype, tiled) for tokens in buckets]
    # torch.export's own fake-tensor machinery; a private module, but the one export itself runs on
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        step = LlamaStep(config, empty_packed(config, dtype, gemm, blocks), rope_positions, gemm=gemm, blocks=blocks)
        return [trace_bucket(step, tokens, max_seqs, kv_rows, kv_dtype, tiled) for tokens in buckets]


def trace_bucket(step: LlamaStep, tokens: int, max_seqs: int, kv_rows: int,
                 kv_dtype: torch.dtype | None = None, k_tiled: bool = False) -> TracedBucket:
    program = export_step(step, tokens, max_seqs, kv_rows, kv_dtype=kv_dtype, k_tiled=k_tiled)
    tensors = tuple(Intermediate(name=t.name, shape=tuple(t.shape), dtype=dtype_name(t.dtype), nbytes=t.nbytes,
                                 first_use=t.first_use, last_use=t.last_use) for t in activation_tensors(program))
    return TracedBucket(tokens=tokens, tensors=tensors, fingerprint=graph_fingerprint(program), program=program,
                        kv_rows=kv_rows)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")
