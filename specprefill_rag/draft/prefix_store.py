"""The draft's keys and values of prompt heads it has read, so a prompt that starts the same way
(the application's system prompt, a chat's earlier turns) is read from where the head ends.

A causal model's keys and values of a prompt's first p tokens depend on those p tokens only, so
the draft computes them once and later prompts that begin with the same p token ids reuse them:
the draft's prompt forward then runs over the rest of the prompt alone. What the draft reads is
protected (never pruned) and shared by the requests of an application, the part vLLM's prefix
cache already makes free for the main model; without this store the draft re-read it each time.

An entry holds the keys and values of layers 0 … ``exit_layer`` (the layers the prompt's forward
runs: all of them, or up to the highest aggregated one under early exit) and the hidden states
leaving ``exit_layer`` (what the upper layers' reading set is gathered from). A head is a prompt's
tokens up to its question: the system prompt, a chat's earlier turns and the context, so a
follow-up question over the same passages, or an agent's next step (whose prompt extends the
last one), reads its new tokens only, jointly as ever. Entries are looked up by the longest start
a prompt shares with one (any part of an entry serves: the same system prompt with other
passages), so a chat's turn k + 1 extends turn k's entry instead of reading the conversation
again. Bounded in entries and bytes, least recently used first out; thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..caches import Bounded

__all__ = ["MIN_PREFIX_TOKENS", "PrefixEntry", "PrefixStore"]

MIN_PREFIX_TOKENS = 32  # a shorter head is read with the rest: splitting the forward would not pay


@dataclass(frozen=True)
class PrefixEntry:
    """The draft's state after reading ``token_ids`` (p,): per layer 0 … ``exit_layer`` its keys
    and values (1, kv_heads, p, head_dim), and the hidden states (1, p, d_model) leaving ``exit_layer``."""

    token_ids: torch.Tensor  # (p,) int64, on the CPU
    exit_layer: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hidden: torch.Tensor
    namespace: str = ""  # the cache salt it was read under: found only by prompts of the same one

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, self.hidden)
        return sum(t.numel() * t.element_size() for t in tensors) + 8 * self.n_tokens

    def start(self, m: int) -> PrefixEntry:
        """This entry's first ``m`` tokens (views of its tensors)."""
        return PrefixEntry(self.token_ids[:m], self.exit_layer, tuple(k[:, :, :m] for k in self.keys),
                           tuple(v[:, :, :m] for v in self.values), self.hidden[:, :m], self.namespace)


def _shared_start(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class PrefixStore(Bounded[tuple[str, int, bytes], PrefixEntry]):
    """At most ``entries`` prompt heads and ``max_bytes`` of their tensors together (0 entries:
    nothing is kept). ``longest`` finds the longest stored head of a prompt in one namespace (a
    request's cache salt): tenants never read each other's heads."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        super().__init__(entries, max_bytes, lambda entry: entry.nbytes)

    def longest(self, token_ids: torch.Tensor, exit_layer: int, namespace: str = "") -> PrefixEntry | None:
        """The longest stored start of ``token_ids`` (n,) under ``namespace`` and ``exit_layer``, or
        None: an entry whose tokens ``token_ids`` begins with, or the first m tokens of one that it
        shares them with (a causal model's keys, values and hidden states of m tokens depend on
        those m only), m at least ``MIN_PREFIX_TOKENS``. A part of an entry comes as an entry of
        its own, views of the stored tensors."""
        ids = token_ids.to(torch.int64).cpu()
        best: tuple[tuple[str, int, bytes], PrefixEntry, int] | None = None
        for key, entry in self._snapshot():
            if entry.namespace != namespace or entry.exit_layer != exit_layer:
                continue
            m = _shared_start(entry.token_ids, ids)
            if m >= MIN_PREFIX_TOKENS and (best is None or m > best[2]):
                best = (key, entry, m)
        if best is None:
            return None
        self._get(best[0])  # now the most recently used
        return best[1] if best[2] == best[1].n_tokens else best[1].start(best[2])

    def add(self, entry: PrefixEntry) -> None:
        self.put((entry.namespace, entry.exit_layer, entry.token_ids.numpy().tobytes()), entry)
