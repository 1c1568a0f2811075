"""The GGUF block kernels (kernels/cpu_native.c: linear_q, embed_q) against the `gguf` package's dequantization
followed by an fp32 matmul, on random shapes with edge tails, for every block type the weight arena keeps; their
row invariance (the exactness prefix reuse relies on), their contracts, and that they allocate nothing.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import slabserve.kernels.ops  # noqa: F401  (registers torch.ops.slabserve.*)
from slabserve.kernels import cpu_native, quant, reference
from slabserve.runtime.executor import allocations

from _models import _random_k_blocks

needs_native = pytest.mark.skipif(not cpu_native.available(),
                                  reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")

# (block type, a K its blocks divide): row lengths from one block up to a few, plus SmolLM2's 576 and 1536
SHAPES = [("Q4_0", 96), ("Q4_1", 576), ("Q8_0", 64), ("Q8_0", 1536), ("Q4_K", 512), ("Q6_K", 256), ("F32", 24),
          ("F16", 40), ("BF16", 16)]


def random_rows(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """(n, row_bytes) uint8: n rows of k weights in `name` blocks (real quantizations of random weights where the
    gguf package can quantize the type, random valid blocks where it cannot)."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    if name == "F32":
        data = w.view(np.uint8)
    elif name == "F16":
        data = w.astype(np.float16).view(np.uint8)
    elif name == "BF16":
        data = torch.from_numpy(w).bfloat16().view(torch.int16).numpy().view(np.uint8)
    elif name in ("Q4_K", "Q6_K"):
        data = _random_k_blocks(n, k, gguf.GGMLQuantizationType[name], rng)
    else:
        data = quantize(w, gguf.GGMLQuantizationType[name])
    rows = torch.from_numpy(np.ascontiguousarray(data).reshape(n, -1))
    assert rows.shape[1] == quant.BLOCK_TYPES[name].row_bytes(k)
    return rows


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@needs_native
@pytest.mark.parametrize("name, k", SHAPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 37])
def test_linear_q_matches_gguf_dequantize_then_fp32_matmul(name, k, n):
    rows = random_rows(name, n, k, seed=n)
    dense = quant.dequantize(rows, name, k)  # (n, k): the gguf package's values
    kind = quant.BLOCK_TYPES[name].ggml_id
    for m in (1, 2, 3, 4, 5, 13, 64):
        x, r = _randn(m, k, seed=m), _randn(m, n, seed=m + 1)
        for residual in (None, r):
            got = torch.full((m, n), float("nan"))
            cpu_native.prepare_linear_q(x, rows, got, residual, kind)()
            want = x.double() @ dense.double().t() + (0 if residual is None else residual.double())
            assert _rel(got.double(), want) < 1e-5, (name, k, n, m)
            ref = reference.linear_q_ref(x, rows, torch.empty(m, n), residual, kind)
            assert _rel(ref.double(), want) < 1e-5


@needs_native
@pytest.mark.parametrize("name, k", SHAPES)
def test_embed_q_gives_the_gguf_package_rows_exactly(name, k):
    rows = random_rows(name, 23, k, seed=5)
    kind = quant.BLOCK_TYPES[name].ggml_id
    ids = torch.tensor([0, 22, 5, 5, 11], dtype=torch.int64)
    got = cpu_native.prepare_embed_q(ids, rows, torch.full((5, k), float("nan")), kind)
    out = got.tensors[2]
    got()
    assert torch.equal(out, quant.dequantize(rows, name, k)[ids])
    assert torch.equal(out, reference.embed_q_ref(ids, rows, torch.empty(5, k), kind))


@needs_native
@pytest.mark.parametrize("name, k", [("Q4_0", 96), ("Q4_1", 576), ("Q8_0", 1536), ("Q6_K", 512)])
def test_linear_q_rows_do_not_depend_on_the_other_rows(name, k):
    """Every row of a chunk gets the bits it gets alone or in any other batch: prefix reuse copies KV rows computed
    in one chunking into a prompt that would have computed them in another."""
    rows = random_rows(name, 100, k, seed=1)
    kind = quant.BLOCK_TYPES[name].ggml_id
    x = _randn(70, k, seed=2)
    full = torch.empty(70, 100)
    cpu_native.prepare_linear_q(x, rows, full, None, kind)()
    for start, stop in [(0, 1), (3, 4), (5, 7), (10, 13), (20, 24), (13, 30), (31, 70), (69, 70)]:
        part = torch.empty(stop - start, 100)
        cpu_native.prepare_linear_q(x[start:stop], rows, part, None, kind)()
        assert torch.equal(part, full[start:stop]), (start, stop)


@needs_native
def test_linear_q_writes_a_column_slice_of_a_wider_output_and_nothing_else():
    rows, x = random_rows("Q4_1", 40, 64, seed=3), _randn(6, 64, seed=4)
    wide = torch.full((6, 100), 7.0)
    cpu_native.prepare_linear_q(x, rows, wide[:, 30:70], None, 3)()
    alone = torch.empty(6, 40)
    cpu_native.prepare_linear_q(x, rows, alone, None, 3)()
    assert torch.equal(wide[:, 30:70], alone)
    assert (wide[:, :30] == 7).all() and (wide[:, 70:] == 7).all()


def test_quantized_ops_check_their_contracts():
    rows = random_rows("Q8_0", 20, 64, seed=0)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"linear_q: w has shape \(20, 68\), expected \(30, 68\)"):
        torch.ops.slabserve.linear_q(x, rows, torch.empty(4, 30), None, 8)
    with pytest.raises(ValueError, match="linear_q: rows of 48 weights do not split into whole Q8_0 blocks of 32"):
        torch.ops.slabserve.linear_q(torch.randn(4, 48), rows, torch.empty(4, 20), None, 8)
    with pytest.raises(ValueError, match="linear_q: GGML type 6 has no native kernel"):
        torch.ops.slabserve.linear_q(x, rows, torch.empty(4, 20), None, 6)
    with pytest.raises(ValueError, match="linear_q: residual has shape"):
        torch.ops.slabserve.linear_q(x, rows, torch.empty(4, 20), torch.empty(3, 20), 8)
    with pytest.raises(ValueError, match="embed_q: ids must be"):
        torch.ops.slabserve.embed_q(torch.zeros(3, dtype=torch.int32), rows, torch.empty(3, 64), 8)


@needs_native
def test_embed_q_refuses_an_id_outside_the_vocabulary_and_writes_nothing():
    rows = random_rows("Q8_0", 10, 32, seed=0)
    out = torch.full((2, 32), 3.0)
    run = cpu_native.prepare_embed_q(torch.tensor([1, 10]), rows, out, 8)
    with pytest.raises(ValueError, match="outside the embedding's 10 rows"):
        run()
    assert (out == 3).all()


def test_quantized_ops_opcheck():
    rows = random_rows("Q4_1", 20, 64, seed=0)
    torch.library.opcheck(torch.ops.slabserve.linear_q.default, (torch.randn(5, 64), rows, torch.empty(5, 20),
                                                                 torch.randn(5, 20), 3),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.slabserve.embed_q.default, (torch.tensor([0, 19, 3]), rows, torch.empty(3, 64), 3),
                          test_utils=("test_schema", "test_faketensor"))


@needs_native
def test_quantized_kernels_allocate_nothing():
    rows = random_rows("Q4_K", 40, 512, seed=0)
    x, out, res = torch.randn(8, 512), torch.empty(8, 40), torch.randn(8, 40)
    runs = [cpu_native.prepare_linear_q(x, rows, out, res, 12),
            cpu_native.prepare_linear_q(x[:1], rows, out[:1], None, 12),
            cpu_native.prepare_embed_q(torch.tensor([3, 1, 39]), rows, torch.empty(3, 512), 12)]
    assert allocations(lambda: [run() for run in runs], steps=5) == []


def test_q8_0_quantization_round_trips_through_the_gguf_package():
    w = _randn(6, 64, seed=9)
    rows = quant.quantize_q8_0(w)
    assert tuple(rows.shape) == (6, 68) and rows.dtype == torch.uint8
    torch.testing.assert_close(quant.dequantize(rows, "Q8_0", 64), w, atol=float(w.abs().max()) / 127, rtol=0)


def test_the_instruction_set_is_the_widest_the_cpu_has_unless_forced(monkeypatch):
    monkeypatch.delenv("SLABSERVE_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert cpu_native.isa() == "avx2"
    monkeypatch.setattr(cpu_native, "_cpu_flags",
                        lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert cpu_native.isa() == "avx512"
    assert cpu_native.library_path("avx512").name.startswith("slabserve_cpu_avx512_")
    assert cpu_native.library_path("avx2") != cpu_native.library_path("avx512")
    monkeypatch.setenv("SLABSERVE_CPU_ISA", "avx2")
    assert cpu_native.isa() == "avx2"
    monkeypatch.setenv("SLABSERVE_CPU_ISA", "sse")
    with pytest.raises(RuntimeError, match="SLABSERVE_CPU_ISA='sse' is not one of avx2, avx512"):
        cpu_native.isa()


@needs_native
@pytest.mark.skipif(cpu_native.isa() != "avx512" or "SLABSERVE_CPU_ISA" in __import__("os").environ,
                    reason="runs where the AVX-512 build is the default, to test the AVX2 build beside it")
def test_the_avx2_build_passes_the_kernel_tests_too():
    """On an AVX-512 machine the suite runs the AVX-512 library; the AVX2 one (what an AVX2-only CPU loads) runs the
    same kernel tests here, in a process that forces it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests / "test_quant_kernels.py"), str(tests / "test_cpu_native.py"),
                           str(tests / "test_cpu_attention.py")],
                          env={**os.environ, "SLABSERVE_CPU_ISA": "avx2"}, capture_output=True, text=True,
                          cwd=tests.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "(avx2)" in subprocess.run(
        [sys.executable, "-P", "-c", "from slabserve.kernels import cpu_native; print(cpu_native.status())"],
        env={**os.environ, "SLABSERVE_CPU_ISA": "avx2"}, capture_output=True, text=True, check=True).stdout
