"""Tenants stay apart (issue 46, item 3): a request's ``cache_salt`` names its cache namespace, and
no cache of the engine serves one namespace what another computed: the draft's score memo, the
prompt memo (the template and the tokenizer), the draft's prefix store, nor a shared draft batch.

In process: the engine with a tiny model as its own draft, and the gateway's app (Starlette's
TestClient) with several API keys, each its own tenant. The salt forwarded to a vLLM upstream is
checked in tests/test_vllm_server.py against a real server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import torch
from helpers import Calls, assembly

from specprefill_rag import DraftConfig, GenerationConfig, Passage, SpecPrefillConfig
from specprefill_rag.config import SelectionConfig
from specprefill_rag.draft.prefix_store import PrefixEntry, PrefixStore
from specprefill_rag.errors import ConfigError
from specprefill_rag.testing import tiny_engine

# A system prompt long enough for the draft's prefix store (MIN_PREFIX_TOKENS), then passages.
INSTRUCTIONS = "You answer from the station handbook. " * 12
PASSAGES = [Passage(f"Hut {i} stands {100 + i} metres above the fjord and sleeps {i + 2} people.") for i in range(8)]
QUESTION = "Which hut sleeps seven people?"


def salted(salt: str | None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=2, cache_salt=salt)


@pytest.fixture
def engine():
    """A fresh engine per test (its caches empty), with the draft's prefix store on."""
    return tiny_engine(SpecPrefillConfig(
        draft=DraftConfig(lookahead=2, prefix_cache_entries=8),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=2),
    ))


def ask(engine, salt: str | None, question: str = QUESTION, passages=PASSAGES):
    return engine.generate(question, passages, instructions=INSTRUCTIONS, generation=salted(salt))


def test_the_score_memo_serves_only_its_own_namespace(engine):
    draft = Calls(engine.draft, "score_batch")
    first = ask(engine, "tenant-a")
    again = ask(engine, "tenant-a")
    assert not first.draft_memo_hit and again.draft_memo_hit and draft.runs == 1
    other = ask(engine, "tenant-b")  # the same prompt, another namespace: the draft runs
    assert not other.draft_memo_hit and draft.runs == 2
    shared = ask(engine, None)  # no salt: the shared namespace, which is a namespace of its own
    assert not shared.draft_memo_hit and draft.runs == 3
    assert ask(engine, "tenant-b").draft_memo_hit and ask(engine, None).draft_memo_hit and draft.runs == 3
    # Every namespace's scores are the same scores: the salt changes where they are kept, not them.
    assert torch.equal(first.plan.position_ids, other.plan.position_ids)
    assert torch.equal(first.plan.position_ids, shared.plan.position_ids)


def test_the_prompt_memo_serves_only_its_own_namespace(engine, monkeypatch):
    assembled = assembly(monkeypatch)
    ask(engine, "tenant-a")
    ask(engine, "tenant-a")
    assert assembled.runs == 1  # the retry skipped the template and the tokenizer
    ask(engine, "tenant-b")
    assert assembled.runs == 2


def test_the_prefix_store_serves_only_its_own_namespace(engine):
    """Counted as the tokens the draft's first layer reads: a head served from the store is not
    read again. Other passages each time in one namespace, so its score memo cannot answer."""
    read: list[int] = []
    layer = engine.draft.model.get_decoder().layers[0]
    hook = layer.register_forward_pre_hook(
        lambda module, args, kwargs: read.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)

    def tokens_read(salt: str, passages) -> int:
        read.clear()
        ask(engine, salt, passages=passages)
        return sum(read)

    try:
        cold = tokens_read("tenant-a", PASSAGES[:4])
        warm = tokens_read("tenant-a", PASSAGES[4:])  # the system prompt's head comes from the store
        other = tokens_read("tenant-b", PASSAGES[4:])  # the same prompt in another namespace: read whole
        again = tokens_read("tenant-b", PASSAGES[:4])  # now its own head is stored
    finally:
        hook.remove()
    head = other - warm
    assert head >= 32, (cold, warm, other, again)  # MIN_PREFIX_TOKENS: the head was read again
    assert cold == again + head, (cold, warm, other, again)
    assert {entry.namespace for _, entry in engine.draft.prefixes._snapshot()} == {"tenant-a", "tenant-b"}


def test_the_prefix_store_keys_on_the_namespace():
    store = PrefixStore(entries=4, max_bytes=1 << 20)
    ids = torch.arange(40)

    def entry(namespace: str) -> PrefixEntry:
        zeros = torch.zeros(1, 1, 40, 2)
        return PrefixEntry(ids, 1, (zeros,), (zeros,), torch.zeros(1, 40, 4), namespace)

    store.add(entry("a"))
    assert store.longest(torch.arange(50), 1, "a") is not None
    assert store.longest(torch.arange(50), 1, "b") is None and store.longest(torch.arange(50), 1) is None
    store.add(entry("b"))
    assert len(store) == 2 and store.longest(torch.arange(50), 1, "b").namespace == "b"


def test_requests_of_two_namespaces_never_share_a_draft_batch():
    engine = tiny_engine(SpecPrefillConfig(
        draft=DraftConfig(lookahead=2, max_batch=4, batch_window_s=0.5, memo_entries=0),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=2),
    ))
    batches: list[list[str]] = []
    assert engine.scorer is not None
    real = engine.scorer._score_readings

    def spy(items, config):
        batches.append(sorted(str(item.salt) for item in items))
        return real(items, config)

    engine.scorer._score_readings = spy  # type: ignore[method-assign]
    salts = ["a", "b", "a", "b"]
    barrier = threading.Barrier(len(salts))

    def run(n: int) -> None:
        barrier.wait()
        ask(engine, salts[n], passages=PASSAGES[n:n + 4])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(salts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(salt for batch in batches for salt in batch) == sorted(salts)
    assert all(len(set(batch)) == 1 for batch in batches), batches
    assert max(len(batch) for batch in batches) == 2  # the two of each namespace did share one


def test_the_vllm_backend_sends_the_requests_salt_inside_its_own():
    from specprefill_rag.backends.vllm_server import VLLMServerBackend
    from specprefill_rag.testing import tiny_tokenizer

    backend = VLLMServerBackend("http://127.0.0.1:9", tiny_tokenizer(), model="m", max_context=100)
    assert backend.salt_of(GenerationConfig()) is None
    assert backend.salt_of(GenerationConfig(cache_salt="a")) == "a"
    backend.cache_salt = "operator"
    assert backend.salt_of(GenerationConfig()) == "operator"
    inside = {backend.salt_of(GenerationConfig(cache_salt=s)) for s in ("a", "b", "operator")}
    assert len(inside) == 3 and "operator" not in inside and "a" not in inside


def test_a_cache_salt_must_be_a_non_empty_string():
    for bad in ("", 3, b"x"):
        with pytest.raises(ConfigError, match="cache_salt must be a non-empty string or None"):
            GenerationConfig(cache_salt=bad)  # type: ignore[arg-type]


# -- the gateway: cache_salt on both endpoints, API keys as tenants -------------------------------

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from specprefill_rag.gateway import create_app  # noqa: E402
from specprefill_rag.gateway.app import tenant_salt  # noqa: E402

KEYS = {"key-a": "alpha", "key-a2": "alpha", "key-b": "beta"}


@pytest.fixture
def client(engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, api_keys=KEYS, api_key="shared-key"), raise_server_exceptions=False) as c:
        yield c


def chat(key: str, salt: str | None = None, *, path: str = "/v1/chat/completions") -> tuple[dict, dict]:
    """(body, headers) of a request with ``key``, and ``salt`` as its ``cache_salt``."""
    body: dict = {"model": "m", "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    else:
        body["prompt"] = QUESTION
    body["specprefill"] = {"passages": [p.text for p in PASSAGES]}
    if salt is not None:
        body["cache_salt"] = salt
    return body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def post(client: TestClient, key: str, salt: str | None = None, path: str = "/v1/chat/completions") -> dict:
    body, headers = chat(key, salt, path=path)
    response = client.post(path, content=json.dumps(body), headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["specprefill"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_tenants_and_salts_share_nothing_through_the_gateway(client, path):
    assert not post(client, "key-a", path=path)["draft_memo_hit"]
    assert post(client, "key-a", path=path)["draft_memo_hit"]
    assert post(client, "key-a2", path=path)["draft_memo_hit"]  # another key of the same tenant
    assert not post(client, "key-b", path=path)["draft_memo_hit"]  # the leak: true before
    assert not post(client, "key-a", "s1", path=path)["draft_memo_hit"]  # a salt narrows a tenant's namespace
    assert post(client, "key-a", "s1", path=path)["draft_memo_hit"]
    assert not post(client, "key-b", "s1", path=path)["draft_memo_hit"]  # the same salt, another tenant
    assert not post(client, "shared-key", path=path)["draft_memo_hit"]  # the shared key: vLLM's own rule
    assert not post(client, "shared-key", "s1", path=path)["draft_memo_hit"]
    assert post(client, "shared-key", "s1", path=path)["draft_memo_hit"]


def test_a_tenants_salt_cannot_reach_another_tenants_namespace():
    salts = {tenant_salt(tenant, salt) for tenant in ("a", "a|b", "b") for salt in (None, "b", "x", "a|b")}
    assert len(salts) == 12
    assert tenant_salt("a", None) == tenant_salt("a", None)


def test_the_cache_salt_is_checked_like_vllm_does(client):
    for bad in ("", 7, ["s"]):
        body, headers = chat("key-a")
        body["cache_salt"] = bad
        response = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "cache_salt" and "cache_salt must be a non-empty string" in error["message"]


def test_keys_are_required_once_tenants_are_configured(client):
    body, _ = chat("key-a")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic key-a"}):
        response = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_api_keys_options_are_checked():
    from specprefill_rag.gateway import GatewayOptions

    with pytest.raises(ConfigError, match="api_keys must map"):
        GatewayOptions(api_keys={"": "alpha"})
    with pytest.raises(ConfigError, match="api_keys must map"):
        GatewayOptions(api_keys={"k": " "})
    with pytest.raises(ConfigError, match="give each key once"):
        GatewayOptions(api_key="k", api_keys={"k": "alpha"})


def test_the_keys_file_maps_tenants_to_keys(tmp_path):
    from specprefill_rag.tools.cli_serve import _read_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alpha": ["k1", "k2"], "beta": "k3"}))
    assert _read_api_keys(str(path)) == {"k1": "alpha", "k2": "alpha", "k3": "beta"}
    path.write_text(json.dumps({"alpha": "k1", "beta": ["k1"]}))
    with pytest.raises(ValueError, match="given twice"):
        _read_api_keys(str(path))
    path.write_text(json.dumps({"alpha": 3}))
    with pytest.raises(ValueError, match="non-empty string"):
        _read_api_keys(str(path))
    path.write_text(json.dumps(["k1"]))
    with pytest.raises(ValueError, match="JSON object"):
        _read_api_keys(str(path))
