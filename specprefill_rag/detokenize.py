"""Token ids → streamed text deltas, with stop strings.

Text is decoded from all ids so far (so multi-token characters come out whole) and a delta is
released only when it cannot be the beginning of a stop string or an unfinished character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDecoder"]


class IncrementalDecoder:
    """Feed token ids one by one; get the text that is safe to show."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""  # the final text so far, stop string excluded
        self.stopped = False  # a stop string was seen

    def _held_back(self, text: str) -> int:
        """How many trailing characters might still turn into a stop string or a character."""
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return len(text) - len(text.rstrip("\ufffd"))
        hold = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:size]):
                    hold = size
                    break
        return hold

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that can be shown (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in self._stop if s in text), default=-1)
        if cut >= 0:
            self.stopped = True
            text = text[:cut]
            safe = len(text)
        else:
            safe = len(text) - self._held_back(text)
        self.text = text
        delta = text[self._emitted : max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return delta

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)
