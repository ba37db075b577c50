#!/usr/bin/env bash
# Install kvroute with its test extras into ./.venv, make sure the system tools the tests use exist
# (redis-server, chromium), and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh" "test,peers,dev,bench"
command -v redis-server >/dev/null 2>&1 || _apt_install redis-server
command -v chromium >/dev/null 2>&1 || _apt_install chromium
cd "$ROOT"
# The CPU SGLang runtime (replica/build_sglang_cpu_env.sh: a pinned ~2.7 GB env + a tiny model under
# ${KVROUTE_SGLANG_HOME:-~/.cache/kvroute/sglang-cpu}) validates the launch profiles with SGLang's own
# parser and runs the real servers of tests/real_sglang. Under CI it is built when missing or stale
# (a no-op when up to date; 2-10 min otherwise), and those tests fail rather than skip without it.
if [ -n "${CI:-}" ] && [ -z "${KVROUTE_SGLANG_PYTHON:-}" ]; then
    bash "$ROOT/replica/build_sglang_cpu_env.sh" >&2
fi
exec "$VENV/bin/python" -m pytest "$@"
