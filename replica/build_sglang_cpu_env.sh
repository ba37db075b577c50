#!/usr/bin/env bash
# Build a CPU-only Python environment in which SGLang's own argument parser can be imported, so
# `tests/replica/test_launch.py` can validate every launch profile with
# `sglang.srt.server_args.prepare_server_args`, the parser `launch_server` itself runs.
#
# It is ~2.3 GB (CPU torch + sglang without its CUDA dependencies) and kept OUT of the project venv:
# the gateway never imports sglang.
#
#   bash replica/build_sglang_cpu_env.sh [VENV_DIR]        # default /work/sglang-venv
#   export KVROUTE_SGLANG_PYTHON=/work/sglang-venv/bin/python
#   pytest tests/replica/test_launch.py
#
# Environment: PYTHON (interpreter to create the venv with, default python3.11 or python3),
# SGLANG_VERSION (default 0.5.23), TORCH_VERSION (default 2.13.0; a CPU wheel, from disk when the
# machine has one under pip's find-links).
set -euo pipefail

VENV_DIR="${1:-/work/sglang-venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

echo "[build-sglang-cpu] venv=${VENV_DIR} python=${PYTHON} sglang==${SGLANG_VERSION} torch==${TORCH_VERSION}"
"${PYTHON}" -m venv "${VENV_DIR}"
PIP=("${VENV_DIR}/bin/python" -m pip)

# A resolver must never pull a CUDA torch (multi-GB): pin torch with a constraints file.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "${CONSTRAINTS}"' EXIT
printf 'torch==%s\n' "${TORCH_VERSION}" >"${CONSTRAINTS}"

"${PIP[@]}" install --quiet --upgrade pip
# CPU torch; --no-deps keeps nvidia-* wheels out, its real deps follow explicitly.
# Prefer the local "+cpu" wheel (pip's find-links on these machines); fall back to the plain version.
"${PIP[@]}" install --quiet --no-deps "torch==${TORCH_VERSION}+cpu" \
  || "${PIP[@]}" install --quiet --no-deps -c "${CONSTRAINTS}" "torch==${TORCH_VERSION}"
"${PIP[@]}" install --quiet -c "${CONSTRAINTS}" filelock typing-extensions sympy networkx jinja2 fsspec
# sglang imports triton at top level; the wheel is pure enough to import on CPU.
"${PIP[@]}" install --quiet --no-deps -c "${CONSTRAINTS}" triton
"${PIP[@]}" install --quiet --no-deps -c "${CONSTRAINTS}" "sglang==${SGLANG_VERSION}"
"${PIP[@]}" install --quiet -c "${CONSTRAINTS}" numpy orjson psutil pybase64 requests packaging pillow \
  starlette msgspec pydantic pyzmq tqdm IPython aiohttp pyyaml

"${VENV_DIR}/bin/python" - <<'PY'
import argparse
import sglang
from sglang.srt.server_args import ServerArgs, prepare_server_args

parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
n = len(parser._actions)
args = prepare_server_args(["--model-path", "dummy/model", "--tp-size", "4"])
print(f"[build-sglang-cpu] ok: sglang {sglang.__version__}, {n} parser actions, tp_size={args.tp_size}")
PY
echo "[build-sglang-cpu] export KVROUTE_SGLANG_PYTHON=${VENV_DIR}/bin/python"
