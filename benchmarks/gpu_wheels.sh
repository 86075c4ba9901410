#!/usr/bin/env bash
# The wheels the GPU image lacks, for `WHEELS=dir bash benchmarks/run_gpu.sh ...` there (it reaches no registry).
#
#   bash benchmarks/gpu_wheels.sh [dir]       default dir: .whl (ignored by git; carry it with the call)
#
# The image has jax, flax, orbax, numpy, safetensors, tiktoken, jinja2, tqdm, httpx and prometheus-client; the
# server's FastAPI stack and the schema validator come from here, built for the image's Python 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$DIR" fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core starlette annotated-types \
    typing-inspection typing-extensions opentelemetry-api jsonschema==4.26.0 jsonschema-specifications referencing rpds-py outlines-core==0.2.14
ls "$DIR"
