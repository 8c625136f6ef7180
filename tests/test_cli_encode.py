"""``specprefill-rag encode`` reads a corpus's passages into a passage store on disk, and ``ask``
with ``--passage-store`` finds them there: the draft reads none of them again. The flags reach
the draft's config on every command that builds an engine.

No real model: ``SpecPrefillEngine.from_pretrained`` builds the tiny engine with a draft of 8
layers (one that reads passages apart) from the config the command made, and the retriever's
embedder is a hash of each text, so ``ask`` retrieves through the real splitting and ranking."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from specprefill_rag import PassageReading, SpecPrefillEngine, loading
from specprefill_rag.testing import tiny_engine
from specprefill_rag.tools import cli, retrieval

# Paragraphs of 70 words: two never share a passage (``retrieval.PASSAGE_WORDS``), so six passages.
DOCS = {
    "huts.md": "# Huts\n\n" + "\n\n".join(
        f"Hut {i} stands {100 + i} metres above the fjord and sleeps {i + 2} people. " * 7 for i in range(4)),
    "ops/radio.md": "# Radio\n\n" + "The radio room opens at dawn and the passkey is 48213 today. " * 6
    + "\n\n" + "The quick brown fox jumps over the lazy dog by the radio mast. " * 6,
}

APART = PassageReading()  # what --read-passages apart and --passage-store give; no flag: joint


class HashEmbedder:
    """A sentence-transformers stand-in: each text's embedding is a seeded random unit vector."""

    def encode(self, texts: list[str], **kwargs: Any) -> torch.Tensor:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
            rows.append(torch.randn(16, generator=torch.Generator().manual_seed(seed)))
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    return tmp_path / "docs"


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[SpecPrefillEngine]:
    """Every engine a command built: the tiny one, from the command's own config (selection
    loosened so the tiny prompts are pruned, not prefilled whole for their length)."""
    engines: list[SpecPrefillEngine] = []

    def build(cls: Any, main: str, draft: str | None = None, *, config: Any, **kwargs: Any) -> SpecPrefillEngine:
        config = dataclasses.replace(
            config, selection=dataclasses.replace(config.selection, min_prompt_tokens=16),
            generation=dataclasses.replace(config.generation, max_new_tokens=2))
        engines.append(tiny_engine(config, draft_layers=8))
        return engines[-1]

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", classmethod(build))
    monkeypatch.setattr(loading, "resolve_model_dir", lambda name, **_: name)
    monkeypatch.setattr(retrieval, "load_embedder", HashEmbedder)
    return engines


def test_encode_fills_a_store_that_ask_then_reads(docs: Path, tmp_path: Path, built: list[SpecPrefillEngine],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    n = len(retrieval.split_passages(retrieval.load_documents(docs)))
    assert n == 6
    assert cli.main(["encode", "--docs", str(docs), "--passage-store", str(store)]) == 0
    out = capsys.readouterr().out
    assert f"0 passages were in the store, {n} read now" in out and "MiB on disk" in out
    assert len(list(store.glob("*.safetensors"))) == n
    draft = built[-1].config.draft
    assert draft.passages == APART and draft.passage_store_dir == str(store)

    assert cli.main(["encode", "--docs", str(docs), "--passage-store", str(store)]) == 0  # a new engine: from disk
    assert f"{n} passages were in the store, 0 read now" in capsys.readouterr().out
    assert built[-1].draft.passages.counts.disk_hits == n

    assert cli.main(["ask", "Which hut sleeps five people?", "--docs", str(docs), "--passage-store", str(store),
                     "--top-k", "3"]) == 0
    assert "passages 3 from the store, 0 read" in capsys.readouterr().err
    counts = built[-1].draft.passages.counts
    assert (counts.hits, counts.disk_hits, counts.misses) == (3, 3, 0)  # read from the disk, none anew


def test_ask_reads_apart_in_memory_or_jointly(docs: Path, built: list[SpecPrefillEngine],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    question = ["ask", "Which hut sleeps five people?", "--docs", str(docs), "--top-k", "3"]
    assert cli.main([*question, "--read-passages", "apart"]) == 0
    assert "passages 0 from the store, 3 read" in capsys.readouterr().err  # a store in memory only
    assert built[-1].draft.passages.disk is None and len(built[-1].draft.passages) == 3
    assert cli.main(question) == 0  # the library's default: joint
    assert built[-1].config.draft.passages is None and "passages" not in capsys.readouterr().err
    assert cli.main([*question, "--read-passages", "joint"]) == 0
    assert built[-1].config.draft.passages is None and "passages" not in capsys.readouterr().err
    assert cli.main([*question, "--read-passages", "joint", "--passage-store", "x"]) == 2
    assert "drop --read-passages joint" in capsys.readouterr().err


class _Built(Exception):
    pass


@pytest.mark.parametrize("argv", [["demo"], ["gateway"], ["serve", "m", "--gateway-port", "1", "--draft", "d"]])
def test_the_passage_flags_reach_the_draft_config(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    from specprefill_rag.tools import vllm_process

    configs: list[Any] = []

    def record(cls: Any, main: str, draft: str | None = None, *, config: Any, **kwargs: Any) -> Any:
        configs.append(config.draft)
        raise _Built

    class FakeVLLM:
        url, started_s = "http://127.0.0.1:1", 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(SpecPrefillEngine, "from_pretrained", classmethod(record))
    monkeypatch.setattr(loading, "resolve_model_dir", lambda name, **_: name)
    monkeypatch.setattr(cli, "_retrieve", lambda args, question: [])
    monkeypatch.setattr(vllm_process, "VLLMServer", FakeVLLM)
    monkeypatch.setattr("signal.signal", lambda *args: None)
    for flags, passages, where in ((["--passage-store", "/s"], APART, "/s"),
                                   (["--read-passages", "apart"], APART, None),
                                   (["--read-passages", "joint"], None, None), ([], None, None)):
        with pytest.raises(_Built):
            cli.main([*argv, *flags])
        assert (configs[-1].passages, configs[-1].passage_store_dir) == (passages, where)


def test_a_factory_engine_keeps_its_own_store(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    from specprefill_rag.tools import cli_serve

    monkeypatch.setattr(cli_serve, "_factory_engine", lambda spec: tiny_engine())
    assert cli.main(["gateway", "--engine", "m:f", "--passage-store", "/s"]) == 2
    assert "--passage-store cannot reach the draft --engine built" in capsys.readouterr().err
