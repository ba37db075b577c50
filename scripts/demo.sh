#!/usr/bin/env bash
# Install kvroute into ./.venv and run the main job: gateway + emulated replicas + coding-agent load,
# with a live view and a final report (kv_aware vs hash). Extra arguments go to `kvroute demo`.
source "$(dirname "$0")/_env.sh" "bench"
exec "$VENV/bin/kvroute" demo "$@"
