"""runtime.memcheck on its own: sizes people write, the free-memory figure, and the refusal's figures and fixes.

The server refusing at start is in tests/test_faults.py; these pin the message for both kinds of KV spec."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slabserve.compiler.build import build_plan
from slabserve.compiler.spec import load_spec
from slabserve.runtime.memcheck import FreeMemory, InsufficientMemoryError, check_plan_fits, free_memory, parse_size

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workload_plan():
    """The golden tiny plan: its KV classes come from a workload mix."""
    return build_plan(load_spec(ROOT / "tests" / "golden" / "tiny-llama.yaml", base_dir=ROOT), ROOT).plan


def _with_classes(plan):
    spec = {**plan.spec, "kv": {"classes": [{"tokens": c.tokens, "count": c.count} for c in plan.kv.classes]}}
    return dataclasses.replace(plan, spec=spec)


@pytest.mark.parametrize("text, size", [("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("4000000000", 4_000_000_000),
                                        ("1.5GiB", 3 << 29), ("2TB", 2 * 10**12), ("0", 0)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8gb", "8G", "8 GIB", "1.5B", "-1", "", "GiB", "8GiB extra"])
def test_bad_sizes_name_the_units(text):
    with pytest.raises(ValueError, match="KiB, MiB, GiB|whole number of bytes"):
        parse_size(text)


def test_a_plan_that_fits_passes(workload_plan):
    check_plan_fits(workload_plan, FreeMemory(workload_plan.totals.planned_bytes, "exactly enough"))


def test_refusal_gives_need_free_shortfall_and_the_kv_class_to_shrink(workload_plan):
    plan = _with_classes(workload_plan)
    # The largest slabs free the most, but a class is never emptied: the largest class with 2 slabs or more.
    largest = max((c for c in plan.kv.classes if c.count >= 2), key=lambda c: c.tokens)
    slab_bytes = largest.tokens * plan.kv.bytes_per_token
    free = plan.totals.planned_bytes - slab_bytes  # one slab of that class too many
    with pytest.raises(InsufficientMemoryError) as err:
        check_plan_fits(plan, FreeMemory(free, "a test figure"))
    message = str(err.value)
    assert f"({plan.totals.planned_bytes} bytes: weights " in message
    assert f"({free} bytes) is free (a test figure)" in message
    assert f"shrink the plan by at least" in message and f"({slab_bytes} bytes)" in message
    assert f"kv.classes: 1 fewer {largest.tokens}-token slabs, count {largest.count} -> {largest.count - 1}" in message
    assert message.endswith("or serve it where more memory is free")


def test_refusal_of_a_workload_plan_names_the_kv_budget(workload_plan):
    short = 1000
    with pytest.raises(InsufficientMemoryError, match=f"kv.budget: {workload_plan.kv.arena_bytes - short} or less"):
        check_plan_fits(workload_plan, FreeMemory(workload_plan.totals.planned_bytes - short, "a test figure"))


def test_refusal_under_a_limit_says_what_to_raise_it_to(workload_plan):
    need = workload_plan.totals.planned_bytes
    with pytest.raises(InsufficientMemoryError) as err:
        check_plan_fits(workload_plan, FreeMemory(-5, "--memory-limit 1 MiB less ...", limit_bytes=1 << 20))
    message = str(err.value)
    assert "shrink the plan" not in message  # not even an empty plan would fit
    assert f"raise --memory-limit to at least" in message and f"({(1 << 20) + need + 5} bytes)" in message


def test_free_memory_on_cpu_is_memavailable_or_the_limit_less_what_the_process_holds():
    available = free_memory("cpu")
    assert available.free_bytes > 0 and available.source == "MemAvailable in /proc/meminfo"
    limited = free_memory("cpu", limit_bytes=available.free_bytes // 2)
    assert limited.limit_bytes == available.free_bytes // 2
    assert 0 < limited.free_bytes < available.free_bytes // 2 and "this process already holds" in limited.source
