"""One import namespace: the project installs as `slabserve.*` and nothing else at the top of site-packages, so it
lives beside Hugging Face's `kernels` distribution (which transformers 5.25+ imports) in one interpreter."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("compiler", "runtime", "kernels", "proto", "tools")


def test_distribution_installs_one_top_level_name():
    dist = importlib.metadata.distribution("slabserve")
    assert (dist.read_text("top_level.txt") or "").split() == ["slabserve"]


def test_no_module_of_ours_imports_from_the_top_level():
    """The source never reaches its siblings as `runtime.`, `kernels.`, ... (that only works from the repository
    root, and shadows other distributions)."""
    offenders = []
    for folder in SUBPACKAGES + ("tests",):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                words = line.strip().split()
                if len(words) >= 2 and words[0] in ("import", "from") and words[1].split(".")[0] in SUBPACKAGES:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.slow
def test_transformers_and_hf_kernels_beside_slabserve(tmp_path):
    """A fresh interpreter outside the repository imports slabserve, Hugging Face's `kernels` and a transformers
    model: `kernels` is theirs, `slabserve.kernels` is ours, and the model builds (transformers 5.25+ imports
    `kernels` on its way)."""
    pytest.importorskip("kernels")
    code = textwrap.dedent("""
        import sys
        import slabserve.runtime.engine, slabserve.runtime.server, slabserve.kernels.ops
        import kernels, transformers
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64)
        LlamaForCausalLM(config)
        import slabserve.kernels as ours
        assert "site-packages" in kernels.__file__, kernels.__file__
        assert ours.__file__ != kernels.__file__
        top = {name.split(".")[0] for name in sys.modules}
        assert not top & {"runtime", "compiler", "proto", "tools"}, top & {"runtime", "compiler", "proto", "tools"}
        print("ok", transformers.__version__)
    """)
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")
