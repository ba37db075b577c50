#!/usr/bin/env bash
# Build the CPU SGLang runtime: a pinned SGLang 0.5.23 environment that both validates launch
# profiles with SGLang's own parser (tests/replica/test_launch.py) and runs a real server on a CPU
# (kvroute launch --profile sglang-cpu-tiny), plus the tiny Qwen2 model it serves. Facts behind
# every step: shared reference sglang-cpu.md; docs/REAL_SGLANG.md.
#
#   bash replica/build_sglang_cpu_env.sh            # build (or say it is up to date)
#   bash replica/build_sglang_cpu_env.sh --print    # print the home directory and exit
#   FORCE=1 bash replica/build_sglang_cpu_env.sh    # rebuild even when up to date
#
# Where: $KVROUTE_SGLANG_HOME, default ${XDG_CACHE_HOME:-~/.cache}/kvroute/sglang-cpu, holding
#   venv/                 Python 3.11 venv from replica/sglang_cpu/requirements-lock.txt (--no-deps)
#   model/tiny-qwen2/     config.json + a locally trained tokenizer (weights: --load-format dummy)
#   READY                 fingerprint of the inputs; written last
# Idempotent: a home whose READY matches the fingerprint of this script, the lock, the shim and the
# model maker is left alone. Atomic: a build happens in a temp dir beside the home and is renamed into
# place only when complete (under a lock, so two builders do not race). Use the venv through
# `venv/bin/python -m ...` (console-script shebangs name the temp path).
#
# Environment: PYTHON (a Python 3.11 interpreter; torch's CPU wheel is cp311), FORCE=1.
# torch==2.13.0+cpu must be reachable by pip (find-links, /opt/wheels on these machines, or an index
# that serves CPU wheels); ~2.7 GB on disk, 1.5-5 min.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="${HERE}/sglang_cpu"
SGL_HOME="${KVROUTE_SGLANG_HOME:-${XDG_CACHE_HOME:-${HOME}/.cache}/kvroute/sglang-cpu}"
if [ "${1:-}" = "--print" ]; then
    echo "${SGL_HOME}"
    exit 0
fi
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! "${PYTHON}" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    echo "[build-sglang-cpu] needs Python 3.11 (torch's CPU wheel is cp311); set PYTHON=" >&2
    exit 2
fi

FINGERPRINT="$(cat "${BASH_SOURCE[0]}" "${SRC}/requirements-lock.txt" "${SRC}/sgl_kernel/__init__.py" \
    "${SRC}/make_tiny_model.py" "${SRC}/patch_torchvision.py" | sha256sum | cut -c1-16)"
is_ready() { [ -f "${SGL_HOME}/READY" ] && [ "$(cat "${SGL_HOME}/READY")" = "${FINGERPRINT}" ]; }

if [ -z "${FORCE:-}" ] && is_ready; then
    echo "[build-sglang-cpu] up to date: ${SGL_HOME} (${FINGERPRINT})"
    exit 0
fi

PARENT="$(dirname "${SGL_HOME}")"
mkdir -p "${PARENT}"
exec 9>"${SGL_HOME}.lock"
flock 9
if [ -z "${FORCE:-}" ] && is_ready; then  # another builder finished while we waited
    echo "[build-sglang-cpu] up to date: ${SGL_HOME} (${FINGERPRINT})"
    exit 0
fi

TMP="$(mktemp -d "${SGL_HOME}.build.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
echo "[build-sglang-cpu] building ${SGL_HOME} (${FINGERPRINT}) in ${TMP} with ${PYTHON}"
"${PYTHON}" -m venv "${TMP}/venv"
VPY="${TMP}/venv/bin/python"
"${VPY}" -m pip install --quiet --upgrade pip
# The lock is the whole closure: --no-deps keeps resolvers from pulling a CUDA torch or nvidia-*.
# (pip warns once per package about this machine's unused extra index folders: not ours to show)
"${VPY}" -m pip install --quiet --no-deps -r "${SRC}/requirements-lock.txt" 2> >(grep -v "is ignored" >&2)
SITE="$("${VPY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "${SRC}/sgl_kernel" "${SITE}/sgl_kernel"
"${VPY}" "${SRC}/patch_torchvision.py"
SGLANG_USE_CPU_ENGINE=1 "${VPY}" - <<'PY'
# Fail the build here, not at server start: everything a CPU server imports must import.
import sglang, torch, torchvision  # noqa: F401
import sglang.srt.mem_cache.memory_pool  # noqa: F401  (needs the sgl_kernel shim)
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "dummy/model", "--tp-size", "4"])
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"[build-sglang-cpu] ok: sglang {sglang.__version__}, torch {torch.__version__}, tp_size={args.tp_size}")
PY
"${VPY}" "${SRC}/make_tiny_model.py" "${TMP}/model/tiny-qwen2"
echo "${FINGERPRINT}" >"${TMP}/READY"

if [ -e "${SGL_HOME}" ]; then
    mv "${SGL_HOME}" "${TMP}.old"
fi
mv "${TMP}" "${SGL_HOME}"
rm -rf "${TMP}.old"
trap - EXIT
echo "[build-sglang-cpu] ready: ${SGL_HOME}"
echo "[build-sglang-cpu]   python: ${SGL_HOME}/venv/bin/python"
echo "[build-sglang-cpu]   model:  ${SGL_HOME}/model/tiny-qwen2"
