#!/usr/bin/env bash
# Install kvroute with its test extras into ./.venv, make sure the system tools the tests use exist
# (redis-server, chromium), and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh" "test,peers,dev,bench"
command -v redis-server >/dev/null 2>&1 || _apt_install redis-server
command -v chromium >/dev/null 2>&1 || _apt_install chromium
cd "$ROOT"
# SGLang's own flag parser validates the launch profiles (tests/replica/test_launch.py). It is a
# ~2.3 GB CPU env kept out of the project venv; under CI a missing one is built (about 1-5 min), and
# the tests fail rather than skip without it.
SGLANG_VENV="/work/sglang-venv"
if [ -n "${CI:-}" ] && [ -z "${KVROUTE_SGLANG_PYTHON:-}" ] && [ ! -x "$SGLANG_VENV/bin/python" ]; then
    rm -rf "$SGLANG_VENV.build"
    bash "$ROOT/replica/build_sglang_cpu_env.sh" "$SGLANG_VENV.build" >&2
    mv "$SGLANG_VENV.build" "$SGLANG_VENV"
fi
exec "$VENV/bin/python" -m pytest "$@"
