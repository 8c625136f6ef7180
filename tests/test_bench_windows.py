"""``bench windows``: the default scores read in windows, the draft's window restored."""

from __future__ import annotations

import torch


def test_default_scores_read_in_windows_and_restore_the_drafts_window(tokenizer) -> None:
    from types import SimpleNamespace

    from helpers import make_model

    from benchmarks.suites import evidence, windows
    from specprefill_rag import DraftModel
    from specprefill_rag.types import SegmentKind

    model = make_model("llama", len(tokenizer), layers=4)
    draft = DraftModel(model, tokenizer)
    ids = torch.randint(0, len(tokenizer), (400,), generator=torch.Generator().manual_seed(2))
    protected = torch.zeros(400, dtype=torch.bool)
    protected[:10] = protected[380:] = True
    prompt = SimpleNamespace(token_ids=ids, protected=protected, positions_of=lambda kind: torch.arange(385, 395)
                             if kind is SegmentKind.QUESTION else torch.arange(0))
    own = model.config.max_position_embeddings
    whole, one, _ = evidence.default_scores(draft, prompt, None)
    parts, count, _ = evidence.default_scores(draft, prompt, 200)
    assert one == 1 and count == 3 and model.config.max_position_embeddings == own  # 370 context, 200 - 7 - 30
    assert whole.shape == parts.shape == (400,) and not torch.equal(whole, parts)
    row = {"task": "t", "one pass": {"metrics": {"0.1": [0.5, 1, 0.1]}}, "windows": {"windows": 3, "metrics":
           {"0.1": [0.25, 0, 0.1]}}}
    (entry,) = windows.summarize([row])
    assert entry["recall_diff"][0] == -0.25 and entry["complete_diff"][0] == -1 and entry["windows"] == 3
