"""runtime.loader: opening GGUF files."""
from __future__ import annotations

import numpy as np


def test_read_gguf_gives_what_gguf_reader_gives(tmp_path):
    """read_gguf opens with plain views of the file's map (faster on a tokenizer's metadata): the same fields,
    tensors and bytes as gguf.GGUFReader, read-only, and the gguf package's numpy is restored after."""
    import gguf
    from gguf import gguf_reader

    from slabserve.runtime.loader import read_gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)] + ["Ġé", "日本"])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3] * 5)
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25])
    w.add_array("general.tags", [])
    w.add_array("general.nested", [[1, 2], [3]])
    w.add_uint32("llama.block_count", 2)
    w.add_uint64("llama.context_length", 1 << 40)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("general.name", "tiny ☃")
    w.add_tensor("blk.0.attn_norm.weight", np.arange(64, dtype=np.float32))
    w.add_tensor("token_embd.weight", np.arange(32 * 8, dtype=np.float32).reshape(8, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert gguf_reader.np is np
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types and mine.data == field.data
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts))
        assert mine.contents() == field.contents()
    assert [(t.name, t.tensor_type) for t in ours.tensors] == [(t.name, t.tensor_type) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    assert not ours.data.flags.writeable


def test_read_gguf_fails_on_a_truncated_file_as_gguf_reader_does(tmp_path):
    import gguf
    import pytest

    from slabserve.runtime.loader import read_gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(Exception) as theirs:
        gguf.GGUFReader(str(cut))
    with pytest.raises(type(theirs.value)):
        read_gguf(cut)
