"""The look-ahead variants the timing suites measure beside the default, their labels, and the
TTFT table built from a run's timings (``ttft``, ``gpu_ttft``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.lib.metrics import median

__all__ = ["compared_lookahead", "lookahead_label", "lookahead_variants", "summarise_length", "ttft_cell"]


def ttft_cell(keep: float, rows: list[dict[str, Any]], ttft_full: float, r: float) -> dict[str, Any]:
    """One TTFT table cell: medians of the SpecPrefill runs at ``keep``, speedup, ideal 1/(r+k), efficiency.

    k is the share of the prompt actually prefilled (the measured ``keep_ratio``: the context
    keep rate plus the protected tokens), not the configured keep rate.
    """
    ttft_spec = median([x["ttft_s"] for x in rows])
    speedup = ttft_full / ttft_spec
    ideal = 1.0 / (r + median([x["keep_ratio"] for x in rows]))
    return {
        "keep_rate": keep,
        "ttft_full_s": ttft_full,
        "ttft_spec_s": ttft_spec,
        "speedup": speedup,
        **{key: median([x[key] for x in rows]) for key in ("draft_s", "selection_s", "prefill_s", "keep_ratio")},
        "ideal": ideal,
        "efficiency": speedup / ideal,
        "raw": rows,
    }


def lookahead_label(config: Any, device: str = "cpu", dtype: Any = None) -> str:
    """What a draft config's look-ahead does on ``device`` in ``dtype``, in the words the TTFT tables use:
    "greedy 8, early exit, upper layers read 30%" (one decode step per token), the same with
    ", 6 guesses per forward" (``DraftConfig.lookahead_guesses``) and ", CUDA graphs"
    (``DraftConfig.cuda_graphs``) and ", to the draft's end" (``DraftConfig.lookahead_stop_at_eos``),
    "greedy 8, full forward", "siblings, ...", "look-ahead 1, ..."."""
    forward = f"early exit, upper layers read {config.upper_keep:.0%}" if config.early_exit else "full forward"
    if config.lookahead == 1:
        return f"look-ahead 1, {'early exit' if config.early_exit else 'full forward'}"
    if config.lookahead_tokens == "siblings":
        return f"siblings, {forward}"
    guesses = config.guesses_on(device, dtype=dtype) if config.early_exit else 0
    graphs = ", CUDA graphs" if config.early_exit and config.graphs_on(device) else ""
    end = ", to the draft's end" if config.lookahead_stop_at_eos else ""
    return (f"greedy {config.lookahead}, {forward}" + (f", {guesses} guesses per forward" if guesses else "")
            + graphs + end)


def compared_lookahead() -> tuple[str, Any]:
    """(label, draft config) of the look-ahead the TTFT runs also measure whole, side by side with
    the library's default: the greedy look-ahead of 8 over full forwards, never stopped (the
    earlier default), beside any default that
    exits early; siblings with early exit beside greedy over full forwards."""
    import dataclasses

    from specprefill_rag import DraftConfig

    default = DraftConfig()
    if default.early_exit:
        compared = dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=False,
                                       lookahead_stop_at_eos=False)
    else:
        compared = dataclasses.replace(default, lookahead_tokens="siblings", early_exit=True)
    return lookahead_label(compared), compared


def lookahead_variants(device: str = "cpu") -> dict[str, Any]:
    """Look-ahead variants whose scoring cost the TTFT runs measure beside the default on
    ``device``, by ``lookahead_label`` (those that run as the default does left out)."""
    import dataclasses

    from specprefill_rag import DraftConfig

    default = DraftConfig()
    variants = []
    for tokens in ("greedy", "siblings"):
        look = dataclasses.replace(default, lookahead=8, lookahead_tokens=tokens)
        variants += [dataclasses.replace(look, early_exit=False)]
        variants += [dataclasses.replace(look, early_exit=True, upper_keep=share) for share in (0.15, 0.3)]
    # Greedy steps after an early exit, one token per forward and verified guesses (same tokens),
    # each replayed from CUDA graphs and eager (on a CPU both are eager: one label).
    variants += [dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=True,
                                     upper_keep=0.3, lookahead_guesses=g, cuda_graphs=graphs)
                 for g in (0, 6) for graphs in (True, False)]
    # The default's look-ahead with and without its stop at the draft's answer's end (random
    # weights, as gpu_ttft.py's, rarely write an end token: there both cost the same).
    variants += [dataclasses.replace(default, lookahead=8, lookahead_tokens="greedy", early_exit=True, upper_keep=0.3,
                                     lookahead_stop_at_eos=stop) for stop in (False, True)]
    variants.append(dataclasses.replace(default, lookahead=1, early_exit=True))
    own = lookahead_label(default, device)
    named = {lookahead_label(config, device): config for config in variants}
    return {label: config for label, config in named.items() if label != own}


def _lookahead_rows(raw: dict[tuple[Any, ...], list[Any]], draft_plain: float, main_plain: float
                    ) -> dict[str, dict[str, float]]:
    """Scoring cost of each measured look-ahead variant: seconds, × a plain draft forward, r."""
    out = {}
    for key, values in raw.items():
        if key[0] == "lookahead":
            seconds = median(values)
            out[str(key[1])] = {"scoring_s": seconds, "overhead": seconds / draft_plain, "r": seconds / main_plain}
    return out


def summarise_length(target: int, n_tokens: int, raw: dict[tuple[Any, ...], list[Any]],
                     keep_rates: list[float], compared_keep_rates: Sequence[float] = ()) -> dict[str, Any]:
    """Medians, r (draft scoring cost over the main model's full prefill) and one cell per keep rate.

    Optional entries of ``raw``: ``("lookahead", name)`` scoring seconds of a look-ahead variant;
    ``("spec_compared", keep)`` SpecPrefill runs with ``compared_lookahead()`` (its own cells, its
    own r: the scoring cost over the main forward)."""
    full, plain = raw[("full", None)], raw[("plain", None)]
    capture, early = raw.get(("capture", None), []), raw.get(("early", None), [])
    spec = {keep: raw[("spec", keep)] for keep in keep_rates}
    main_plain = median([f["prefill_s"] for f in full])
    draft_plain = median(plain)
    r = draft_plain / main_plain
    ttft_full = median([f["ttft_s"] for f in full])
    draft_scoring = median([x["draft_s"] for rows in spec.values() for x in rows])
    return {
        "target_tokens": target,
        "n_tokens": n_tokens,
        "main_plain_s": main_plain,
        "draft_plain_s": draft_plain,
        "draft_scoring_s": draft_scoring,
        "capture_only_s": median(capture) if capture else None,
        "r": r,
        # The draft's own cost in the default, over the main forward: what limits SpecPrefill
        # (r is the plain forwards' ratio; early exit can score for less than a plain forward).
        "r_scoring": draft_scoring / main_plain,
        "capture_overhead": draft_scoring / draft_plain,
        "hook_overhead": median(capture) / draft_plain if capture else None,
        # Question-only scoring with early exit: its r, and its cost against a plain draft forward.
        "early_exit_s": median(early) if early else None,
        "r_early_exit": median(early) / main_plain if early else None,
        "early_exit_overhead": median(early) / draft_plain if early else None,
        "full_raw": full,
        "plain_raw": plain,
        "capture_raw": capture,
        "early_raw": early,
        "cells": [ttft_cell(keep, spec[keep], ttft_full, r) for keep in keep_rates],
        "lookahead_scoring": _lookahead_rows(raw, draft_plain, main_plain),
        "compared_label": compared_lookahead()[0],
        "cells_compared": [
            ttft_cell(keep, raw[("spec_compared", keep)], ttft_full, r) for keep in compared_keep_rates
        ],
    }
