"""Incremental detokenization with stop strings.

Text is decoded over a small window of recent tokens and released only once it no longer ends in an
incomplete UTF-8 sequence, so multi-byte characters split across tokens come out whole. Text that
could still turn out to begin a stop string is held back until it is known not to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text deltas.

    Args:
        tokenizer: anything with a Hugging Face style ``decode``.
        prompt_token_ids: the prompt, whose tail gives the first output tokens their context.
        stop_strings: generation stops at the first occurrence of any of these.
        include_stop_string: the text ends after the stop string found, not before it.
        skip_special_tokens: special tokens add no text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop_strings: Sequence[str] = (),
                 include_stop_string: bool = False, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._include_stop_string = include_stop_string
        self._skip_special_tokens = skip_special_tokens
        self._holdback = max((len(s) for s in self._stop_strings), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add_token(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty).

        After a stop string is found, ``stopped`` is True and the text ends just before it.
        """
        self.push(token_id)
        return self.release()

    def push(self, token_id: int, find_stops: bool = True) -> None:
        """Add one token without releasing its text; ``release`` returns it later. With ``find_stops`` False,
        the text it completes is not searched for stop strings."""
        if self.stopped:
            return
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            search_from = max(0, len(self.text) - self._holdback)
            self.text += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            if find_stops:
                self._find_stop(search_from)

    def release(self) -> str:
        """Return the text that became final since the last release (possibly empty)."""
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """Release whatever text is held back, incomplete characters included; call once finished."""
        if not self.stopped and self._read_offset < len(self._token_ids):
            prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
            search_from = max(0, len(self.text) - self._holdback)
            self.text += self._decode(self._token_ids[self._prefix_offset:])[len(prefix_text):]
            self._read_offset = len(self._token_ids)
            self._find_stop(search_from)
        return self._release(final=True)

    def _find_stop(self, search_from: int) -> None:
        found = [(p, -len(s)) for p, s in ((self.text.find(s, search_from), s) for s in self._stop_strings) if p >= 0]
        if found:
            position, minus_length = min(found)  # the first; of those that start there, the longest
            self.text = self.text[:position - minus_length if self._include_stop_string else position]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
