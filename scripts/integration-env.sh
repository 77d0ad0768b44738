#!/usr/bin/env bash
# Build an engine's CPU test virtualenv: the CPU torch wheel, the engine with --no-deps, a short
# dependency list measured to import its cache and scheduler code on CPU, then kvplug (editable).
#
#   scripts/integration-env.sh sglang|vllm [VENV_DIR] [ENGINE_VERSION]
#
# Defaults: VENV_DIR=.venv-<engine> in the repository root; sglang 0.5.23, vllm 0.34.0.
# Re-running with another ENGINE_VERSION on an existing VENV_DIR swaps only the engine package.
set -euo pipefail
engine=${1:?usage: scripts/integration-env.sh sglang|vllm [VENV_DIR] [ENGINE_VERSION]}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${2:-$root/.venv-$engine}
case $engine in
  sglang) version=${3:-0.5.23} ;;
  vllm) version=${3:-0.34.0} ;;
  *) echo "unknown engine '$engine' (sglang or vllm)" >&2; exit 2 ;;
esac
pip=$venv/bin/pip
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$pip" install -q torch==2.13.0
  "$pip" install -q -r "$root/scripts/integration/requirements-$engine-cpu.txt"
  # xgrammar pulls triton (~1 GB) that vLLM's CPU path never imports
  if [ "$engine" = vllm ]; then "$pip" uninstall -q -y triton; fi
  "$pip" install -q -e "$root/hookspecs" -e "$root[test]"
fi
"$pip" install -q --no-deps "$engine==$version"
"$venv/bin/python" -c "import importlib.metadata as m; print('$engine', m.version('$engine'), 'in $venv')"
