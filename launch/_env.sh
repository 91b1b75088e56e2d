# Sourced by the launch scripts: creates .venv on first use and installs the package with its
# test extra. torch is pinned here (and only here) so pip takes the CPU wheel on disk instead of
# a multi-GB CUDA build; pyproject.toml declares the supported range.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OOBLECK_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment in $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.oobleck-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "installing dependencies (torch==2.13.0, CPU build) into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
