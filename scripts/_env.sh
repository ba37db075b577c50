# Shared by scripts/demo.sh and scripts/test.sh: make a venv and install kvroute into it.
# Usage: source scripts/_env.sh EXTRAS   (EXTRAS e.g. "" or "test,peers")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVROUTE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "kvroute needs Python >= 3.11 (found: $("$PY" --version 2>&1)); set PYTHON=..." >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
EXTRAS="${1:-}"
if [ -n "$EXTRAS" ]; then
    "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
else
    "$VENV/bin/python" -m pip install -q -e "$ROOT"
fi

# System packages some tests need (real Redis, headless Chromium). Installed only when missing.
_apt_install() {
    local runner=""
    if [ "$(id -u)" != "0" ]; then
        if command -v sudo >/dev/null 2>&1; then runner="sudo"; else
            echo "warning: cannot install $* (not root, no sudo)" >&2; return 0; fi
    fi
    $runner apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive $runner apt-get install -y -qq "$@" >/dev/null
}
