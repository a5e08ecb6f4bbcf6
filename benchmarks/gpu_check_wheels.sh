#!/usr/bin/env bash
# Download, here (with PyPI), the wheels the GPU machine lacks for benchmarks/gpu_check.py: the CLI's
# jsonargparse[signatures] (jsonargparse, docstring-parser, typeshed-client). Pure-Python wheels,
# < 2 MiB in all, into .whl/ (ignored by git), to be carried to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
ls -la .whl
