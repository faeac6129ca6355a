#!/usr/bin/env bash
# The Python package's tests: build the wheel (maturin, the workspace's target folder),
# install it into the test venv, run pytest against real servers (PostgreSQL, noida-db).
# The venv is made by .ci/run (or: python3 -m venv /opt/weir-py && /opt/weir-py/bin/pip
# install -r crates/weir-python/requirements-test.txt).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${WEIR_PY_VENV:-/opt/weir-py}"
if [ ! -x "$venv/bin/maturin" ] || [ ! -x "$venv/bin/pytest" ]; then
  echo "no test venv at $venv: python3 -m venv $venv && $venv/bin/pip install -r $here/requirements-test.txt" >&2
  exit 1
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/root/.cache/weir-target}"
# The cluster tests start `weir worker`s: the binary `cargo test --workspace` built.
export WEIR_BIN="${WEIR_BIN:-$CARGO_TARGET_DIR/debug/weir}"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
# The dev profile shares the workspace's compiled crates (a release wheel: --release).
(cd "$here" && "$venv/bin/maturin" build --profile "${WEIR_PY_PROFILE:-dev}" --locked -o "$wheels" -q)
"$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheels"/weir-*.whl
cd "$here"
exec "$venv/bin/python" -m pytest -q tests "$@"
