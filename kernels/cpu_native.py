"""The native CPU kernels (kernels/cpu_native.c): built on first use with the machine's C compiler, loaded with
ctypes, and called with every pointer bound once.

Contract: `available()` says whether the kernels run here (an x86-64 CPU with AVX2 and FMA, a C compiler with
OpenMP; `unavailable_reason()` says what is missing). `pack_panels(w)` turns a (K, N) weight into the panel layout
the native linear reads, (ceil(N / 16), K, 16); `unpack_panels` undoes it. `prepare_linear(x, w, out, residual)`
checks the call once and returns a `run()` that computes `out = x @ W (+ residual)` into `out` with no Python work
beyond one foreign call, for the planned executor to call every step; `linear_native` is the one-shot form.
`prepare_slab_attention`, `prepare_rms_norm`, `prepare_silu_mul`, `prepare_rope` and `prepare_kv_write` do the
same for the other ops, with the references' signatures and semantics, and hand back the reference's own prepared
call for what the native kernels do not take (other dtypes or layouts, or no library). `fuse_calls(runs)` turns a
sequence of such runs (a bound step's) into fewer callables: each stretch of native ones becomes one foreign call
that runs them in C in the same order (`slabserve_run_calls`), so a step pays ctypes once per stretch, not per op.

The library is compiled from the source beside this file into a cache folder keyed by the source's hash
(`$SLABSERVE_KERNEL_CACHE`, else `~/.cache/slabserve/kernels`), written to a temporary name and renamed into
place, so processes that build it at once never load a half-written file. `status()` builds it ahead of time
(the Makefile calls it) and says where it is or why there is none.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch  # first: the library's OpenMP calls bind to the runtime torch loaded (one thread pool)

from slabserve.kernels import contracts, reference
from slabserve.kernels.contracts import PANEL, check_linear, panel_shape

SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: a product and a sum stay two roundings where the C says so (GGUF dequantization must give the
# `gguf` package's values exactly: d * q + m, not fma(d, q, m)); the kernels ask for FMA by name where they want it.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
# One library per instruction set, from the same source: the AVX-512 build runs the quantized dot products in 16
# lanes (cpu_native.c: `vf`). isa() picks the widest the CPU has; SLABSERVE_CPU_ISA=avx2 forces the narrower one.
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")}
_ISA_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                              "avx512vl", "avx512dq"}}
_LIBS = ("-lm",)
_state: dict[str, object] = {}  # "lib": the loaded CDLL, or "error": why there is none (filled once)

_I, _P, _F, _RC = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # C function -> (return type, argument types), as declared in cpu_native.c
    "slabserve_linear_f32": (None, [_I, _I, _I, _P, _I, _P, _P, _I, _P, _I, _P, _I, _I]),
    "slabserve_slab_attention_f32": (_RC, [_I, _I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _F, _P, _I]),
    "slabserve_rms_norm_f32": (None, [_I, _I, _P, _I, _P, _F, _P, _I, _P, _I]),
    "slabserve_silu_mul_f32": (None, [_I, _I, _P, _I, _P, _I, _P, _I]),
    "slabserve_rope_f32": (_RC, [_I, _I, _I, _I, _P, _I, _P, _I, _P, _P, _I]),
    "slabserve_kv_write_f32": (_RC, [_I, _I, _P, _I, _P, _I, _P, _P, _P, _I, _I]),
    "slabserve_quant_row_bytes": (_I, [_I, _I]),
    "slabserve_linear_q": (_RC, [_I, _I, _I, _P, _I, _P, _I, _I, _P, _I, _P, _I, _P, _I, _I]),
    "slabserve_embed_q": (_RC, [_I, _P, _I, _I, _P, _I, _I, _P, _I]),
    "slabserve_run_calls": (_I, [_P, _I]),
}
# The functions slabserve_run_calls dispatches to, by its op numbers (cpu_native.c: OP_LINEAR_F32 ...), and the
# int64 slots one call takes there (CALL_SLOTS: the op, then each argument).
_CALL_OPS = {"slabserve_linear_f32": 1, "slabserve_slab_attention_f32": 2, "slabserve_rms_norm_f32": 3,
             "slabserve_silu_mul_f32": 4, "slabserve_rope_f32": 5, "slabserve_kv_write_f32": 6,
             "slabserve_linear_q": 7, "slabserve_embed_q": 8}
_CALL_SLOTS = 20


def _cache_dir() -> Path:
    root = os.environ.get("SLABSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "slabserve" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def isa() -> str:
    """The instruction set the kernels are built for here: "avx512" where the CPU has AVX-512 F, BW, VL and DQ (and
    the kernel enabled them), else "avx2"; $SLABSERVE_CPU_ISA (avx2 or avx512) overrides it, to test both paths."""
    forced = os.environ.get("SLABSERVE_CPU_ISA")
    if forced:
        if forced not in ISA_FLAGS:
            raise RuntimeError(f"SLABSERVE_CPU_ISA={forced!r} is not one of {', '.join(ISA_FLAGS)}")
        return forced
    return "avx512" if _ISA_CPU_FLAGS["avx512"] <= _cpu_flags() else "avx2"


def library_path(which: str | None = None) -> Path:
    """Where the library built from the current source for instruction set `which` (default: isa()) lives, whether
    or not it is built yet."""
    which = which or isa()
    flags = _FLAGS + ISA_FLAGS[which]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    return _cache_dir() / f"slabserve_cpu_{which}_{digest}.so"


def build(which: str | None = None) -> Path:
    """Compile the library for `which` (default: isa()) if it is not in the cache yet; its path. Raises RuntimeError
    saying what failed."""
    which = which or isa()
    target = library_path(which)
    if target.is_file():
        return target
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the native CPU kernels are x86-64 Linux only (this is {sys.platform} "
                           f"{os.uname().machine})")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc, clang): install gcc to use the native CPU "
                           "kernels")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, *ISA_FLAGS[which], str(SOURCE), "-o", tmp, *_LIBS],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    if "lib" in _state or "error" in _state:
        return _state.get("lib")  # type: ignore[return-value]
    try:
        which = isa()
        lib = ctypes.CDLL(str(build(which)))
        if not lib.slabserve_cpu_supported():
            raise RuntimeError(f"this CPU lacks {'AVX-512 F/BW/VL/DQ or ' if which == 'avx512' else ''}AVX2, FMA "
                               f"or F16C, which the native CPU kernels built for {which} need")
        _state["isa"] = which
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _state["lib"] = lib
    except (OSError, RuntimeError) as exc:
        _state["error"] = str(exc)
    return _state.get("lib")  # type: ignore[return-value]


def _bind(tensors: tuple, fn: Callable, *args) -> Callable:
    """fn(*args) as an argument-free call. `args` hold raw data pointers, so the call keeps `tensors` alive: a
    prepared op never writes into memory that was freed and reused after its tensors went away. The call also
    carries its arguments as the int64 slots of slabserve_run_calls (`native`), for `fuse_calls`."""
    call = partial(fn, *args)
    call.tensors = tensors  # type: ignore[attr-defined]
    call.native = _call_slots(fn.__name__, args)  # type: ignore[attr-defined]
    return call


def _call_slots(name: str, args: tuple) -> list[int]:
    """One call of C function `name` as slabserve_run_calls reads it: its op number, then each argument as an int64
    (a pointer's address, 0 for NULL; a float's bits, rounded to float32 as ctypes would pass it)."""
    slots = [_CALL_OPS[name]]
    for value, kind in zip(args, _SIGNATURES[name][1], strict=True):
        if kind is _F:
            slots.append(struct.unpack("<I", struct.pack("<f", value))[0])
        else:
            slots.append(0 if value is None else int(value))
    if len(slots) > _CALL_SLOTS:
        raise ValueError(f"{name} takes {len(slots) - 1} arguments, more than slabserve_run_calls holds")
    return slots + [0] * (_CALL_SLOTS - len(slots))


def _checked(call: Callable, run: Callable[[], None]) -> Callable[[], None]:
    """`run` (which calls `call` and raises on its refusal) carrying `call`'s tensors and native slots."""
    run.tensors = call.tensors  # type: ignore[attr-defined]
    run.native = call.native  # type: ignore[attr-defined]
    return run


def fuse_calls(calls: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """`calls` (argument-free callables, run in order) with each run of two or more prepared native calls replaced
    by one call that runs them all in C (slabserve_run_calls): the same functions on the same arguments in the
    same order, so the same bits, without one ctypes call each. Where a fused call refuses its arguments, its own
    prepared call runs again to raise its error (a refused call has done nothing; the calls before it have run)."""
    lib = _load()
    out: list[Callable[[], object]] = []
    stretch: list[Callable[[], object]] = []

    def flush() -> None:
        if len(stretch) >= 2 and lib is not None:
            out.append(_fused(lib, list(stretch)))
        else:
            out.extend(stretch)
        stretch.clear()

    for call in calls:
        if getattr(call, "native", None) is not None:
            stretch.append(call)
        else:
            flush()
            out.append(call)
    flush()
    return out


def _fused(lib: ctypes.CDLL, calls: list[Callable[[], object]]) -> Callable[[], None]:
    table = (ctypes.c_int64 * (_CALL_SLOTS * len(calls)))(*(s for c in calls for s in c.native))
    go = partial(lib.slabserve_run_calls, ctypes.addressof(table), len(calls))

    def run() -> None:
        failed = go()
        if failed >= 0:
            calls[failed]()  # raises the refusing op's own error
            raise RuntimeError(f"slabserve_run_calls: call {failed} was refused, but not when run alone")

    run.table = table  # type: ignore[attr-defined]
    run.calls = calls  # type: ignore[attr-defined]
    return run


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state.get("error")  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------- layout


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """(K, N) -> (ceil(N / 16), K, 16) contiguous: panel p holds columns 16p .. 16p + 15, the last zero-padded."""
    k, n = w.shape
    panels = torch.zeros(panel_shape(k, n), dtype=w.dtype, device=w.device)  # (P, K, 16)
    full = n // PANEL
    panels[:full].copy_(w[:, : full * PANEL].reshape(k, full, PANEL).permute(1, 0, 2))
    if n % PANEL:
        panels[full, :, : n % PANEL].copy_(w[:, full * PANEL :])
    return panels


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The (K, n) matrix a panel-packed weight holds (a new tensor)."""
    p, k, _ = panels.shape
    return panels.permute(1, 0, 2).reshape(k, p * PANEL)[:, :n].contiguous()


# ---------------------------------------------------------------------------------------------------- linear


def _library_for(op: str, *tensors: torch.Tensor) -> ctypes.CDLL:
    """The loaded library for a call of `op` on CPU `tensors`, or the error saying why the native kernel cannot run."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"{op}: the native CPU kernels are not available here: {unavailable_reason()}")
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{op}: the native kernel takes CPU tensors only")
    return lib


def _live(op: str, rows: torch.Tensor | None) -> tuple[int | None, int]:
    """(address, entries) of the query_start the kernel counts its live rows from at each call
    (contracts.check_live_rows), or (None, 0): every row."""
    if rows is None:
        return None, 0
    contracts.check_live_rows(op, rows)
    if rows.device.type != "cpu":
        raise ValueError(f"{op}: rows must be a CPU tensor for the native kernel, got {rows.device}")
    return rows.data_ptr(), rows.shape[0]


def prepare_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, per_sequence: bool = False) -> Callable[[], None]:
    """Check once and bind: `run()` computes out = x @ W (+ residual) with the native kernel, over the live rows
    of x when `rows` (the step's query_start) is given: its real tokens, or with `per_sequence` its real
    sequences (kernels.ops: ROWS)."""
    check_linear(x, w, out, residual)
    lib = _library_for("linear", x)
    m, k = x.shape
    return _bind((x, w, out, residual, rows), lib.slabserve_linear_f32, m, out.shape[1], k, x.data_ptr(),
                 x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0),
                 residual.data_ptr() if residual is not None else None,
                 residual.stride(0) if residual is not None else 0, *_live("linear", rows), int(per_sequence))


def linear_native(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, per_sequence: bool = False) -> torch.Tensor:
    prepare_linear(x, w, out, residual, rows, per_sequence)()
    return out




# ---------------------------------------------------------------------------------------------------- GGUF blocks


def prepare_linear_q(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                     qtype: int, rows: torch.Tensor | None = None, per_sequence: bool = False) -> Callable[[], None]:
    """Check once and bind: `run()` computes out = x @ W^T (+ residual), W rows of GGUF blocks of GGML type `qtype`
    (kernels.quant), dequantized in the kernel with the `gguf` package's arithmetic; over the live rows of x when
    `rows` is given, as prepare_linear."""
    contracts.check_linear_q(x, w, out, residual, qtype)
    lib = _library_for("linear_q", x)
    m, k = x.shape
    call = _bind((x, w, out, residual, rows), lib.slabserve_linear_q, m, out.shape[1], k, x.data_ptr(),
                 x.stride(0), w.data_ptr(), w.shape[1], qtype, out.data_ptr(), out.stride(0),
                 residual.data_ptr() if residual is not None else None,
                 residual.stride(0) if residual is not None else 0, *_live("linear_q", rows), int(per_sequence))

    def run() -> None:
        if call():
            raise ValueError(f"linear_q: GGML type {qtype} with rows of {k} weights is not {w.shape[1]} bytes a row")

    return _checked(call, run)


def prepare_embed_q(ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, qtype: int) -> Callable[[], None]:
    """Check once and bind: `run()` writes row ids[t] of W (GGUF blocks of type `qtype`), dequantized, to out[t]."""
    contracts.check_embed_q(ids, w, out, qtype)
    lib = _library_for("embed_q")
    if ids.stride(0) != 1:
        raise ValueError("embed_q: ids must be contiguous")
    call = _bind((ids, w, out), lib.slabserve_embed_q, ids.shape[0], ids.data_ptr(), w.shape[0], out.shape[1],
                 w.data_ptr(), w.shape[1], qtype, out.data_ptr(), out.stride(0))

    def run() -> None:
        if call():
            raise ValueError(f"embed_q: a token id lies outside the embedding's {w.shape[0]} rows")

    return _checked(call, run)


# ---------------------------------------------------------------------------------------------------- attention


def prepare_slab_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                           slab_offset: torch.Tensor, context_len: torch.Tensor, scale: float, out: torch.Tensor,
                           workspace: torch.Tensor | None = None) -> Callable[[], None]:
    """slabserve::slab_attention on CPU (semantics: kernels.reference): every sequence, decode rows and prefill
    chunks of any length, through the native kernel, whose rows each get the same arithmetic whatever chunk or
    batch they sit in. Without the native kernels, or for a layout it does not take (fp32 activations only, head_dim
    a multiple of 8 up to 256, at most 16 query heads per kv head), the reference does all of it."""
    args = (q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out, workspace)
    if not (_native_f32(q, out) and _native_kv(k_cache, v_cache) and _attention_layout_ok(q, k_cache)
            and contracts.k_tiled(k_cache)):
        return reference.prepare_slab_prefill_attention(*args)
    contracts.check_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, out, workspace)
    num_heads, head_dim = q.shape[1], q.shape[2]
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    call = _bind((q, k_cache, v_cache, query_start, slab_offset, context_len, out),
                 lib.slabserve_slab_attention_f32, q.shape[0], slab_offset.shape[0], num_heads, k_cache.shape[1],
                 head_dim, contracts.kv_cache_rows(k_cache), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                 v_cache.data_ptr(),
                 query_start.data_ptr(), slab_offset.data_ptr(), context_len.data_ptr(), scale, out.data_ptr(),
                 KV_KINDS[k_cache.dtype])

    def run() -> None:
        if call() < 0:
            raise ValueError(f"slab_attention: query_start, slab_offset or context_len point outside the "
                             f"{q.shape[0]} rows of q or past the caches' {contracts.kv_cache_rows(k_cache)} rows")

    return _checked(call, run)


def _attention_layout_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What the native kernel takes: heads contiguous within a row of q, D a multiple of 8 up to 256, at most 16
    query heads per kv head (kernels/cpu_native.c)."""
    return _heads_packed(q) and _attention_shape_ok(q.shape[1], k_cache.shape[1], q.shape[2])


def _attention_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // max(num_kv_heads, 1)
    return head_dim % 8 == 0 and head_dim <= 256 and 1 <= group <= 16


def attention_runs_natively(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                            head_dim: int) -> bool:
    """Whether a CPU step's slab_attention of this model takes the native kernel (stack only, whatever the
    context) rather than the reference (whose GEMMs MKL sizes by the largest call it has seen)."""
    return (_load() is not None and dtype == torch.float32 and kv_dtype in KV_KINDS
            and _attention_shape_ok(num_heads, num_kv_heads, head_dim))


def _heads_packed(x: torch.Tensor) -> bool:
    """(T, heads, D) with each row's heads back to back: one run of heads * D floats per row."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _native_f32(*tensors: torch.Tensor) -> bool:
    return _load() is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


# KV cache dtypes the native attention and kv_write read and write (kernels/cpu_native.c: KV_F32, KV_BF16, KV_F16)
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (_load() is not None and k_cache.dtype in KV_KINDS and v_cache.dtype == k_cache.dtype
            and k_cache.device.type == "cpu" and v_cache.device.type == "cpu")


# ---------------------------------------------------------------------------------------------------- small ops
# Each falls back to the reference's prepare (same contract checks, same semantics) for what the native kernel
# does not take: other dtypes, other layouts, or no library.


def prepare_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                     workspace: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> Callable[[], None]:
    if not _native_f32(x, weight, out):
        return reference.prepare_rms_norm(x, weight, eps, out, workspace, rows)
    contracts.check_rms_norm(x, weight, out)
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    return _bind((x, weight, out, rows), lib.slabserve_rms_norm_f32, x.shape[0], x.shape[1], x.data_ptr(),
                 x.stride(0), weight.data_ptr(), eps, out.data_ptr(), out.stride(0), *_live("rms_norm", rows))


def prepare_silu_mul(gate_up: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None
                     ) -> Callable[[], None]:
    if not _native_f32(gate_up, out):
        return reference.prepare_silu_mul(gate_up, out, rows)
    contracts.check_silu_mul(gate_up, out)
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    return _bind((gate_up, out, rows), lib.slabserve_silu_mul_f32, out.shape[0], out.shape[1], gate_up.data_ptr(),
                 gate_up.stride(0), out.data_ptr(), out.stride(0), *_live("silu_mul", rows))


def prepare_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 workspace: torch.Tensor | None = None) -> Callable[[], None]:
    if not (_native_f32(q, k, cos_sin) and _heads_packed(q) and _heads_packed(k) and positions.stride(0) == 1):
        return reference.prepare_rope(q, k, positions, cos_sin, workspace)
    contracts.check_rope(q, k, positions, cos_sin)
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    call = _bind((q, k, positions, cos_sin), lib.slabserve_rope_f32, q.shape[0], q.shape[1], k.shape[1],
                 q.shape[2], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                 cos_sin.data_ptr(), cos_sin.shape[0])

    def run() -> None:
        if call():
            raise ValueError(f"rope: a position lies outside the rope table's {cos_sin.shape[0]} rows")

    return _checked(call, run)


def prepare_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> Callable[[], None]:
    if not (_native_f32(k, v) and _native_kv(k_cache, v_cache) and _heads_packed(k) and _heads_packed(v)
            and slot_mapping.stride(0) == 1 and contracts.k_tiled(k_cache)):
        return reference.prepare_kv_write(k, v, k_cache, v_cache, slot_mapping)
    contracts.check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    lib: ctypes.CDLL = _state["lib"]  # type: ignore[assignment]
    call = _bind((k, v, k_cache, v_cache, slot_mapping), lib.slabserve_kv_write_f32, k.shape[0],
                 k.shape[1] * k.shape[2], k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                 v_cache.data_ptr(), slot_mapping.data_ptr(), contracts.kv_cache_rows(k_cache),
                 KV_KINDS[k_cache.dtype])

    def run() -> None:
        if call():
            raise ValueError(f"kv_write: a slot lies past the caches' {contracts.kv_cache_rows(k_cache)} rows")

    return _checked(call, run)


def status() -> str:
    """One line for logs and the Makefile: where the library is, or why the native kernels are unavailable."""
    return f"native CPU kernels ({_state['isa']}): {library_path(_state['isa'])}" if available() else \
        f"native CPU kernels unavailable ({unavailable_reason()}); CPU plans use aten matmul"
