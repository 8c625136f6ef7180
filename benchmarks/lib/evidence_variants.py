"""What ``bench evidence`` measures: its scoring + selection variants, and the look-ahead blocks
their scores are read from (captured once per example, ``evidence_capture``).

A variant is the library's own config objects (``DraftConfig``, ``SelectionConfig``) with where
its scores come from; ``VARIANTS`` names every one a run measures, ``exit_candidates`` adds the
default's early exit after other layers (``--candidate-layers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specprefill_rag import DraftConfig, SelectionConfig
from specprefill_rag.config import LayerChoice

MAX_LOOKAHEAD = 8  # captured once; shorter look-aheads are prefixes of the same greedy run
# The early-exit blocks ("lens", "upper<share>", "greedyupper<share>") depend on the aggregated
# layers, whose top is where the prompt's forward stops: an untagged block is captured for
# LENS_LAYERS, a block "<kind>@<layers>" for other layers ("<layers>": a LayerChoice, or "a-b" for
# the layers a..b), so exits at other depths are measured as the library runs them.
LENS_LAYERS: LayerChoice = "middle_half"
UPPER_KEEPS = (0.15, 0.3)  # DraftConfig.upper_keep values captured
EXIT_KINDS = ("lens", *(f"upper{u:g}" for u in UPPER_KEEPS), *(f"greedyupper{u:g}" for u in UPPER_KEEPS))
BLOCKS = ("greedy", "full", *EXIT_KINDS)  # look-ahead row blocks, in order


def layers_tag(layers: LayerChoice | tuple[int, ...]) -> str:
    """How a block names its aggregated ``layers``: a LayerChoice as it is, a run of indices "a-b"."""
    if isinstance(layers, str):
        return layers
    first, last = min(layers), max(layers)
    if tuple(layers) != tuple(range(first, last + 1)):
        raise ValueError(f"early-exit blocks are captured for a LayerChoice or a run of layers, got {layers}")
    return f"{first}-{last}"


def block_name(kind: str, layers: LayerChoice | tuple[int, ...]) -> str:
    """The block of early-exit ``kind`` for ``layers`` (untagged for ``LENS_LAYERS``)."""
    return kind if layers == LENS_LAYERS else f"{kind}@{layers_tag(layers)}"


def block_layers(block: str) -> tuple[str, LayerChoice | tuple[int, ...]]:
    """(kind, aggregated layers) of a block name; ``ValueError`` for a name that is none."""
    kind, _, tag = block.partition("@")
    if kind in ("greedy", "full") and not tag:
        return kind, LENS_LAYERS
    if kind not in EXIT_KINDS:
        raise ValueError(f"unknown look-ahead block {block!r}: one of {BLOCKS}, or <early-exit kind>@<layers>")
    if not tag:
        return kind, LENS_LAYERS
    if "-" in tag:
        first, last = (int(x) for x in tag.split("-"))
        return kind, tuple(range(first, last + 1))
    DraftConfig(layers=tag)  # type: ignore[arg-type]  # validates the name
    return kind, tag  # type: ignore[return-value]


@dataclass(frozen=True)
class Variant:
    """One scoring + selection configuration, in the library's own config objects."""

    name: str
    draft: DraftConfig = field(default_factory=DraftConfig)
    selection: SelectionConfig = field(default_factory=lambda: SelectionConfig(min_prompt_tokens=0))
    scores: str = "draft"  # "draft" | "random" | "oracle" | "lens" (the draft, look-ahead block "lens")
    prior: bool = False  # pass a retriever prior (MiniLM question-passage cosine) to selection


REFERENCE = DraftConfig(
    lookahead=8, lookahead_tokens="greedy", lookahead_weight=1.0, layers="all", heads="max", normalize=False
)
CHUNKS = SelectionConfig(min_prompt_tokens=0, unit="chunk", chunk_size=32)
SENTENCES = SelectionConfig(min_prompt_tokens=0, unit="sentence")


def _lookahead_name(d: DraftConfig) -> str:
    end = ", to the draft's end" if d.lookahead_stop_at_eos and d.lookahead > 1 else ""
    if d.lookahead == 1 or (d.lookahead_tokens == "greedy" and not d.early_exit):
        return f"look-ahead {d.lookahead}{end}"
    if d.lookahead_tokens == "greedy":
        return f"look-ahead {d.lookahead}, upper layers read {d.upper_keep:.0%}{end}"
    if not d.early_exit:
        return f"{d.lookahead - 1} siblings, full forward"
    return f"{d.lookahead - 1} siblings, upper layers read {d.upper_keep:.0%}"


def _variants() -> list[Variant]:
    out = [
        Variant("reference (look-ahead 8, all layers, max, chunks 32)", REFERENCE, CHUNKS),
        Variant("random chunks", REFERENCE, CHUNKS, scores="random"),
        Variant("random sentences", REFERENCE, SENTENCES, scores="random"),
        Variant("oracle sentences", REFERENCE, SENTENCES, scores="oracle"),
    ]
    for weight in (0.0, 0.25, 0.5, 1.0):
        for layers in ("all", "upper_half", "middle_half", "lower_half"):
            for normalize in (False, True):
                for heads in ("max", "mean"):
                    d = DraftConfig(  # the scoring grid, measured with the greedy look-ahead on full forwards
                        lookahead=MAX_LOOKAHEAD, lookahead_tokens="greedy", lookahead_weight=weight, layers=layers,
                        heads=heads, normalize=normalize, early_exit=False,  # type: ignore[arg-type]
                    )
                    tag = f"w={weight:g} {layers} {heads}{' norm' if normalize else ''}"
                    out.append(Variant(f"{tag} | chunks 32", d, CHUNKS))
                    out.append(Variant(f"{tag} | sentences", d, SENTENCES))
    best = DraftConfig()  # the library default
    looks = [dataclasses.replace(best, lookahead=1)]  # no look-ahead tokens: early exit changes nothing
    looks += [dataclasses.replace(best, lookahead=n, lookahead_tokens="greedy", early_exit=e)
              for n in (2, 4, 8) for e in (False, True)]
    looks += [dataclasses.replace(best, lookahead=8, lookahead_tokens="greedy", early_exit=True, upper_keep=u)
              for u in UPPER_KEEPS]
    looks += [dataclasses.replace(best, lookahead=8, lookahead_tokens="greedy", early_exit=e, lookahead_stop_at_eos=s)
              for e in (False, True) for s in (False, True)]  # the look-ahead cut at the draft's answer's end
    looks += [dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=False) for n in (2, 4, 8)]
    looks += [
        dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=True, upper_keep=u)
        for u in UPPER_KEEPS for n in (2, 4, 8)
    ]
    for d in looks:
        if d != best:
            out.append(Variant(f"default scoring, {_lookahead_name(d)} | sentences", d, SENTENCES))
    for n in (2, 4, 8):  # read off the exit layer by the LM head: measured, not a library option
        d = dataclasses.replace(best, lookahead=n, lookahead_tokens="siblings", early_exit=True)
        out.append(Variant(f"default scoring, {n - 1} siblings off the exit layer (logit lens) | sentences", d,
                           SENTENCES, scores="lens"))
    def sentences(**overrides: Any) -> SelectionConfig:
        return dataclasses.replace(SENTENCES, **overrides)

    for pw in (0.25, 0.5):
        out.append(Variant(f"default scoring | sentences, passage {pw:g}", best, sentences(passage_weight=pw)))
    for cap in (32, 128):
        out.append(Variant(f"default scoring | sentences ≤ {cap}", best, sentences(max_sentence_tokens=cap)))
    for mass in (0.5, 0.7, 0.9):
        out.append(Variant(f"default scoring | sentences, keep_mass {mass:g}", best, sentences(keep_mass=mass)))
    for rw in (0.1, 0.25, 0.5, 1.0):
        out.append(
            Variant(f"default scoring | sentences, retriever {rw:g}", best, sentences(retriever_weight=rw), prior=True)
        )
    out.append(Variant("library default", best, SelectionConfig(min_prompt_tokens=0)))
    return out


VARIANTS = {v.name: v for v in _variants()}


def exit_candidates(tag: str) -> list[Variant]:
    """The library default's scoring with its early exit after another layer: the aggregated
    layers a..b of ``tag`` ("a-b", for one draft's depth), with the default look-ahead (greedy
    from the upper layers over a reading set), none (look-ahead 1) and siblings. Their blocks
    are "greedyupper0.3@a-b" and "upper0.3@a-b" (``--blocks``). Added to ``VARIANTS`` by
    ``--candidate-layers``; what a cheaper draft would keep, measured on the same examples."""
    _, layers = block_layers(f"upper0.3@{tag}")
    best = dataclasses.replace(DraftConfig(), layers=layers)
    looks = (best, dataclasses.replace(best, lookahead=1), dataclasses.replace(best, lookahead_tokens="siblings"))
    return [Variant(f"default scoring, layers {tag}, {_lookahead_name(d)} | sentences", d, SENTENCES) for d in looks]
