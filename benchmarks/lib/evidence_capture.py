"""The draft's attention rows behind every ``bench evidence`` variant, captured once per example.

One forward over the prompt, then each look-ahead block (``evidence_variants.BLOCKS``) continues
it on the prompt's cache; the per-layer rows of the question, the last prompt token and every
block are kept (fp16) for each (normalize, heads) combination, and ``variant_scores`` reads any
variant's scores off them with the library's own ``scoring`` functions, as
``DraftModel.score(..., config=cfg)`` computes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.lib.evidence_variants import BLOCKS, MAX_LOOKAHEAD, UPPER_KEEPS, block_layers, block_name
from specprefill_rag import DraftConfig
from specprefill_rag.draft import probe as draft_lib
from specprefill_rag.types import AssembledPrompt, SegmentKind

POOL_KERNEL = DraftConfig().pool_kernel


@dataclass(frozen=True)
class PromptPass:
    """The prompt's one forward, which every block's look-ahead continues: the draft, its recorder
    and cache (the prompt alone between blocks), and at each top aggregated layer what entered it
    (the last token's) and what left it (every token's)."""

    draft: Any  # DraftModel
    recorder: Any  # draft.probe.Recorder
    cache: Any  # transformers.DynamicCache
    parts: Any  # draft.probe.DecoderParts
    prompt: torch.Tensor  # (1, n) token ids on the draft's device
    logits: torch.Tensor  # (vocab,) the last prompt token's
    entering: dict[int, torch.Tensor]  # top layer → (hidden,) the last token's input to it
    leaving: dict[int, torch.Tensor]  # top layer → (1, n, hidden) its output

    @property
    def n(self) -> int:
        return int(self.prompt.shape[1])


@torch.inference_mode()
def _capture_all(draft: Any, ids: torch.Tensor, question: torch.Tensor, blocks: Sequence[str]) -> Any:
    """The look-aheads the variants read, after ONE forward over the prompt (the library's
    ``capture`` runs one per look-ahead; this is that, with the prompt's forward shared). Blocks
    of 7 rows each, in the order of ``blocks``: "greedy" (7 greedy steps), "full" (siblings from
    the full forward's logits), "lens" (siblings read off the input of the top aggregated layer
    by the LM head: the logit lens, measured and rejected), "upper<share>" (siblings from the
    upper layers over a reading set, ``DraftConfig.upper_keep``: the library's early exit),
    "greedyupper<share>" (its greedy steps); the early-exit ones for ``LENS_LAYERS``, or for the
    layers a "@<layers>" tag names (``block_layers``). Every look-ahead forward runs on the
    prompt's cache cropped back to the prompt. Rows (per layer): question, last token, then the
    blocks. ``tests/test_bench_evidence.py`` checks the variants against ``DraftModel.score``."""
    from specprefill_rag.draft.probe import Recorder, recording

    k = MAX_LOOKAHEAD - 1
    parsed = {block: block_layers(block) for block in blocks}
    aggregated = {layers: DraftConfig(layers=layers).layer_indices(draft.n_layers)  # type: ignore[arg-type]
                  for _, layers in parsed.values()}
    tops = sorted({max(layers) for layers in aggregated.values()})
    recorder = Recorder([int(ids.numel())], [question.to(torch.int64).cpu()])
    with recording(recorder):
        forward = _prompt_pass(draft, recorder, ids, tops)
        tokens: list[int] = []
        for block in blocks:
            kind, layers = parsed[block]
            tokens += _block_lookahead(forward, kind, aggregated[layers], k)
        return recorder.captures([tokens])[0]


def _prompt_pass(draft: Any, recorder: Any, ids: torch.Tensor, tops: Sequence[int]) -> PromptPass:
    """The prompt's forward (recorded while ``recorder`` records), with hooks at each layer of
    ``tops`` for the early exits and the logit lens, removed after it."""
    from transformers import DynamicCache

    from specprefill_rag.draft.probe import DecoderParts

    n = int(ids.numel())
    cache = DynamicCache(config=draft.model.config)
    parts = DecoderParts.of(draft.model)
    assert parts is not None
    entering: dict[int, torch.Tensor] = {}
    leaving: dict[int, torch.Tensor] = {}

    def hooks_of(top: int) -> list[Any]:
        def enter(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            entering[top] = (args[0] if args else kwargs["hidden_states"])[0, -1]

        def leave(module: Any, args: Any, output: Any) -> None:
            leaving[top] = output[0] if isinstance(output, tuple) else output

        return [parts.layers[top].register_forward_pre_hook(enter, with_kwargs=True),
                parts.layers[top].register_forward_hook(leave)]

    hooks = [hook for top in tops for hook in hooks_of(top)]
    prompt = ids.to(draft.device).reshape(1, n)
    try:
        out = draft.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return PromptPass(draft, recorder, cache, parts, prompt, out.logits[0, -1], entering, leaving)


def _block_lookahead(forward: PromptPass, kind: str, chosen: list[int], k: int) -> list[int]:
    """One block's ``k`` look-ahead tokens after the prompt (their rows recorded), the cache then
    back to the prompt: greedy steps (from the full forward, or the early exit's over the layers
    ``chosen``), or the siblings of one forward's logits: the full forward's, the logit lens's at
    the top of ``chosen``, or the early exit's."""
    from specprefill_rag.draft.probe import reading_sets, tree_mask, upper_layer_logits

    draft, n, device = forward.draft, forward.n, forward.draft.device
    top = max(chosen)
    if kind == "greedy":
        return _greedy_steps(draft, forward.cache, forward.logits, n, k)
    if kind.startswith("greedyupper"):
        return _upper_greedy_steps(forward, chosen, float(kind.removeprefix("greedyupper")), k)
    if kind == "full":
        first = forward.logits
    elif kind == "lens":
        first = forward.parts.head(forward.parts.norm(forward.entering[top]))
    else:
        last = torch.tensor([n - 1], device=device)
        keeps = reading_sets(draft, forward.recorder, float(kind.removeprefix("upper")), chosen)
        first = upper_layer_logits(forward.parts, forward.leaving[top], last, top, keeps)[0]
    siblings = first.topk(k).indices
    draft.model(input_ids=siblings.reshape(1, k), position_ids=torch.full((1, k), n, device=device),
                attention_mask=tree_mask(torch.ones(1, n, device=device), k), past_key_values=forward.cache,
                use_cache=True, logits_to_keep=1)
    forward.cache.crop(-k)  # back to the prompt
    return list(siblings.tolist())


def _end_at(tokens: Sequence[int], end_ids: Iterable[int]) -> int:
    """How many of a block's look-ahead ``tokens`` come before the first end token."""
    ends = set(end_ids)
    return next((i for i, t in enumerate(tokens) if t in ends), len(tokens))


def _greedy_steps(draft: Any, cache: Any, logits: torch.Tensor, n: int, k: int) -> list[int]:
    """``k`` greedy decode steps after the prompt (recorded), then the cache back to the prompt."""
    device = draft.device
    greedy: list[int] = []
    for step in range(k):
        greedy.append(int(logits.argmax()))
        logits = draft.model(
            input_ids=torch.tensor([[greedy[-1]]], device=device),
            position_ids=torch.tensor([[n + step]], device=device),
            attention_mask=torch.ones(1, n + step + 1, dtype=torch.int64, device=device), past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits[0, -1]
    cache.crop(-k)
    return greedy


def _upper_greedy_steps(forward: PromptPass, aggregated: list[int], share: float, k: int) -> list[int]:
    """The library's early-exit greedy look-ahead (``draft.upper_greedy``) on the full forward's
    cache, whose layers up to the top aggregated one are the early-exit forward's (left as they
    are: the loop runs on fixed-size copies, ``draft.early_exit.StepLoop``). The layers above get zero
    rows (they are never read for it). One step per token: verified guesses give the same tokens
    and rows (tests/test_lookahead.py)."""
    from transformers import DynamicCache

    from specprefill_rag.draft.probe import ExitedPrompts, LookaheadSpec, reading_sets, upper_greedy

    draft, recorder = forward.draft, forward.recorder
    top = max(aggregated)
    leaving = forward.leaving[top]
    keeps = reading_sets(draft, recorder, share, aggregated)
    n = int(leaving.shape[1])
    everything = recorder.layers
    recorder.layers = frozenset(range(top + 1))
    try:
        prompts = ExitedPrompts(forward.prompt, torch.ones(1, n, dtype=torch.int64, device=draft.device),
                                forward.cache, leaving)
        spec = LookaheadSpec(lookahead=k + 1, layers=aggregated, guesses=0)  # k steps, upper layers from top + 1
        tokens, _ = upper_greedy(forward.parts, prompts, DynamicCache(config=draft.model.config), keeps, spec)
    finally:
        recorder.layers = everything
    for layer in range(top + 1, draft.n_layers):
        pieces = recorder.queries[layer][0]
        heads, _, dim = pieces[0].shape
        pieces.append(pieces[0].new_zeros(heads, k, dim))
    return tokens[0].tolist()  # the loop ran on copies: ``cache`` still holds the prompt alone


def _block_rows(cap: Any, prompt: AssembledPrompt) -> dict[str, torch.Tensor]:
    """Per (normalize, heads) combination, (layers, n_queries, n) fp16 rows of a capture."""
    context = ~prompt.protected
    return {
        f"{int(normalize)}{heads}": torch.stack(
            [
                draft_lib.layer_rows(
                    cap.queries[i], cap.keys[i], cap.scaling[i], POOL_KERNEL,
                    positions=cap.positions, context=context if normalize else None, heads=heads,
                )
                for i in range(len(cap.keys))
            ]
        ).half()
        for normalize in (False, True)
        for heads in ("max", "mean")
    }


def _block_tokens(cap: Any, blocks: Sequence[str]) -> dict[str, list[int]]:
    """Each block's look-ahead tokens (``MAX_LOOKAHEAD - 1`` per block, in ``blocks`` order)."""
    k = MAX_LOOKAHEAD - 1
    return {b: list(cap.lookahead_token_ids[i * k : (i + 1) * k]) for i, b in enumerate(blocks)}


def capture_rows(draft: Any, prompt: AssembledPrompt, blocks: Sequence[str] = BLOCKS) -> dict[str, Any]:
    """Per-layer rows for every (normalize, heads) combination, (layers, n_q + 1 + 7 × blocks, n)
    fp16: the question's queries, the last prompt token's, then each block of ``blocks``; each
    block's tokens and the draft's end tokens (``DraftConfig.lookahead_stop_at_eos``)."""
    question = prompt.positions_of(SegmentKind.QUESTION)
    cap = _capture_all(draft, prompt.token_ids, question, blocks)
    return {"n_question": cap.n_question, "n_layers": draft.n_layers, "blocks": list(blocks),
            "tokens": _block_tokens(cap, blocks), "end_ids": sorted(draft.end_ids), **_block_rows(cap, prompt)}


def complete_rows(draft: Any, prompt: AssembledPrompt, rows: dict[str, Any], blocks: Sequence[str] = BLOCKS
                  ) -> dict[str, Any]:
    """``rows`` of an older capture with the ``blocks`` it lacks added (one more prompt
    forward, no greedy steps unless those are missing too)."""
    have = rows.get("blocks", ["greedy", "full", "lens"])  # the first layout had these three
    missing = [b for b in blocks if b not in have]
    if not missing:
        return rows
    cap = _capture_all(draft, prompt.token_ids, prompt.positions_of(SegmentKind.QUESTION), missing)
    lead = cap.n_question + 1
    added = _block_rows(cap, prompt)
    out = dict(rows, blocks=[*have, *missing], end_ids=sorted(draft.end_ids),
               tokens={**rows.get("tokens", {}), **_block_tokens(cap, missing)})
    for combo, extra in added.items():
        out[combo] = torch.cat([rows[combo], extra[:, lead:]], dim=1)
    return out


def variant_scores(rows: dict[str, Any], cfg: DraftConfig, block: str | None = None) -> torch.Tensor:
    """What ``DraftModel.score(..., config=cfg)`` returns, from the cached rows (``block``: read
    that look-ahead block instead of the one ``cfg`` implies, e.g. "lens")."""
    per_layer = rows[f"{int(cfg.normalize)}{cfg.heads}"].float()
    n_q = rows["n_question"]
    lookahead = cfg.lookahead_for(n_q)
    lead = n_q + 1  # the question's rows and the last prompt token's
    if block is None:
        greedy = cfg.lookahead_tokens == "greedy"
        if lookahead == 1 or (greedy and not cfg.early_exit):
            block = "greedy"
        elif not cfg.early_exit or max(cfg.layer_indices(rows["n_layers"])) == rows["n_layers"] - 1:
            block = "greedy" if greedy else "full"  # no early exit, or nothing above the aggregated layers
        else:
            if cfg.upper_keep not in UPPER_KEEPS:
                raise ValueError(f"early-exit look-aheads were captured for upper_keep in {UPPER_KEEPS} only")
            block = block_name(f"{'greedy' if greedy else ''}upper{cfg.upper_keep:g}", cfg.layers)
    elif block == "lens":
        block = block_name("lens", cfg.layers)
    captured = rows.get("blocks", ["greedy", "full", "lens"])
    if lookahead > 1 and block not in captured:  # a look-ahead of 1 reads no block
        raise ValueError(f"this capture holds no look-ahead block {block!r} (it holds {captured}): capture it "
                         "with --blocks")
    after = lead + (MAX_LOOKAHEAD - 1) * captured.index(block) if lookahead > 1 else lead
    fed = lookahead - 1  # look-ahead tokens whose rows count
    if cfg.lookahead_stop_at_eos and lookahead > 1:
        if "tokens" not in rows:
            raise ValueError("this capture holds no look-ahead tokens: capture it again to cut at the draft's end")
        fed = min(fed, _end_at(rows["tokens"][block], rows["end_ids"]))
    per_layer = per_layer[cfg.layer_indices(rows["n_layers"])]
    per_layer = torch.cat([per_layer[:, :lead], per_layer[:, after : after + fed]], dim=1)
    return draft_lib.importance(per_layer, draft_lib.query_weights(n_q, 1 + fed, cfg.lookahead_weight))
