"""Bad model files give one clear ModelLoadError naming the file and the problem, before any weight is used."""
from __future__ import annotations

import json
import shutil

import pytest

from _models import make_hf_model, write_gguf
from slabserve.runtime.config import ModelLoadError, UnsupportedModelError
from slabserve.runtime.loader import open_config, open_model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf") / "tiny", "llama")


def _copy(folder, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(folder, dest)
    return dest


def _truncate(path, keep: float):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nowhere\.gguf: no such file or folder"):
        open_model(tmp_path / "nowhere.gguf")


def test_missing_config(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        open_model(folder)


def test_truncated_safetensors(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    _truncate(folder / "model.safetensors", 0.5)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        open_model(folder)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "Q8_0")
    _truncate(path, 0.6)
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: not a readable GGUF file"):
        open_model(path)


def test_gguf_header_only(tmp_path):
    path = tmp_path / "header.gguf"
    path.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ModelLoadError, match=r"header\.gguf: not a readable GGUF file"):
        open_model(path)


def test_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"notes\.txt: neither an HF model folder nor a GGUF file"):
        open_model(path)


def test_unknown_model_type(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: model_type 'gpt_neox' is not supported"):
        open_model(folder)


@pytest.mark.parametrize("option, value, message", [
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope scaling type 'yarn' is not supported"),
    ("mlp_bias", True, "mlp_bias=true is not supported"),
])
def test_unsupported_option_is_named(hf_folder, tmp_path, option, value, message):
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps({**config, option: value}))
    with pytest.raises(UnsupportedModelError, match=message):
        open_config(folder)


def test_wrong_tensor_shape(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\], "
                                             r"the config implies \[96, 64\]"):
        open_model(folder)


def test_pickle_weights_refused(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only pickle weights"):
        open_model(folder)


def test_sliding_window_caps_context(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": 128}))
    cfg = open_config(folder).config
    assert cfg.context_limit == 128 and cfg.max_position == 256
