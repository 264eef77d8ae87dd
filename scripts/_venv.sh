# Sourced by scripts/smoke and scripts/test: make sure a virtual environment with dpsgd installed exists and
# activate it. A venv (not the system pip, which PEP 668 distributions refuse) at $DPSGD_VENV, default .venv;
# created if missing; `pip install -e '.[test,numba,dask]'` reruns only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DPSGD_VENV:-.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" || {
    echo "error: cannot create a virtual environment with $python; install the venv module (Debian/Ubuntu: apt install python3-venv) or set PYTHON to a Python ≥ 3.10" >&2
    exit 2
  }
fi
. "$venv/bin/activate"
stamp="$venv/.dpsgd-installed-$(python -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:16])")"
if [ ! -e "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  # numba is optional (faster kernels): without a wheel for this Python, install without it
  python -m pip install --quiet -e '.[test,numba,dask]' || python -m pip install --quiet -e '.[test,dask]'
  rm -f "$venv"/.dpsgd-installed-*
  touch "$stamp"
fi
