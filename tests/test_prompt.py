"""Prompt assembly: segment map, protected mask, offsets, errors."""

from __future__ import annotations

import pytest
import torch

from specprefill_rag.prompt import assemble, build_segments
from specprefill_rag.types import Passage, SegmentKind


def test_segments_map_back_to_their_text(tokenizer):
    segments = build_segments(
        "what is the passkey?",
        [Passage("The grass is green. The sky is blue.", id="doc-a"), "The passkey is 48213."],
        "Answer the question using the context.",
    )
    prompt = assemble(tokenizer, segments, protect_tail_tokens=3)
    assert [s.kind for s in segments] == [
        SegmentKind.INSTRUCTIONS, SegmentKind.PASSAGE, SegmentKind.PASSAGE, SegmentKind.QUESTION
    ]
    assert segments[1].id == "doc-a" and segments[2].id == "2"
    assert prompt.text.startswith("<|im_start|>system\nAnswer the question")
    assert prompt.text.endswith("Question: what is the passkey?<|im_end|>\n<|im_start|>assistant\n")
    n = prompt.n_tokens
    assert prompt.token_ids.shape == prompt.segment_index.shape == prompt.protected.shape == (n,)
    assert prompt.offsets.shape == (n, 2)
    for index, segment in enumerate(segments):
        ids = prompt.token_ids[prompt.segment_index == index]
        assert tokenizer.decode(ids).strip() in segment.text
        assert len(tokenizer.decode(ids).strip()) >= len(segment.text) - 2  # at most an edge token lost
    # Offsets point into the rendered text; a segment's first token may carry the space before it.
    for i in range(n):
        a, b = prompt.offsets[i].tolist()
        if prompt.segment_index[i] >= 0:
            assert prompt.text[a:b].lstrip() in segments[int(prompt.segment_index[i])].text


def test_protected_mask(tokenizer):
    segments = build_segments("what is the passkey?", ["The passkey is 48213. " * 5], "Be concise.")
    prompt = assemble(tokenizer, segments, protect_tail_tokens=2)
    seg, prot = prompt.segment_index, prompt.protected
    assert prot[seg == -1].all()  # template text and special tokens
    assert prot[seg == 0].all()  # instructions
    assert prot[seg == 2].all()  # question
    assert not prot[seg == 1].any()  # the passage is prunable
    assert prot[-2:].all()
    unprotected = assemble(tokenizer, segments, protect_instructions=False, protect_tail_tokens=0)
    assert not unprotected.protected[unprotected.segment_index == 0].any()
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert prot[prompt.token_ids == im_start].all()


def test_plain_prompt_without_chat_template(tokenizer):
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    plain.chat_template = None
    prompt = assemble(plain, build_segments("what?", ["some context here"], None))
    assert prompt.text == "Context:\n[1]\nsome context here\n\nQuestion: what?\nAnswer:"
    assert (prompt.segment_index == 0).any() and (prompt.segment_index == 1).any()


def test_bad_input_messages(tokenizer):
    with pytest.raises(ValueError, match="question is empty"):
        build_segments("   ", ["context"])
    with pytest.raises(ValueError, match="context is empty"):
        build_segments("what?", [])
    with pytest.raises(ValueError, match="context is empty"):
        build_segments("what?", ["", "  "])
    with pytest.raises(ValueError, match="prompt is empty"):
        assemble(tokenizer, [])


def test_slow_tokenizer_is_rejected(tokenizer):
    class Slow:
        is_fast = False
        chat_template = None

    with pytest.raises(ValueError, match="slow tokenizer"):
        assemble(Slow(), build_segments("q?", ["c"]))


def test_chat_segments_map_turns():
    from specprefill_rag.prompt import chat_segments

    segments = chat_segments(
        [("system", "Be brief."), ("user", "hello"), ("assistant", "hi there"), ("user", "what is the passkey?")],
        [Passage("The sky is blue.", id="sky"), "The passkey is 48213."],
        instructions="unused: a system turn wins",
    )
    assert [(s.kind, s.id) for s in segments] == [
        (SegmentKind.INSTRUCTIONS, None),
        (SegmentKind.HISTORY, "turn-0"),
        (SegmentKind.HISTORY, "turn-1"),
        (SegmentKind.PASSAGE, "sky"),
        (SegmentKind.PASSAGE, "2"),
        (SegmentKind.QUESTION, None),
    ]
    assert segments[0].text == "Be brief."
    assert (segments[1].role, segments[1].text) == ("user", "hello")
    assert (segments[2].role, segments[2].text) == ("assistant", "hi there")
    tool = chat_segments([("user", "a"), ("tool", "42"), ("human", "b"), ("ai", "c"), ("user", "q?")])
    assert [(s.kind, s.role, s.text) for s in tool] == [
        (SegmentKind.HISTORY, "user", "a"), (SegmentKind.HISTORY, "user", "b"), (SegmentKind.HISTORY, "assistant", "c"),
        (SegmentKind.CONTEXT, None, "Tool: 42"), (SegmentKind.QUESTION, None, "q?"),
    ]
    assert segments[-1].text == "what is the passkey?"
    assert chat_segments([("user", "q?")], instructions="Answer.")[0].text == "Answer."
    with pytest.raises(ValueError, match="no messages"):
        chat_segments([])
    with pytest.raises(ValueError, match="only system messages"):
        chat_segments([("system", "x")])
    with pytest.raises(ValueError, match="last user message is empty"):
        chat_segments([("user", "  ")])


def test_sentence_breaks_follow_punctuation_and_line_breaks():
    from specprefill_rag.prompt import sentence_breaks

    text = 'Title\nFirst one. Second "quoted!" Third? 3.5 stays. End'
    breaks = sentence_breaks(text)
    pieces = [text[a:b] for a, b in zip(breaks, [*breaks[1:], len(text)], strict=True)]
    assert pieces == ["Title\n", "First one.", ' Second "quoted!"', " Third?", " 3.5 stays.", " End"]
    assert sentence_breaks("no sentence end at all") == [0]


def test_sentence_starts_mark_the_first_token_of_each_passage_sentence(tokenizer):
    segments = build_segments(
        "what is the passkey?", ["The grass is green. The sky is blue.", "The passkey is 48213."], "Be concise."
    )
    prompt = assemble(tokenizer, segments)
    assert prompt.sentence_start is not None and prompt.sentence_start.shape == (prompt.n_tokens,)
    firsts = prompt.sentence_start & ~prompt.protected
    starts = [prompt.text[int(prompt.offsets[i, 0]) :].lstrip()[:10] for i in firsts.nonzero().flatten()]
    assert starts == ["The grass ", "The sky is", "The passke"]
    assert prompt.n_context == int((~prompt.protected).sum())
    question = prompt.positions_of(SegmentKind.QUESTION)
    assert tokenizer.decode(prompt.token_ids[question]).strip() == "what is the passkey?"


def test_kept_runs_cover_each_prunable_segment_exactly(tokenizer):
    import torch

    from specprefill_rag import prompt
    from specprefill_rag.selection import plan_from_indices

    segments = build_segments("what is the passkey?", ["The sky is blue. The sun is yellow.", "Alpha beta."])
    p = prompt.assemble(tokenizer, segments)
    first = (p.segment_index == 0).nonzero().flatten().tolist()
    kept = torch.tensor([i for i in range(p.n_tokens) if i not in first[1:3]])
    runs = prompt.kept_runs(p, plan_from_indices(p, kept))
    assert sorted(runs) == [0, 1]  # the passages; never the question
    assert "".join(t for t, _ in runs[0]) == segments[0].text and [k for _, k in runs[0]] == [True, False, True]
    a, b = int(p.offsets[first[1], 0]), int(p.offsets[first[2], 1])
    assert runs[0][1][0] == p.text[a:b]
    assert runs[1] == ((segments[1].text, True),)


def char_levels(text: str) -> list[int]:
    """cut_levels with one token per character."""
    import torch

    from specprefill_rag.prompt import cut_levels

    offsets = torch.tensor([(i, i + 1) for i in range(len(text))], dtype=torch.int64)
    return cut_levels(text, offsets).tolist()


def test_cut_levels_mark_word_and_clause_starts_and_keep_numbers_whole():
    #             a  b ' ' 1  9  ,  8  6  ,  ' ' c
    assert char_levels("ab 19,86, c") == [1, 0, 1, 1, 0, 0, 0, 0, 1, 2, 2]
    assert char_levels("3.14 don't") == [1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert char_levels("東京都") == [1, 1, 1]  # no spaces to find: cut anywhere


def reference_cut_levels(text: str, offsets: list[tuple[int, int]]) -> list[int]:
    """cut_levels one token and one character at a time: the rule, written out."""
    no_space = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x2E80, 0xA4CF), (0xF900, 0xFAFF),
                (0xFF66, 0xFF9F), (0x20000, 0x3FFFF))

    def word(c: str) -> bool:
        return c.isalnum() and not any(a <= ord(c) <= b for a, b in no_space)

    def joined(at: int) -> bool:
        before, after = text[at - 1: at] if at else "", text[at: at + 1]
        if word(before) and word(after):
            return True
        nxt, prev = text[at + 1: at + 2], text[at - 2: at - 1] if at >= 2 else ""
        if after and after in ".,:'\u2019" and word(before) and word(nxt):
            return before.isdigit() == nxt.isdigit()
        if before and before in ".,:'\u2019" and word(after) and word(prev):
            return after.isdigit() == prev.isdigit()
        return False

    out, previous_end = [], 0
    for a, b in offsets:
        if a < previous_end or joined(a):
            out.append(0)
        else:
            stripped = text[:a].rstrip()
            out.append(2 if stripped and stripped[-1] in ",;:\u2013\u2014" else 1)
        previous_end = max(previous_end, b)
    return out


def test_cut_levels_equal_the_rule_written_out():
    import random

    import torch

    from specprefill_rag.prompt import cut_levels

    rng = random.Random(0)
    alphabet = list("ab9 0.,:;'\u2019-\u2014\n\t") + ["東", "é", "ß", "٣", "ก", "😀", "_", "x"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        spans = list(zip([0, *cuts], [*cuts, len(text)], strict=True))
        offsets = [(a, b) for a, b in spans if rng.random() < 0.9]
        if offsets and rng.random() < 0.3:  # a character split across two byte tokens
            k = rng.randrange(len(offsets))
            offsets.insert(k + 1, offsets[k])
        tensor = torch.tensor(offsets, dtype=torch.int64).reshape(-1, 2)
        assert cut_levels(text, tensor).tolist() == reference_cut_levels(text, offsets), (text, offsets)


def test_cut_levels_never_split_a_character_between_tokens():
    import torch

    from specprefill_rag.prompt import cut_levels

    # byte-level BPE: two tokens share one character's span
    offsets = torch.tensor([(0, 1), (1, 2), (1, 2), (2, 3)], dtype=torch.int64)
    assert cut_levels("a 😀", offsets).tolist() == [1, 1, 0, 1]


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_units_never_cut_a_word_or_a_number(name):
    """A sentence far longer than the unit limit (no sentence end in it) is cut only between words:
    no unit begins inside a run of letters or digits (Qwen writes digits one token each)."""
    import re

    from specprefill_rag.loading import load_tokenizer
    from specprefill_rag.selection import unit_bounds

    tok = load_tokenizer(name)
    words = ("the expedition of 1986 reached 3,141,592 metres with internationalization of 20250317 "
             "logistics, then 7.25 kilometres; unquestionably the 1,986th attempt").split()
    sentence = " ".join(words[i % len(words)] for i in range(400))
    prompt = assemble(tok, build_segments("How far?", [sentence]))
    assert prompt.cut_level is not None
    for limit in (16, 64):
        bounds = unit_bounds(prompt.segment_index, ~prompt.protected, limit, prompt.sentence_start, prompt.cut_level)
        assert len(bounds) > 400 * 1.5 / limit / 4  # the sentence was cut, into units near the limit
        runs = [(m.start(), m.end()) for m in re.finditer(r"\d[\d,.]*\d|[A-Za-z]+", prompt.text)]
        inside = set()
        for a, b in runs:
            inside.update(range(a + 1, b))
        for start, end in bounds.tolist():
            at = int(prompt.offsets[start, 0])
            assert at not in inside, (limit, prompt.text[at - 10: at + 10])
            assert end - start <= 2 * limit


def conversation(turns: int) -> list[tuple[str, str]]:
    out = [("system", "Answer from the context.")]
    for k in range(turns):
        out += [("user", f"Question {k}: what did the crew of expedition {k} find?"),
                ("assistant", f"They found sample {k}. The ice core was 30{k} metres long.")]
    return out


@pytest.fixture(scope="module", params=["chatml", "inst"])
def chat_tokenizer(request):
    from specprefill_rag.testing import tiny_inst_tokenizer, tiny_tokenizer

    return tiny_tokenizer() if request.param == "chatml" else tiny_inst_tokenizer()


def test_turn_k_begins_with_turn_k_minus_one_conversation(chat_tokenizer):
    """History turns are the chat messages they were: the prompt of turn k starts with turn k - 1's
    whole conversation as the chat template renders it, and shares with turn k - 1's own prompt
    everything before that turn's question (what vLLM's prefix cache holds), token for token."""
    check_turns(chat_tokenizer)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_turns_share_their_prefix_with_the_packaged_templates(name):
    from specprefill_rag.loading import load_tokenizer

    check_turns(load_tokenizer(name))


def check_turns(tok) -> None:
    from specprefill_rag.prompt import chat_segments

    def rendered(turns: list[tuple[str, str]]) -> str:
        return tok.apply_chat_template([{"role": r, "content": t} for r, t in turns], tokenize=False)

    prompts = [assemble(tok, chat_segments([*conversation(k), ("user", f"Question {k}: and then?")],
                                           [f"Passage of turn {k}."])) for k in range(4)]
    for k in range(1, 4):
        prompt, previous = prompts[k], prompts[k - 1]
        assert prompt.text.startswith(rendered(conversation(k)))
        ids, before = prompt.token_ids.tolist(), previous.token_ids.tolist()
        shared = next((i for i, (a, b) in enumerate(zip(ids, before, strict=False)) if a != b), len(before))
        assert shared >= len(tok(rendered(conversation(k - 1)), add_special_tokens=False)["input_ids"])
        history = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.HISTORY]
        assert len(history) == 2 * k
        assert prompt.protected[torch.isin(prompt.segment_index, torch.tensor(history))].all()  # kept whole
        for index, a, b in prompt.segment_spans:
            assert prompt.text[a:b] == prompt.segments[index].text
        assert f"Passage of turn {k}." in prompt.text and f"Passage of turn {k - 1}." not in prompt.text


def test_history_without_a_chat_template_is_written_as_turns(tokenizer):
    from specprefill_rag.prompt import chat_segments

    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        prompt = assemble(tokenizer, chat_segments([("user", "hi"), ("assistant", "hello"), ("user", "q?")], ["P."]))
    finally:
        tokenizer.chat_template = template
    assert prompt.text.startswith("User: hi\n\nAssistant: hello\n\nContext:\n")
    assert prompt.text.endswith("Question: q?\nAnswer:")


def test_history_can_be_left_prunable(tokenizer):
    from specprefill_rag.config import SelectionConfig, SpecPrefillConfig
    from specprefill_rag.prompt import chat_segments
    from specprefill_rag.testing import tiny_engine

    segments = chat_segments([*conversation(2), ("user", "q?")], ["A passage."])
    history = torch.tensor([i for i, s in enumerate(segments) if s.kind is SegmentKind.HISTORY])
    prompt = assemble(tokenizer, segments, protect_history=False)
    assert not prompt.protected[torch.isin(prompt.segment_index, history)].any()
    engine = tiny_engine(SpecPrefillConfig(selection=SelectionConfig(protect_history=False)))
    unprotected = engine.assemble(list(segments))
    assert not unprotected.protected[torch.isin(unprotected.segment_index, history)].any()
    default = engine.assemble(list(segments), selection=SelectionConfig())
    assert default.protected[torch.isin(default.segment_index, history)].all()
    with pytest.raises(ValueError, match="protect_history must be True or False"):
        SelectionConfig(protect_history=1)  # type: ignore[arg-type]


def test_visible_starts_follow_str_lstrip():
    """A token's visible start is its first character ``str.lstrip`` keeps (its start when it is
    white space only): the vectorised rule against the per-token one, on random texts full of
    Unicode white space, and the code-point list against Python's own ``str.isspace``."""
    import random

    from specprefill_rag.prompt.render import _WHITESPACE, _visible_starts

    assert sorted(_WHITESPACE.tolist()) == [c for c in range(0x110000) if chr(c).isspace()]
    chars = [" ", "\t", "\n", "\u00a0", "\u2003", "\u3000", "\x1c", "\x85", "a", "é", "中", "😀", "\u200b"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 60)))
        pairs = []
        for _ in range(20):
            a = rng.randint(0, len(text))
            pairs.append((a, rng.randint(a, len(text))))
        offsets = torch.tensor(pairs, dtype=torch.int64)
        starts, ends = offsets[:, 0], offsets[:, 1]
        lead = torch.tensor([len(text[a:b]) - len(text[a:b].lstrip()) for a, b in pairs])
        expected = torch.where(starts + lead < ends, starts + lead, starts)
        assert torch.equal(_visible_starts(text, starts, ends), expected)
