"""Tenants stay apart (issue 46, item 3): a request's ``cache_salt`` names its cache namespace, and
no cache of the engine serves one namespace what another computed: the draft's score memo, the
prompt memo (the template and the tokenizer), the draft's prefix store, nor a shared draft batch.

In process: the engine with a tiny model as its own draft, and the gateway's app (Starlette's
TestClient) with several API keys, each its own tenant. The salt forwarded to a vLLM upstream is
checked in tests/test_vllm_server.py against a real server.
"""

from __future__ import annotations

import hashlib
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
from specprefill_rag.gateway.app import cache_namespace  # noqa: E402

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
    assert not post(client, "shared-key", path=path)["draft_memo_hit"]  # the shared key: a namespace of its own
    assert not post(client, "shared-key", "s1", path=path)["draft_memo_hit"]
    assert post(client, "shared-key", "s1", path=path)["draft_memo_hit"]  # shared by the salt, as in vLLM


def test_no_salt_reaches_another_namespace_and_the_secret_keys_them_all():
    secret, other = b"s" * 16, b"t" * 16
    pairs = [(tenant, salt) for tenant in (None, "a", "a|b", "b", "null") for salt in (None, "b", "x", "a|b", "null")]
    salts = {cache_namespace(secret, tenant, salt) for tenant, salt in pairs}
    assert len(salts) == len(pairs)  # the shared namespace (None) is no tenant's, not even one named "null"
    assert cache_namespace(secret, "a", None) == cache_namespace(secret, "a", None)
    assert not salts & {cache_namespace(other, tenant, salt) for tenant, salt in pairs}  # another secret: others


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


# -- the attacker (issue 60, cause 6): the shared key, a tenant's key, computed salts ----------------

TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def tool_engine():
    """The ``engine`` fixture's settings with a chat template that renders tools, and room in the
    memo and the prefix store for every namespace an attacker tries (no entry of alpha's evicted)."""
    return tiny_engine(SpecPrefillConfig(
        draft=DraftConfig(lookahead=2, prefix_cache_entries=64, memo_entries=64),
        selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=32, chunk_size=8),
        generation=GenerationConfig(max_new_tokens=2),
    ), tools=True)


def surface_body(surface: str, passages: list[Passage]) -> tuple[str, dict]:
    """(path, body) of one request on ``surface`` whose context is ``passages``; the instructions
    (the prompt's head, which the draft's prefix store keeps) are the same every time."""
    texts = [p.text for p in passages]
    system = {"role": "system", "content": INSTRUCTIONS}
    if surface == "completions":
        return "/v1/completions", {"model": "m", "max_tokens": 2, "prompt": QUESTION,
                                   "specprefill": {"passages": texts}}
    if surface == "tools":
        call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        messages = [system, {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "\n\n".join(texts)}]
        return "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": messages, "tools": [TOOL]}
    extension = {"passages": texts} | ({"mode": "text"} if surface == "text" else {})
    return "/v1/chat/completions", {"model": "m", "max_tokens": 2, "specprefill": extension,
                                    "messages": [system, {"role": "user", "content": QUESTION}]}


def guesses(secret: bytes, tenant: str) -> list[str]:
    """Every salt an attacker might compute for ``tenant``'s namespace: the SHA-256 of public values
    the gateway used before, the tenant's name, the derivation under guessed secrets, and the real
    namespace itself (as if it had leaked from vLLM's logs)."""
    old = "tenant-" + hashlib.sha256(json.dumps([tenant, None]).encode()).hexdigest()[:32]
    return [old, tenant, cache_namespace(b"\0" * 32, tenant, None), cache_namespace(b"secret" * 3, tenant, None),
            cache_namespace(secret, tenant, None), cache_namespace(secret, None, None)]


@pytest.mark.parametrize("surface", ["chat", "completions", "text", "tools"])
def test_an_attacker_reaches_no_tenants_namespace(tool_engine, surface):
    """Alpha asks; then clients with the shared key or beta's key ask the same, sending no salt or
    every salt they could compute for alpha. Each lands in a namespace of its own: no memo hit, the
    prompt's head read whole (served from alpha's store, it would be ``head`` tokens shorter), and
    the salt the backend gets is neither alpha's nor the one sent. With the old salts (a SHA-256 of
    public values; the shared key's salt used as given) the old formula's guess hit alpha's memo
    on every surface."""
    forwarded: list[str | None] = []  # each request's cache_salt, as the main model's backend gets it
    stream_tokens = tool_engine.backend.stream_tokens
    tool_engine.backend.stream_tokens = lambda plan, generation: (forwarded.append(generation.cache_salt),
                                                                  stream_tokens(plan, generation))[1]
    read: list[int] = []  # tokens the first layer reads (the draft's forwards and the main model's)
    layer = tool_engine.draft.model.get_decoder().layers[0]
    hook = layer.register_forward_pre_hook(
        lambda module, args, kwargs: read.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)
    app = create_app(tool_engine, api_keys={"key-a": "alpha", "key-b": "beta"}, api_key="shared-key")
    secret = app.state.gateway.cache_secret

    def ask(key: str, salt: str | None, passages: list[Passage]) -> tuple[dict, str | None, int]:
        path, body = surface_body(surface, passages)
        body |= {"cache_salt": salt} if salt is not None else {}
        read.clear()
        response = client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return response.json()["specprefill"], forwarded[-1], sum(read)

    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.get("/ready").status_code == 200  # the warm-up's forwards are done
            first, alphas, cold = ask("key-a", None, PASSAGES[:4])
            again, alpha_again, _ = ask("key-a", None, PASSAGES[:4])
            assert not first["draft_memo_hit"] and again["draft_memo_hit"]  # alpha's memo answers alpha
            served, _, warm = ask("key-a", None, PASSAGES[4:])  # its head served from alpha's store
            assert alphas == alpha_again and alphas is not None
            head = served["draft_cached_tokens"]  # what a leak of alpha's store would serve
            assert head > 32 or surface == "completions"  # a completion's head is too short to store
            assert alphas in guesses(secret, "alpha")  # as if it had leaked
            for key in ("shared-key", "key-b"):
                for salt in [None, *guesses(secret, "alpha")]:
                    ext, sent, tokens = ask(key, salt, PASSAGES[4:])  # a namespace's first request
                    assert not ext["draft_memo_hit"], (key, salt)
                    assert tokens == warm + head, (key, salt, tokens, warm, head)  # the head read, not served
                    assert sent not in (alphas, salt, None), (key, salt)  # its own namespace, never the value sent
                    ext, again_sent, _ = ask(key, salt, PASSAGES[:4])
                    assert not ext["draft_memo_hit"] and again_sent == sent, (key, salt)  # True before: the leak
            assert ask("key-a", None, PASSAGES[:4])[0]["draft_memo_hit"]  # alpha's entries are all still there
    finally:
        hook.remove()


def test_replicas_with_one_secret_give_a_tenant_one_namespace(engine):
    """Gateways given the same secret forward the same salt for a tenant (so vLLM's prefix cache
    behind a router serves it whichever gateway it reached); gateways left to draw their own don't."""
    forwarded: list[str | None] = []
    stream_tokens = engine.backend.stream_tokens
    engine.backend.stream_tokens = lambda plan, generation: (forwarded.append(generation.cache_salt),
                                                             stream_tokens(plan, generation))[1]
    shared = b"an operator's shared secret"
    salts = []
    for options in ({"cache_secret": shared}, {"cache_secret": shared}, {}, {}):
        with TestClient(create_app(engine, api_keys=KEYS, **options)) as client:
            assert client.get("/ready").status_code == 200  # the warm-up (no salt) is done
            body, headers = chat("key-a")
            assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
            salts.append(forwarded[-1])
    assert salts[0] == salts[1] == cache_namespace(shared, "alpha", None)
    assert len(set(salts)) == 3  # each drawn secret is its own


def test_the_cache_secret_is_an_option_never_shown():
    from specprefill_rag.gateway import GatewayOptions

    options = GatewayOptions(cache_secret=b"k" * 16, api_key="sk-shared", api_keys={"sk-alpha": "alpha"})
    assert "kkkk" not in repr(options) and "sk-" not in repr(options)
    for bad in (b"short", "a str secret of 32 characters..", 7):
        with pytest.raises(ConfigError, match="cache_secret must be bytes, at least 16"):
            GatewayOptions(cache_secret=bad)  # type: ignore[arg-type]


def test_the_secret_file_is_read_and_checked(tmp_path):
    from specprefill_rag.tools.cli_parser import build_parser
    from specprefill_rag.tools.cli_serve import _read_cache_secret

    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    assert _read_cache_secret(str(path)) == b"0123456789abcdef0123456789abcdef"
    path.write_bytes(b"  short\n")
    with pytest.raises(ValueError, match="holds 5 bytes; a cache secret needs 16 or more") as refused:
        _read_cache_secret(str(path))
    assert "short" not in str(refused.value)  # the secret's bytes are never shown
    args = build_parser().parse_args(["gateway", "--cache-secret-file", str(path)])
    assert args.cache_secret_file == str(path)
