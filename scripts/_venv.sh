# Shared by the quick-start scripts: create .venv (once) and install the package into it.
# Sourced, not run. Set PYTHON to choose the interpreter (default: python3.11, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # (a .venv left half-made by an interrupted first run has no pip: made again)
  echo "[setup] creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv --clear .venv
fi
VPY=.venv/bin/python
echo "[setup] upgrading pip"
"$VPY" -m pip install -q --upgrade pip >/dev/null
echo "[setup] installing areal-jax$1 and its dependencies (jax, flax, optax, grain, ...): about a minute the first time"
# pip's own chatter goes to a log, shown only when the install fails.
"$VPY" -m pip install -q -e ".$1" > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
echo "[setup] done"
