"""Weight loaders: HF model folders (config.json + safetensors) and GGUF files, without pickle.

Contract: `open_model(path)` reads only metadata (config, tensor names, shapes, dtypes) and checks every tensor the
model needs is present with the right shape, so a bad file fails fast with one `ModelLoadError` naming the file and
the problem. Tensors are read lazily, one at a time, through `WeightSource.get`, so packing them into the compute
layout never holds two copies of the whole model (safetensors are memory-mapped; GGUF tensors are dequantized
with the `gguf` package when asked for). llama.cpp's reordering of q/k rows for RoPE is undone here.
"""
from __future__ import annotations

import functools
import hashlib
import json
import mmap
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slabserve.runtime.config import ModelConfig, ModelLoadError, config_from_gguf, config_from_hf

GGUF_MAGIC = b"GGUF"


class WeightSource:
    """Lazy access to a model's tensors by HF name. Subclasses implement `_read` and fill `shapes`."""

    path: Path
    config: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    format: str

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Read one tensor (HF layout) and convert it to `dtype`."""
        if name not in self.shapes:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        try:
            tensor = self._read(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # the format libraries raise many kinds; say which file and tensor
            raise ModelLoadError(f"{self.path}: cannot read tensor {name}: {exc}") from exc
        return tensor.to(dtype)

    def _read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def freq_factors(self) -> torch.Tensor | None:
        """GGUF Llama 3 files carry RoPE frequency divisors as a tensor; HF configs carry them as settings."""
        return None

    def check_shapes(self) -> None:
        expected = self.config.weight_shapes()
        for name, shape in expected.items():
            if name not in self.shapes:
                raise ModelLoadError(f"{self.path}: tensor {name} is missing (the config needs {len(expected)} tensors)")
            if tuple(self.shapes[name]) != shape:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} has shape {list(self.shapes[name])}, the config implies {list(shape)}"
                )

    def content_hash(self) -> str:
        """sha256 over the weight files' bytes (the plan's weight fingerprint)."""
        digest = hashlib.sha256()
        for file in self.files():
            with open(file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(block)
        return digest.hexdigest()

    def files(self) -> list[Path]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------- HF folders


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


class SafetensorsSource(WeightSource):
    """An HF model folder: config.json and model.safetensors or a sharded model.safetensors.index.json."""

    format = "hf"

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.path = folder
        self.config = config_from_hf(_read_json(folder / "config.json"), str(folder / "config.json"))
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        self.shapes = {}
        indexed = self._weight_files(folder)
        for file in sorted(set(indexed.values())):
            try:
                handle = safe_open(str(file), framework="pt")
                for name in handle.keys():
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
                    self._file_of[name] = file
            except Exception as exc:
                raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
            self._handles[file] = handle
        lost = sorted(n for n in indexed if n not in self._file_of and n != "")
        if lost:
            raise ModelLoadError(f"{folder}: the index names {len(lost)} tensors its shards lack, e.g. {lost[0]}")
        self.check_shapes()

    @staticmethod
    def _weight_files(folder: Path) -> dict[str, Path]:
        """tensor name -> shard file from the index; a single-file model maps the key "" to its one file."""
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: has no weight_map")
            return {name: folder / file for name, file in weight_map.items()}
        single = folder / "model.safetensors"
        if single.is_file():
            return {"": single}
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ModelLoadError(f"{folder}: only pickle weights (*.bin/*.pt) found; slabserve loads safetensors "
                                 "only (convert with `save_pretrained(..., safe_serialization=True)`)")
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")

    def _read(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def files(self) -> list[Path]:
        return sorted(self._handles)


# ---------------------------------------------------------------------------------------------------- GGUF files

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it interleaves the two RoPE halves of each head, HF keeps them apart."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type"):
            meta[key + ".count"] = len(field.data)
            continue
        meta[key] = field.contents()
    return meta


_READER_LOCK = threading.Lock()


class _PlainMap:
    """numpy as `gguf.gguf_reader` sees it while `read_gguf` opens a file: `memmap(path, mode)` gives a plain
    read-only ndarray over an mmap of the file instead of an np.memmap. The reader takes hundreds of thousands of
    small views of its map while it parses a tokenizer's metadata (SmolLM2: 49,152 tokens and 48,900 merges), and
    each view of an np.memmap runs memmap's Python __array_finalize__: 2.2 s to open the bundled file, 0.9 s with
    plain views of the same bytes. Everything else is numpy's own."""

    @staticmethod
    def memmap(path, mode: str = "r"):
        if mode != "r":
            raise ValueError(f"read_gguf maps files read-only, not mode {mode!r}")
        with open(path, "rb") as f:
            region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(region, dtype=np.uint8)  # the array keeps the map alive

    def __getattr__(self, name: str):
        return getattr(np, name)


@functools.cache
def _fast_reader_class():
    """GGUFReader with its one primitive, `_get` (`count` items of `dtype` at `offset` of the map, in the file's
    byte order), made one numpy call: the reader calls it about 250,000 times for SmolLM2's tokenizer metadata, and
    each call took a slice, two views, a slice and a byte-order dtype, the last two alone about 1 s in a profile
    of opening the bundled file. The byte-order dtypes are made once. Arrays of strings and scalars are read in one
    loop instead of a recursive call per item. A read past the end of the map (a truncated file) goes to the
    reader's own code, so it fails as it always did."""
    from gguf import GGUFReader, GGUFValueType

    class _Reader(GGUFReader):
        _dtypes: dict = {}

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            order = self.byte_order if override_order is None else override_order
            final = self._dtypes.get((dtype, order))
            if final is None:
                final = self._dtypes[(dtype, order)] = np.dtype(dtype).newbyteorder(order)
            if offset < 0 or offset + final.itemsize * count > self.data.shape[0]:
                return super()._get(offset, dtype, count, override_order)
            return np.ndarray((count,), dtype=final, buffer=self.data, offset=offset)

        def _get_field_parts(self, orig_offs, raw_type):
            # an array of strings or scalars in one loop of _get calls, with the parts, data indices and types
            # the reader's recursion (a call, an enum and four lists per item) gives; anything else is its own
            if raw_type != GGUFValueType.ARRAY or orig_offs + 12 > self.data.shape[0]:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            nptype = None if itype == GGUFValueType.STRING else self.gguf_scalar_to_np.get(GGUFValueType(itype))
            if itype != GGUFValueType.STRING and nptype is None:
                return super()._get_field_parts(orig_offs, raw_type)
            parts: list = [raw_itype, alen]
            if itype == GGUFValueType.STRING:
                idxs = []
                for _ in range(n):
                    slen = self._get(offs, np.uint64)
                    parts.append(slen)
                    parts.append(self._get(offs + 8, np.uint8, slen[0]))
                    idxs.append(len(parts) - 1)
                    offs += 8 + int(slen[0])
            else:
                size = np.dtype(nptype).itemsize
                parts += [self._get(offs + i * size, nptype) for i in range(n)]
                idxs = list(range(2, n + 2))
                offs += n * size
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if n else [])
            return offs - orig_offs, parts, idxs, types

    return _Reader


def read_gguf(path: str | Path):
    """A `gguf.GGUFReader` of `path`, read-only, opened with plain views of its map (see _PlainMap) and one numpy
    call per primitive read (_fast_reader_class): the same fields, tensors and bytes as GGUFReader(path) gives, in
    a fraction of the time."""
    from gguf import gguf_reader

    reader = _fast_reader_class()
    with _READER_LOCK:  # the swap is module-wide: one opening at a time, numpy restored whatever happens
        saved, gguf_reader.np = gguf_reader.np, _PlainMap()
        try:
            return reader(str(path))
        finally:
            gguf_reader.np = saved


class GGUFSource(WeightSource):
    """A GGUF file: config from its metadata, tensors dequantized to float with the `gguf` package."""

    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = read_gguf(path)
            meta = _gguf_metadata(self.reader)
        except Exception as exc:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.metadata = meta
        self._tensors = {}
        extra = {}
        for t in self.reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is None:
                extra[t.name] = t
                continue
            self._tensors[hf] = t
        self.config = config_from_gguf(meta, "lm_head.weight" in self._tensors, str(path))
        self._rope_freqs = extra.get("rope_freqs.weight")
        # GGUF lists dimensions fastest-first; HF shapes are the reverse.
        self.shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in self._tensors.items()}
        self.check_shapes()

    def _read(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self._tensors[name]
        array = dequantize(t.data, t.tensor_type).reshape(self.shapes[name])
        if self.config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            array = unpermute_rope_rows(array, heads)
        # F32 tensors come back as read-only views of the memory map: copy those, take the others as they are.
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=not array.flags.writeable, order="C"))

    def get_blocks(self, name: str) -> tuple[str, torch.Tensor]:
        """(block type, (N, row_bytes) uint8 rows) of a 2-D tensor as the file stores it, in HF row order (llama's
        q/k rows un-interleaved, whole rows moved: the blocks run along a row); a copy, not a view of the map."""
        t = self._tensors[name]
        rows = self.shapes[name][0]
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        if self.config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            data = unpermute_rope_rows(data, heads)
        return t.tensor_type.name, torch.from_numpy(np.array(data, dtype=np.uint8, order="C"))

    def freq_factors(self) -> torch.Tensor | None:
        if self._rope_freqs is None:
            return None
        return torch.from_numpy(np.array(self._rope_freqs.data, dtype=np.float32))

    def tensor_types(self) -> dict[str, str]:
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def files(self) -> list[Path]:
        return [self.path]


# ---------------------------------------------------------------------------------------------------- entry points


def open_model(path: str | Path) -> WeightSource:
    """Open an HF model folder or a GGUF file (told apart by content: a folder, or the GGUF magic bytes)."""
    path = Path(path)
    if path.is_dir():
        return SafetensorsSource(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder (expected an HF model folder or a .gguf file)")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == GGUF_MAGIC:
        return GGUFSource(path)
    raise ModelLoadError(f"{path}: neither an HF model folder nor a GGUF file (first bytes {magic!r})")


@dataclass(frozen=True, slots=True)
class ConfigOnly:
    """A model known from its config.json alone (capacity planning without weights)."""

    path: Path
    config: ModelConfig


def open_config(path: str | Path) -> ConfigOnly:
    """Read just the config: a config.json file, an HF folder, or a GGUF file's metadata."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        return ConfigOnly(path, config_from_hf(_read_json(path), str(path)))
    if path.is_dir():
        return ConfigOnly(path, config_from_hf(_read_json(path / "config.json"), str(path / "config.json")))
    return ConfigOnly(path, open_model(path).config)
