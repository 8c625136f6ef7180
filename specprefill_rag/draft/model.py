"""The draft model: one forward over the prompt plus a look-ahead, with query/key capture.

``DraftModel`` loads a small causal LM and switches it to the capturing attention
(``capture``). ``capture`` / ``capture_batch`` prefill the prompt (``forward``) and run the
look-ahead (``lookahead``), recording the query and key rows scoring needs; ``score`` /
``score_batch`` turn a capture into ``TokenScores`` (``scoring``), reading a prompt too long for
the window in windows (``windows``).

A prompt's protected start (template, system prompt, a chat's earlier turns) is read once: its
keys and values go to the draft's prefix store (``prefix_store``), and a later prompt that begins
with it runs its forward over the rest only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..config import DraftConfig
from ..errors import ConfigError, InputError
from ..loading import eos_ids
from ..types import TokenScores
from . import scoring
from .capture import CAPTURE_ATTENTION, DraftCapture, Recorder, recording, register
from .early_exit import DecoderParts
from .forward import prompt_heads
from .lookahead import LookaheadDrivers
from .lookahead_spec import LookaheadSpec
from .passage_reading import PromptLayout, store_passages
from .passage_store import PassageDisk, PassageStore
from .prefix_store import PrefixStore
from .windows import MIN_WINDOW_CONTEXT, read_windows, score_windowed

__all__ = ["CAPTURE_ATTENTION", "MIN_WINDOW_CONTEXT", "DraftCapture", "DraftModel"]


class DraftModel(LookaheadDrivers):
    """A small causal LM that scores prompt tokens for SpecPrefill.

    Works with any transformers decoder whose attention modules carry ``layer_idx`` and go
    through the attention registry (Llama, Qwen2, Mistral, ... families). The model is switched
    to the capturing SDPA wrapper, which behaves exactly like SDPA outside a capture. Its forward
    plumbing is ``forward.DraftForward``, its look-ahead ``lookahead.LookaheadDrivers``.
    """

    def __init__(self, model: Any, tokenizer: Any, config: DraftConfig | None = None) -> None:
        """``config`` is this draft's default; an engine passes its own to ``score`` instead of
        changing it, so several engines can share one draft."""
        register()
        model.set_attn_implementation(CAPTURE_ATTENTION)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or DraftConfig()
        self._plain_embedding = None  # see _embeds_plainly
        self._plain_cache = None  # see _stores_heads
        # Keys and values of prompt heads read before (``prefix_store``; DraftConfig.prefix_cache_entries).
        self.prefixes = PrefixStore(self.config.prefix_cache_entries, self.config.prefix_cache_bytes)
        # Readings of passages read apart (``passage_store``; DraftConfig.passages, passage_store_bytes).
        disk = None if self.config.passage_store_dir is None else PassageDisk(self.config.passage_store_dir,
                                                                              self.config.passage_store_disk_bytes)
        self.passages = PassageStore(self.config.passage_store_bytes, disk)
        self._plain_rotary = None  # see _reads_apart
        self._fingerprint = None  # see fingerprint
        self.graphs = None  # the look-ahead's CUDA graphs (``capture_graphs``)
        # The ids that end the draft's answer (``DraftConfig.lookahead_stop_at_eos``).
        self.end_ids = eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, config: DraftConfig | None = None, *,
        dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
    ) -> DraftModel:
        """Load a draft by packaged short name, HF directory or GGUF path (see ``loading``);
        ``"auto"``: CUDA + bfloat16 when torch sees a GPU, else the CPU, in bfloat16 where it
        multiplies bf16 natively and float32 otherwise: the main model's rule
        (``loading.resolve_dtype``), so both run at the precision the device is fastest in."""
        from ..loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, config)

    def windows(self, n_tokens: int, context: torch.Tensor | None, extra_positions: int = 0
                ) -> list[torch.Tensor] | None:
        """How a prompt too long for the window is read (``score_batch``): None when it fits;
        else windows, (m,) sorted prompt indices each, that hold every protected token (template,
        instructions, question: ``context`` (n,) bool marks the prunable ones) and one run of
        consecutive prunable tokens, the runs of equal size and together all of them. Each
        window fits with its look-ahead. ``InputError`` when the protected tokens alone leave
        fewer than ``MIN_WINDOW_CONTEXT`` positions (``windows.read_windows``)."""
        if self.fits(n_tokens, extra_positions):
            return None
        return read_windows(n_tokens, context, self.max_context, extra_positions)

    def capture(
        self, token_ids: torch.Tensor, question: torch.Tensor | None = None, *, spec: LookaheadSpec | None = None,
        head: int = 0,
    ) -> DraftCapture:
        """Prefill ``token_ids`` (n_prompt,) and run the look-ahead, recording post-RoPE queries
        of the ``question`` token indices (m,), of the last prompt token and of each of the
        ``spec.lookahead - 1`` look-ahead tokens.

        ``spec`` (default: the draft's own ``DraftConfig``'s look-ahead over every layer,
        ``LookaheadSpec.from_config``): ``spec.tokens`` ``"siblings"`` = the ``lookahead - 1``
        likeliest next tokens, in one more forward, all at position n_prompt, each attending to
        the prompt and itself; ``"greedy"`` = that many greedy decode steps. ``spec.layers``:
        record only these layers (None: all); the last look-ahead forward stops after the highest
        of them. ``spec.early_exit``: the prompt's forward stops there too; the look-ahead tokens
        then come from the upper layers run over the ``spec.upper_keep`` share of the prompt that
        the recorded rows score highest (``early_exit.upper_greedy``, ``early_exit.upper_logits``),
        and greedy steps read that share in their upper layers too. The recorded prompt tensors
        are exactly those of the full forward. ``spec.guesses`` (None: ``lookahead - 2`` on CUDA,
        else 0): with early exit, greedy tokens are verified that many guesses per forward
        (``early_exit.upper_greedy``): the same tokens and queries in fewer forwards. ``head``:
        the prompt's first tokens that later prompts may share (its protected start): read from
        the draft's prefix store (``prefix_store``) when it holds them, and stored once read; the
        prompt's forward then runs over the rest only. ``spec.stop_at_eos``: greedy tokens stop
        where the draft's answer ends (before its first ``end_ids`` token), so a capture may hold
        fewer than ``lookahead - 1`` look-ahead tokens and rows.
        """
        return self.capture_batch([token_ids], [question], spec=spec, heads=[head])[0]

    @torch.inference_mode()
    def capture_batch(
        self, token_ids: Sequence[torch.Tensor], questions: Sequence[torch.Tensor | None] | None = None, *,
        spec: LookaheadSpec | None = None, heads: Sequence[int] | None = None, namespace: str = "",
        layouts: Sequence[PromptLayout | None] | None = None,
    ) -> list[DraftCapture]:
        """``capture`` for several prompts in one right-padded forward per step.

        Padding sits after each prompt and is masked out of every attention; look-ahead tokens
        of prompt b sit at positions n_b, n_b + 1, ... (greedy) or all at n_b (siblings). So
        each capture equals the prompt's own (within floating-point tolerance). ``heads``: one
        ``capture`` head per prompt; the prefix store serves the batch when all prompts begin
        with the same tokens (``_shared_head``). ``spec.graphs``: replay the look-ahead's CUDA
        graphs where ``capture_graphs`` captured one for this shape (False: run it eagerly).
        ``namespace``: the requests' cache salt; the prefix store is read and written under it.
        ``layouts``: where each prompt's passages sit (``passage_reading.prompt_layout``); with
        ``spec.passages`` the passages are read apart and kept in the passage store under
        ``namespace`` (``passage_reading``), the rest of each prompt read on every call.
        """
        spec = LookaheadSpec.from_config(self.config) if spec is None else spec
        spec = dataclasses.replace(spec, guesses=self._guesses(spec.guesses, spec.lookahead))
        lookahead, tokens = spec.lookahead, spec.tokens
        questions = list(questions) if questions is not None else [None] * len(token_ids)
        if not token_ids or len(questions) != len(token_ids):
            raise InputError("pass one question (or None) per prompt, and at least one prompt")
        lengths = [int(ids.numel()) for ids in token_ids]
        self._check_batch(lengths, questions, lookahead, self.config.extra_positions(lookahead, tokens))
        top = spec.top(self.n_layers)  # the highest recorded layer
        recorder = Recorder(lengths, [None if q is None else q.to(torch.int64).cpu() for q in questions],
                            spec.recorded())
        batch = self._right_padded(token_ids, lengths)  # ids, mask and each prompt's last token
        plan = self._reads_apart(spec, batch.ids, layouts, self.config.pool_kernel)
        local = None if plan is None else self._local_read(recorder, token_ids, layouts or (), plan, namespace,
                                                           keep=heads is not None)
        shared = 0 if plan is not None else self._shared_head(token_ids, lengths, recorder.questions, heads)
        exit_layer = self._exit_layer(lookahead, tokens, spec.early_exit, top, batch.ids)
        stored = self.prefixes.longest(token_ids[0][:shared], exit_layer, namespace) if shared else None
        cached = 0 if stored is None else stored.n_tokens  # what the store held before this call
        head = self._read_head(token_ids[0][:shared], exit_layer, namespace) if shared else None
        with recording(recorder):
            if lookahead == 1:
                if local is not None:
                    local()
                else:
                    cache = self._cache(head, len(lengths)) if head is not None else None
                    self._prompt_forward(recorder, batch, stop_after=top if spec.early_exit else None,
                                         cache=cache, head=head)
                return recorder.captures([[] for _ in lengths], cached)
            if tokens == "siblings":
                return recorder.captures(self._siblings(recorder, batch, spec, head, local).tolist(), cached)
            return recorder.captures(self._greedy(recorder, batch, spec, head, local), cached)

    def score(
        self,
        token_ids: torch.Tensor,
        *,
        question: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        config: DraftConfig | None = None,
        layout: PromptLayout | None = None,
    ) -> TokenScores:
        """Importance of every prompt token, (n_prompt,) float32 on the CPU.

        question: (m,) int64 indices of the question's tokens, whose queries join the look-ahead
        ones (``DraftConfig.lookahead_weight`` splits the vote); None scores with the look-ahead
        alone. context: (n_prompt,) bool, the prunable tokens, over which each attention row is
        renormalised when ``config.normalize``. config: this call's settings (default: the
        draft's own). layout: where the prompt's passages sit, which ``config.passages`` reads
        apart (``passage_reading.prompt_layout``; None: read jointly).
        """
        return self.score_batch([token_ids], questions=[question], contexts=[context], config=config,
                                layouts=None if layout is None else [layout])[0]

    @torch.inference_mode()
    def score_batch(
        self,
        token_ids: Sequence[torch.Tensor],
        *,
        questions: Sequence[torch.Tensor | None] | None = None,
        contexts: Sequence[torch.Tensor | None] | None = None,
        config: DraftConfig | None = None,
        namespace: str = "",
        windows: Sequence[Sequence[torch.Tensor] | None] | None = None,
        layouts: Sequence[PromptLayout | None] | None = None,
    ) -> list[TokenScores]:
        """``score`` for several prompts of any lengths in one batched draft run (one padded
        prefill, one batched step per look-ahead token); each result equals the prompt's own
        ``score`` within floating-point tolerance. ``seconds`` is the whole batch's time.

        ``windows``: each prompt's windows as its caller decided them (``DraftScorer.reading``:
        None for a prompt that fits); None: decided here (``windows``), one prompt at a time.

        Each prompt's protected start (its tokens before the first one ``contexts`` marks
        prunable) is its head (``capture``): an application's system prompt, a chat's earlier
        turns are read once and then served from the prefix store (``DraftConfig.prefix_cache_entries``),
        under ``namespace`` (the requests' cache salt: prompts of other namespaces never share a head).
        ``layouts``: where each prompt's passages sit; ``config.passages`` reads them apart and keeps
        each reading in the passage store (``capture_batch``). A prompt read in windows is read jointly."""
        cfg = config or self.config
        start = time.perf_counter()
        batch = len(token_ids)
        questions = list(questions) if questions is not None else [None] * batch
        contexts = list(contexts) if contexts is not None else [None] * batch
        if len(questions) != batch or len(contexts) != batch:
            raise InputError("pass one question and one context mask (or None) per prompt")
        lookaheads = [cfg.lookahead_for(0 if q is None else int(q.numel())) for q in questions]
        if windows is None:
            windows = [self.windows(int(ids.numel()), c, cfg.extra_positions(n))
                       for ids, c, n in zip(token_ids, contexts, lookaheads, strict=True)]
        elif len(windows) != batch:
            raise InputError("pass one window list (or None) per prompt")
        if any(w is not None for w in windows):
            return self._score_windowed(token_ids, questions, contexts, windows, cfg, namespace)
        if cfg.prefix_cache_entries:  # 0: this call neither reads nor changes the store
            self.prefixes.resize(cfg.prefix_cache_entries, cfg.prefix_cache_bytes)
        if cfg.passages is not None:
            self.passages.configure(cfg.passage_store_bytes, cfg.passage_store_dir, cfg.passage_store_disk_bytes)
        spec = LookaheadSpec.from_config(cfg, lookahead=max(lookaheads), n_layers=self.n_layers)
        caps = self.capture_batch(token_ids, questions, spec=spec, namespace=namespace,
                                  heads=prompt_heads(contexts) if cfg.prefix_cache_entries else None,
                                  layouts=layouts)
        results = [self._scores(cap, lookahead, context, cfg)
                   for cap, lookahead, context in zip(caps, lookaheads, contexts, strict=True)]
        seconds = time.perf_counter() - start
        return [dataclasses.replace(r, seconds=seconds) for r in results]

    @torch.inference_mode()
    def read_passages(self, token_ids: torch.Tensor, layout: PromptLayout, config: DraftConfig | None = None,
                      namespace: str = "") -> tuple[int, int]:
        """Read the passages of a prompt (``token_ids`` (n,), where ``layout`` says they sit) into
        the passage store under ``namespace``, without scoring anything: a later prompt that holds
        them after the same anchor reads them from the store (``config.passages``, default the
        draft's own). Returns (passages the store held already, passages read now). ``ConfigError``
        when this draft or config cannot read passages apart."""
        cfg = config or self.config
        if cfg.passages is None:
            raise ConfigError("reading passages ahead needs DraftConfig(passages=PassageReading(...))")
        spec = LookaheadSpec.from_config(cfg, n_layers=self.n_layers)
        ids = token_ids.to(torch.int64)
        plan = self._reads_apart(spec, ids.unsqueeze(0).to(self.device), [layout], cfg.pool_kernel)
        if plan is None:
            raise ConfigError("this draft cannot read passages apart (it needs early exit below its last layer, "
                              "layers it can run by hand and rotary keys it can move): it reads every prompt jointly")
        self.passages.configure(cfg.passage_store_bytes, cfg.passage_store_dir, cfg.passage_store_disk_bytes)
        head = self._read_head(ids[: layout.head], plan.exit_layer, namespace)
        parts = DecoderParts.of(self.model)
        assert parts is not None
        return store_passages(parts, plan, ids, layout, self._anchor(layout, ids, head, plan.exit_layer, namespace),
                              namespace)

    def _scores(self, cap: DraftCapture, lookahead: int, context: torch.Tensor | None, cfg: DraftConfig
                ) -> TokenScores:
        """One prompt's scores from its capture (``lookahead``: the rows it needs)."""
        # A prompt that needs fewer look-ahead rows than the batch, or whose answer ended sooner.
        lookahead = min(lookahead, 1 + len(cap.lookahead_token_ids))
        rows = cap.n_question + lookahead
        mask = context.to(self.device) if context is not None and cfg.normalize else None
        positions = cap.positions[:rows].to(self.device)
        per_layer = torch.stack(
            [
                scoring.layer_rows(
                    cap.queries[i][:, :rows], cap.keys[i], cap.scaling[i], cfg.pool_kernel,
                    positions=positions, context=mask, heads=cfg.heads,
                )
                for i in range(len(cap.keys))
            ]
        )  # (layers, n_question + lookahead, n_prompt)
        weights = scoring.query_weights(cap.n_question, lookahead, cfg.lookahead_weight)
        return TokenScores(scores=scoring.importance(per_layer, weights).cpu(),
                           lookahead_token_ids=cap.lookahead_token_ids[: lookahead - 1], seconds=0.0,
                           cached_tokens=cap.cached_tokens, passages_cached=cap.passages_cached,
                           passages_read=cap.passages_read)

    def _score_windowed(self, token_ids: Sequence[torch.Tensor], questions: list[torch.Tensor | None],
                        contexts: list[torch.Tensor | None], windows: Sequence[Sequence[torch.Tensor] | None],
                        cfg: DraftConfig, namespace: str = "") -> list[TokenScores]:
        """``score_batch`` when some prompts exceed the window (``windows.score_windowed``)."""
        return score_windowed(self.score_batch, token_ids, questions, contexts, windows, cfg, namespace)
