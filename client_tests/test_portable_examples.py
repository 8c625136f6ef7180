"""The portable-mode examples against a real stock vLLM server (SmolLM2-135M, no plugin loaded):
``examples/portable_langchain.py`` (an LCEL chain: ``SpecPrefillCompressor`` in front of an
unmodified ``ChatOpenAI``) and ``examples/portable_llamaindex.py`` (a query engine:
``SpecPrefillNodePostprocessor`` in front of ``OpenAILike``). The draft's selection shrinks what
the server prefills; each document or node keeps its id and metadata and reports what it kept."""

from __future__ import annotations

import importlib
import json
import re
import time
import urllib.request

import pytest
from conftest import KEEP_RATE, MAX_NEW_TOKENS, MESSAGES, MODEL, START_TIMEOUT_S
from servers import GatewayProcess

from specprefill_rag.tools.retrieval import demo_documents, split_passages
from specprefill_rag.wire import PROOF_FIELD

pytestmark = [pytest.mark.full, pytest.mark.timeout(1800)]


def prompt_tokens(server) -> float:
    """Prompt tokens the server has prefilled so far (its own ``vllm:prompt_tokens_total``)."""
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=60).read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_the_server_is_stock(stock_vllm_server):
    body = {"model": str(stock_vllm_server.model_dir), "prompt": [1, 2, 3, 4], "max_tokens": 1,
            "vllm_xargs": {"specprefill_positions": [0, 1, 5, 9], "specprefill_next_position": 10}}
    request = urllib.request.Request(f"{stock_vllm_server.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
    assert answer["choices"] and PROOF_FIELD not in answer  # the plugin would have proved the plan


def test_the_langchain_portable_example(stock_vllm_server, capsys):
    example = importlib.import_module("examples.portable_langchain")
    result = example.main(["--base-url", f"{stock_vllm_server.url}/v1", "--baseline", "--max-tokens", "16"])
    ids = {p.id for p in split_passages(demo_documents())}
    documents = result["documents"]
    assert documents and all(d.id in ids and d.metadata["source"] for d in documents)  # own id and metadata
    assert all(0.0 < d.metadata["specprefill_keep_ratio"] <= 1.0 for d in documents)
    assert min(d.metadata["specprefill_keep_ratio"] for d in documents) < 1.0
    compressed = result["answer"].usage_metadata["input_tokens"]
    whole = result["baseline"]["answer"].usage_metadata["input_tokens"]
    assert compressed < whole  # the server prefilled the kept text only
    assert result["answer"].content.strip()
    assert "prompt tokens" in capsys.readouterr().out


def test_the_llamaindex_portable_example(stock_vllm_server):
    example = importlib.import_module("examples.portable_llamaindex")
    base = ["--base-url", f"{stock_vllm_server.url}/v1", "--max-tokens", "16"]
    before = prompt_tokens(stock_vllm_server)
    response = example.main(base)["response"]
    compressed = prompt_tokens(stock_vllm_server) - before
    whole_response = example.main([*base, "--keep-rate", "1.0"])["response"]
    whole = prompt_tokens(stock_vllm_server) - before - compressed
    assert 0 < compressed < whole
    assert len(response.source_nodes) == 4 and all(n.score is not None for n in response.source_nodes)
    ratios = [n.node.metadata["specprefill_keep_ratio"] for n in response.source_nodes]
    assert min(ratios) < 1.0 and all(r == 1.0 for r in
                                     (n.node.metadata["specprefill_keep_ratio"] for n in whole_response.source_nodes))
    # each run builds its own index: node ids are fresh, sources and scores the same
    assert [(n.node.metadata["source"], round(n.score, 4)) for n in response.source_nodes] == \
        [(n.node.metadata["source"], round(n.score, 4)) for n in whole_response.source_nodes]
    assert str(response).strip()


@pytest.fixture(scope="module")
def text_mode_gateway(stock_vllm_server, tmp_path_factory):
    """The gateway in front of the stock server, answering planned requests in text mode."""
    process = GatewayProcess(
        ["--backend", "vllm_server", "--vllm-url", stock_vllm_server.url, "--main", MODEL, "--draft", MODEL,
         "--keep-rate", str(KEEP_RATE), "--max-new-tokens", str(MAX_NEW_TOKENS), "--fallback-text-mode"],
        tmp_path_factory.mktemp("text-gateway") / "gateway.log")
    try:
        process.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield process
    finally:
        process.stop()


def test_the_gateway_falls_back_to_text_mode_on_a_stock_vllm(stock_vllm_server, text_mode_gateway):
    client = text_mode_gateway.client(api_key="unused", timeout=600)
    # LangChain's stuff-documents prompt, which the gateway splits; the first request also warms up
    client.chat.completions.create(model="x", messages=MESSAGES, temperature=0)
    before = prompt_tokens(stock_vllm_server)
    answer = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0)
    sent = prompt_tokens(stock_vllm_server) - before
    ext = answer.model_extra["specprefill"]
    assert ext.get("mode") == "text", ext
    assert ext["fallback"]["from"] == "specprefill" and "plugin" in ext["fallback"]["reason"]
    report = ext["text_mode"]
    # What the server prefilled: the kept text, and the one-token plugin probe unless the last refusal
    # still stands (ConnectionOptions.plugin_retry_s, 5 s: the reason then says when it was checked).
    probed = not re.search(r"the plugin check [0-9.]+ s ago; the next in", ext["fallback"]["reason"])
    assert report["upstream"] == stock_vllm_server.url and sent == report["upstream_prompt_tokens"] + probed
    assert 0 < sent < ext["prompt_tokens"]  # the stock server prefilled the kept sentences only
    assert any(p["keep_ratio"] < 1.0 for p in report["passages"])
    assert answer.choices[0].message.content
