#!/usr/bin/env bash
# Install kvroute with its test extras into ./.venv, make sure the system tools the tests use exist
# (redis-server, chromium), and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh" "test,peers,dev"
command -v redis-server >/dev/null 2>&1 || _apt_install redis-server
command -v chromium >/dev/null 2>&1 || _apt_install chromium
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
