"""A CUDA plan's device check reads what torch reports of the device (compute capability, memory), never its
marketing name, and versions are compared by major.minor: the names real GPUs give and the builds real machines
have (a plan built with torch 2.13.0+cpu, served by 2.13.x+cu130) must pass."""
from __future__ import annotations

import pytest

from slabserve.compiler.spec import GPUS
from slabserve.runtime.devices import GPU_KINDS, MIB, device_mismatch, major_minor, version_mismatch


@pytest.mark.parametrize("name, capability, total_memory", [
    # total_memory as torch reports it: a little under nvidia-smi's figure (about 0.5-2.5%)
    ("H100-80GB", (9, 0), 85_029_158_912),    # "NVIDIA H100 80GB HBM3"
    ("H200-141GB", (9, 0), 150_110_011_392),  # "NVIDIA H200"
    ("A100-80GB", (8, 0), 85_899_345_920),
    ("L4-24GB", (8, 9), 23_580_639_232),
])
def test_real_devices_serve_a_plan_that_fills_their_kind(name, capability, total_memory):
    kind = GPU_KINDS[name]
    assert device_mismatch(kind.capability, kind.memory_bytes, capability, total_memory) is None


def test_another_kind_is_refused_with_what_differs():
    h100, h200 = GPU_KINDS["H100-80GB"], GPU_KINDS["H200-141GB"]
    assert device_mismatch(h100.capability, h100.memory_bytes, (8, 0), 85_899_345_920) == \
        "compute capability 8.0, the plan needs 9.0"
    why = device_mismatch(h200.capability, h200.memory_bytes, (9, 0), 85_029_158_912)  # an H100, an H200 plan
    assert why.startswith("81,090 MiB of memory") and "143,771 MiB" in why
    assert device_mismatch(h100.capability, 40 << 30, (9, 0), 150_110_011_392) is None  # a small plan on an H200
    assert device_mismatch(None, 40 << 30, (8, 9), 23_580_639_232).startswith("22,488 MiB")  # target.memory only


def test_the_spec_and_the_runtime_share_one_table():
    assert GPUS == {name: kind.memory_bytes for name, kind in GPU_KINDS.items()}
    assert GPU_KINDS["H100-80GB"].memory_bytes == 81559 * MIB


def test_versions_compare_by_major_minor():
    assert major_minor("2.11.0+cu130") == (2, 11) and major_minor("3.6.0") == (3, 6) and major_minor("2.13") == (2, 13)
    assert not version_mismatch("2.13.1+cu130", "2.13.0+cpu")
    assert version_mismatch("2.11.0+cu130", "2.13.0+cpu")
    assert version_mismatch(None, "3.6.0")      # needed and not installed
    assert not version_mismatch("3.6.0", None)  # not recorded: nothing to check
