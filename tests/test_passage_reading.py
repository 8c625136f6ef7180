"""Passages read once (``draft.passage_reading``, ``draft.passage_store``): each passage is read
against the prompt's anchor and itself, kept, and reused wherever it appears again.

What must hold: keys moved by rotation equal keys computed in place; a passage's reading equals a
plain forward of the anchor and the passage; with every passage token read again jointly from
layer 0 the scores are the joint reading's; a prompt of one passage reads the same either way; a
second request reads the same scores as the first and runs no draft layer over a passage token;
store keys differ by namespace, anchor and draft; the store keeps its byte budget; the disk tier
survives a kill mid-write. Tiny random models (Llama and Qwen2 layouts)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import PASSAGES, QUESTION, make_model

from specprefill_rag import DraftConfig
from specprefill_rag import prompt as prompt_lib
from specprefill_rag.config import PassageReading
from specprefill_rag.draft import DraftModel, DraftScorer
from specprefill_rag.draft.capture import recording
from specprefill_rag.draft.early_exit import DecoderParts
from specprefill_rag.draft.passage_kv import rerotate, rotates_plainly
from specprefill_rag.draft.passage_reading import PromptLayout, prompt_layout
from specprefill_rag.draft.passage_store import PassageDisk, PassageEntry, PassageStore, passage_key
from specprefill_rag.types import SegmentKind

LOCAL = DraftConfig(passages=PassageReading(recompute="none"), memo_entries=0,
                    prefix_cache_entries=0)  # the passage store alone, every layer of a passage in it
JOINT = DraftConfig(memo_entries=0, prefix_cache_entries=0, passages=None)


def _draft(family, tokenizer, layers: int = 8) -> DraftModel:
    return DraftModel(make_model(family, len(tokenizer), layers=layers), tokenizer)


def _prompt(tokenizer, passages=PASSAGES, question: str = QUESTION):
    return prompt_lib.assemble(tokenizer, prompt_lib.build_segments(question, passages, "Answer the question."))


def _score(draft, prompt, config, namespace: str = ""):
    layout = prompt_layout(prompt.token_ids, prompt.segment_index, [s.kind for s in prompt.segments])
    return draft.score_batch([prompt.token_ids], questions=[prompt.positions_of(SegmentKind.QUESTION)],
                             contexts=[~prompt.protected], config=config, namespace=namespace, layouts=[layout])[0]


class LayerTokens:
    """The tokens the first decoder layer ran on, per call."""

    def __init__(self, model) -> None:
        self.seen: list[int] = []
        model.get_decoder().layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: self.seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        )


def test_the_layout_reads_passages_after_the_system_part(tokenizer):
    """A RAG prompt's passages are read after its head; a chat's with earlier turns, after the head a
    RAG prompt of the same system part has (``DraftScorer.layout``): both find the same readings."""
    prompt = _prompt(tokenizer)
    layout = prompt_layout(prompt.token_ids, prompt.segment_index, [s.kind for s in prompt.segments])
    passages = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.PASSAGE]
    assert [tuple(prompt.segment_index[s:e].unique().tolist()) for s, e in layout.units] == [(i,) for i in passages]
    assert torch.equal(layout.anchor, prompt.token_ids[: layout.head]) and layout.head == layout.units[0][0]
    scorer = DraftScorer(_draft("llama", tokenizer), tokenizer, LOCAL)
    assert scorer.layout(scorer.render(prompt)) == layout  # the canonical anchor of a RAG prompt: its own head
    history = prompt_lib.assemble(tokenizer, prompt_lib.chat_segments(
        [("system", "Answer the question."), ("user", "hello there"), ("assistant", "hi"), ("user", QUESTION)],
        PASSAGES))
    chat = scorer.layout(scorer.render(history))
    assert torch.equal(chat.anchor, layout.anchor) and chat.head > len(chat.anchor)  # history sits between
    assert prompt_layout(torch.arange(5), torch.tensor([-1, 0, 0, -1, 1]),
                         [SegmentKind.INSTRUCTIONS, SegmentKind.QUESTION]) is None
    odd = prompt_layout(torch.arange(8), torch.tensor([0, -1, 1, 1, 2, 2, -1, 1]),
                        [SegmentKind.INSTRUCTIONS, SegmentKind.PASSAGE, SegmentKind.TOOL_RESULT])
    assert odd == PromptLayout(torch.arange(2), ((2, 4), (4, 6), (7, 8)))  # runs of one segment each, in order


def test_a_chat_finds_the_passages_a_rag_prompt_read(tokenizer):
    from specprefill_rag import GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine
    from specprefill_rag.backends.transformers import TransformersBackend

    config = SpecPrefillConfig(draft=DraftConfig(lookahead=2, memo_entries=0, passages=PassageReading()),
                               selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=64),
                               generation=GenerationConfig(max_new_tokens=2))
    engine = SpecPrefillEngine(TransformersBackend(make_model("qwen2", len(tokenizer)), tokenizer),
                               _draft("llama", tokenizer), config)
    assert engine.read_passages(PASSAGES, instructions="Answer the question.") == (0, len(PASSAGES))
    chat = engine.chat([{"role": "system", "content": "Answer the question."}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": QUESTION}],
                       passages=PASSAGES)
    assert (chat.passages_cached, chat.passages_read) == (len(PASSAGES), 0)


@pytest.mark.parametrize("shift", [1, 37, 900])
def test_moved_keys_equal_keys_computed_in_place(family, tokenizer, shift):
    model = make_model(family, len(tokenizer), layers=2).float()
    parts = DecoderParts.of(model)
    assert rotates_plainly(model, parts)
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(shift))
    found = []
    for first in (5, 5 + shift):
        positions = torch.arange(first, first + 12).unsqueeze(0)
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
        found.append(out.past_key_values.layers[1].keys)
    moved = rerotate(found[0], torch.full((12,), shift), parts.rotary.inv_freq)
    torch.testing.assert_close(moved, found[1], atol=1e-4, rtol=1e-4)


def test_a_passages_reading_equals_a_plain_forward_of_the_anchor_and_it(family, tokenizer):
    draft = _draft(family, tokenizer)
    prompt = _prompt(tokenizer)
    _score(draft, prompt, LOCAL)  # reads the passages (batched, padded) into the store
    layout = prompt_layout(prompt.token_ids, prompt.segment_index, [s.kind for s in prompt.segments])
    exit_layer = max(LOCAL.layer_indices(draft.n_layers))
    for (s, e) in layout.units:
        ids = torch.cat([layout.anchor, prompt.token_ids[s:e]]).unsqueeze(0)
        with torch.no_grad(), recording(None):
            out = draft.model(input_ids=ids, use_cache=True, output_hidden_states=True)
        entry = next(x for _, x in draft.passages._snapshot() if torch.equal(x.token_ids, prompt.token_ids[s:e]))
        a = layout.anchor.numel()
        assert entry.start == a and len(entry.keys) == exit_layer + 1
        torch.testing.assert_close(entry.hidden, out.hidden_states[exit_layer + 1][0, a:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(entry.entering, out.hidden_states[2][0, a:], atol=1e-4, rtol=1e-4)
        for i in (0, exit_layer):
            torch.testing.assert_close(entry.keys[i], out.past_key_values.layers[i].keys[0, :, a:], atol=1e-4,
                                       rtol=1e-4)
            torch.testing.assert_close(entry.values[i], out.past_key_values.layers[i].values[0, :, a:], atol=1e-4,
                                       rtol=1e-4)


@pytest.mark.parametrize("config", [
    DraftConfig(), DraftConfig(lookahead_tokens="siblings"), DraftConfig(lookahead=1),
    DraftConfig(lookahead_weight=1.0),
], ids=["greedy", "siblings", "question only", "look-ahead only"])
def test_every_passage_token_read_again_from_layer_0_gives_the_joint_scores(family, tokenizer, config):
    draft = _draft(family, tokenizer)
    prompt = _prompt(tokenizer)
    joint = _score(draft, prompt, dataclasses.replace(config, memo_entries=0, passages=None))
    again = PassageReading(recompute="all", recompute_from=0)
    local = _score(draft, prompt, dataclasses.replace(config, memo_entries=0, passages=again))
    assert local.lookahead_token_ids == joint.lookahead_token_ids
    torch.testing.assert_close(local.scores, joint.scores, atol=1e-6, rtol=1e-4)


def test_a_passage_read_after_everything_before_it_reads_as_jointly(family, tokenizer):
    """One passage whose anchor is all that precedes it: read apart, it sees what it sees jointly,
    at the same positions, so the whole reading (fresh tokens, look-ahead) equals the joint one."""
    draft = _draft(family, tokenizer)
    prompt = _prompt(tokenizer, PASSAGES[:1])
    laid = prompt_layout(prompt.token_ids, prompt.segment_index, [s.kind for s in prompt.segments])
    whole = PromptLayout(prompt.token_ids[: laid.head], laid.units)  # the anchor: all that precedes it
    joint = _score(draft, prompt, JOINT)
    local = draft.score_batch([prompt.token_ids], questions=[prompt.positions_of(SegmentKind.QUESTION)],
                              contexts=[~prompt.protected], config=LOCAL, layouts=[whole])[0]
    assert local.lookahead_token_ids == joint.lookahead_token_ids
    torch.testing.assert_close(local.scores, joint.scores, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("recompute", ["none", "first", "scored", "deviation", "all"])
def test_a_warm_request_reads_the_cold_scores_and_no_passage_token(family, tokenizer, recompute):
    draft = _draft(family, tokenizer)
    prompt = _prompt(tokenizer)
    config = dataclasses.replace(LOCAL, passages=PassageReading(recompute=recompute))
    cold = _score(draft, prompt, config)
    assert draft.passages.counts.misses == len(PASSAGES) and draft.passages.counts.hits == 0
    counter = LayerTokens(draft.model)
    warm = _score(draft, prompt, config)
    assert draft.passages.counts.hits == len(PASSAGES)
    torch.testing.assert_close(warm.scores, cold.scores, atol=0, rtol=0)
    start = min(LOCAL.layer_indices(draft.n_layers))
    depths = {len(entry.keys) for _, entry in draft.passages._snapshot()}
    assert depths == ({start} if recompute == "all" else {max(LOCAL.layer_indices(draft.n_layers)) + 1})
    layout = prompt_layout(prompt.token_ids, prompt.segment_index, [s.kind for s in prompt.segments])
    fresh = prompt.n_tokens - layout.head - sum(e - s for s, e in layout.units)
    assert counter.seen[:2] == [layout.head, fresh]  # layer 0: the head (no prefix store here), no passage
    assert warm.passages_cached == len(PASSAGES) and warm.passages_read == 0
    assert max(counter.seen) < sum(e - s for s, e in layout.units)  # nothing reads the passages again
    moved = _prompt(tokenizer, [PASSAGES[2], PASSAGES[0], PASSAGES[3], PASSAGES[1]])  # other positions
    _score(draft, moved, config)
    assert draft.passages.counts.misses == len(PASSAGES)  # every passage found where it now sits


def test_store_keys_differ_by_namespace_anchor_and_draft(tokenizer):
    draft = _draft("qwen2", tokenizer)
    prompt = _prompt(tokenizer)
    _score(draft, prompt, LOCAL, namespace="alpha")
    _score(draft, prompt, LOCAL, namespace="beta")  # another tenant: read again, never shared
    assert draft.passages.counts.hits == 0 and draft.passages.counts.misses == 2 * len(PASSAGES)
    _score(draft, prompt, LOCAL, namespace="alpha")
    assert draft.passages.counts.hits == len(PASSAGES)
    other_system = prompt_lib.assemble(tokenizer, prompt_lib.build_segments(QUESTION, PASSAGES, "Reply briefly."))
    _score(draft, other_system, LOCAL, namespace="alpha")  # another anchor: read again
    assert draft.passages.counts.misses == 3 * len(PASSAGES)
    anchor, passage = torch.arange(5), torch.arange(9)
    keys = {passage_key(d, s, anchor, passage, "") for d in ("a", "b") for s in ("x", "y")}
    assert len(keys) == 4
    other = _draft("qwen2", tokenizer)
    other.model.get_decoder().layers[0].self_attn.q_proj.weight.data.mul_(1.5)
    assert other.fingerprint != draft.fingerprint


def _entry(m: int, width: int = 16, layers: int = 2) -> PassageEntry:
    kv = tuple(torch.randn(2, m, width) for _ in range(layers))
    return PassageEntry(torch.arange(m), 3, kv, kv, torch.randn(m, width), torch.randn(m, width))


def test_the_store_never_exceeds_its_budget():
    budget = 3 * _entry(50).nbytes
    store = PassageStore(budget)
    for i in range(10):
        store.add(bytes([i]), _entry(50))
        assert store.nbytes <= budget
    assert len(store) == 3 and store.find(bytes([9]), torch.arange(50)) is not None
    assert store.find(bytes([0]), torch.arange(50)) is None  # least recently used: gone
    assert store.find(bytes([9]), torch.arange(49)) is None  # another passage under the same key: refused
    store.add(b"big", _entry(500))  # larger than the whole store: not kept, nothing evicted
    assert len(store) == 3
    off = PassageStore(0)
    off.add(b"x", _entry(5))
    assert len(off) == 0


def test_the_disk_tier_keeps_entries_beyond_memory_and_restarts(tmp_path):
    disk = PassageDisk(tmp_path, max_bytes=10**8)
    store = PassageStore(_entry(40).nbytes, disk)  # memory holds one entry
    entries = {bytes([i]): _entry(40) for i in range(4)}
    for key, entry in entries.items():
        store.add(key, entry)
    again = PassageStore(10**8, PassageDisk(tmp_path, max_bytes=10**8))  # a restart
    for key, entry in entries.items():
        found = again.find(key, torch.arange(40))
        assert found is not None
        torch.testing.assert_close(found.keys[1], entry.keys[1])
        torch.testing.assert_close(found.entering, entry.entering)
    assert again.counts.disk_hits == 4
    small = PassageDisk(tmp_path / "small", max_bytes=int(2.5 * len(_file_bytes(entries[b"\x00"]))))
    for key, entry in entries.items():
        small.save(key, entry)
    assert small.nbytes <= small.max_bytes and len(list((tmp_path / "small").glob("*.safetensors"))) == 2


def _file_bytes(entry: PassageEntry) -> bytes:
    from safetensors.torch import save

    from specprefill_rag.draft.passage_store import _tensors_of

    return save(_tensors_of(entry))


def test_the_disk_tier_survives_a_kill_mid_write(tmp_path):
    """A writer killed while it writes large entries leaves only whole files: each loads or is absent."""
    script = textwrap.dedent(f"""
        import torch
        from specprefill_rag.draft.passage_store import PassageDisk, PassageEntry
        disk = PassageDisk({str(tmp_path)!r}, max_bytes=10**10)
        i = 0
        while True:
            kv = tuple(torch.randn(2, 4000, 64) for _ in range(6))
            disk.save(i.to_bytes(4, "big"), PassageEntry(torch.arange(4000), 3, kv, kv, torch.randn(4000, 64)))
            print(i, flush=True)
            i += 1
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    assert writer.stdout is not None
    for _ in range(3):  # a few whole files, then kill it in the middle of the next ones
        writer.stdout.readline()
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    disk = PassageDisk(tmp_path, max_bytes=10**10)
    names = list(tmp_path.glob("*.safetensors"))
    assert len(names) >= 3
    for path in names:
        assert disk.load(bytes.fromhex(path.stem)) is not None  # no torn file


def test_without_early_exit_or_a_layout_the_draft_reads_jointly(tokenizer):
    draft = _draft("llama", tokenizer)
    prompt = _prompt(tokenizer)
    full = DraftConfig(early_exit=False, memo_entries=0, passages=None)
    joint = _score(draft, prompt, full)
    local = _score(draft, prompt, dataclasses.replace(full, passages=PassageReading()))
    torch.testing.assert_close(local.scores, joint.scores, atol=1e-6, rtol=1e-4)
    assert len(draft.passages) == 0
    unlaid = draft.score(prompt.token_ids, question=prompt.positions_of(SegmentKind.QUESTION),
                         context=~prompt.protected, config=LOCAL)  # no layout given
    assert len(draft.passages) == 0 and unlaid.scores.shape == joint.scores.shape


def test_an_engine_reads_passages_ahead_and_a_question_then_finds_them(tokenizer):
    """``engine.read_passages`` at indexing time: the question that retrieves them reads none again."""
    from specprefill_rag import GenerationConfig, SelectionConfig, SpecPrefillConfig, SpecPrefillEngine
    from specprefill_rag.backends.transformers import TransformersBackend

    config = SpecPrefillConfig(draft=DraftConfig(lookahead=3, passages=PassageReading()),
                               selection=SelectionConfig(keep_rate=0.3, min_prompt_tokens=64),
                               generation=GenerationConfig(max_new_tokens=4))
    engine = SpecPrefillEngine(TransformersBackend(make_model("qwen2", len(tokenizer)), tokenizer),
                               _draft("llama", tokenizer), config)
    assert engine.read_passages(PASSAGES) == (0, len(PASSAGES))
    assert engine.read_passages(PASSAGES[:2]) == (2, 0)
    result = engine.generate(QUESTION, PASSAGES, keep_rate=0.3)
    assert (result.passages_cached, result.passages_read) == (len(PASSAGES), 0)
    other = engine.generate(QUESTION, PASSAGES, keep_rate=0.3,
                            generation=engine.config.generation.with_overrides(cache_salt="tenant-b"))
    assert (other.passages_cached, other.passages_read) == (0, len(PASSAGES))  # another namespace reads anew
    assert result.to_dict()["passages_cached"] == len(PASSAGES)
    again = engine.generate("Which passage is about colours?", PASSAGES, keep_rate=0.3)  # a follow-up
    assert (again.passages_cached, again.passages_read) == (0, 0) and again.draft_cached_tokens > 0


@pytest.mark.parametrize("recompute", ["none", "all"])
def test_a_follow_up_over_the_same_passages_reads_its_question_only(tokenizer, recompute):
    """The reading up to the question goes to the prefix store: a follow-up over the same passages in
    the same order reads only its question and tail, and scores as the first request read them."""
    draft = _draft("llama", tokenizer)
    config = DraftConfig(passages=PassageReading(recompute=recompute), memo_entries=0)
    first = _prompt(tokenizer)
    cold = _score(draft, first, config)
    assert (cold.passages_cached, cold.passages_read) == (0, len(PASSAGES))
    follow = _prompt(tokenizer, question="Which passage is about colours?")
    counter = LayerTokens(draft.model)
    warm = _score(draft, follow, config)
    question = int(follow.positions_of(SegmentKind.QUESTION)[0])
    assert warm.cached_tokens == question and (warm.passages_cached, warm.passages_read) == (0, 0)
    assert counter.seen[0] == follow.n_tokens - question  # the question and the tail only
    alone = _score(_draft("llama", tokenizer), follow, config)  # the same reading, from a cold draft
    torch.testing.assert_close(warm.scores, alone.scores, atol=1e-5, rtol=1e-4)
