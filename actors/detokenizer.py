"""Incremental detokenisation and stop strings, as the request actor applies them.

Text is produced token by token without ever splitting a multi-byte UTF-8
character across deltas: a decode window that still ends in an incomplete
character (U+FFFD) is held back until the next token completes it. Stop
strings are matched on the produced text, including matches that straddle
deltas; text that might be the start of a stop string is held back until it
is known not to be one.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

__all__ = ["Tokenizer", "ByteTokenizer", "IncrementalDetokenizer", "StopStringMatcher",
           "TextAssembler"]

_REPLACEMENT = "\ufffd"
# Longest UTF-8 sequence: after this many held tokens a trailing U+FFFD is real text.
_MAX_HELD_TOKENS = 4
# Prompt tokens kept as decoding context, so a first token that decodes differently
# after a word (leading spaces in sentencepiece vocabularies) comes out right.
_CONTEXT_TOKENS = 4
# Decoded ids before the window are dropped once this many pile up.
_TRIM_AT = 64


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_ids: Sequence[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens left out."""


class ByteTokenizer:
    """Text as its UTF-8 bytes: token id b < 256 is the byte b, 256 is end of sequence.

    The default tokenizer of the simulated executor, so text prompts work with
    no model at all.
    """

    vocab_size = 257
    eos_token_id = 256
    eos_token_ids = (256,)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of the byte tokens; end-of-sequence and unknown ids are skipped."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Keeps a small window of ids: `ids[prefix:read]` was already turned into
    text and serves as context; each new token decodes the window plus itself
    and emits what the context did not already say.
    """

    __slots__ = ("tokenizer", "ids", "prefix", "read", "prefix_text")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.prefix_text = tokenizer.decode(self.ids) if self.ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is split)."""
        ids = self.ids
        ids.append(token_id)
        text = self.tokenizer.decode(ids[self.prefix:])
        if text.endswith(_REPLACEMENT) and len(ids) - self.read < _MAX_HELD_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        return self._advance(self.tokenizer.decode(self.ids[self.prefix:]))

    def _advance(self, text: str) -> str:
        prefix_text = self.prefix_text
        if text.startswith(prefix_text):
            new = text[len(prefix_text):]
        else:
            # The context decodes differently once followed by more tokens (merged
            # whitespace, normalisation): emit only what lies past its length.
            new = text[len(prefix_text):] if len(text) > len(prefix_text) else ""
        ids = self.ids
        self.prefix, self.read = self.read, len(ids)
        if self.prefix > _TRIM_AT:
            del ids[:self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        self.prefix_text = self.tokenizer.decode(ids[self.prefix:self.read])
        return new


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    `feed` returns the text that is safe to release and whether a stop string
    was found; text that could be the beginning of a stop string is held until
    the next delta settles it.
    """

    __slots__ = ("stops", "include_stop", "held")

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text to release, whether a stop string ended it)."""
        buffer = self.held + text
        first = -1
        match = ""
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first < 0 or at < first or (at == first and len(stop) > len(match))):
                first, match = at, stop
        if first >= 0:
            self.held = ""
            return buffer[:first] + (match if self.include_stop else ""), True
        keep = self._partial_match(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """Release the held text (the request ended without a stop string)."""
        held, self.held = self.held, ""
        return held

    def _partial_match(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:k]):
                    best = k
                    break
        return best


class TextAssembler:
    """Detokeniser plus stop strings: token ids in, released text out."""

    __slots__ = ("detokenizer", "matcher")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stops: Sequence[str] = (), include_stop: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.matcher = StopStringMatcher(stops, include_stop) if stops else None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return (text to release, whether a stop string was hit)."""
        piece = self.detokenizer.push(token_id)
        if self.matcher is None:
            return piece, False
        if not piece:
            return "", False
        return self.matcher.feed(piece)

    def flush(self) -> str:
        """At a finish without a stop string: everything still held back."""
        tail = self.detokenizer.flush()
        if self.matcher is None:
            return tail
        released, stopped = self.matcher.feed(tail) if tail else ("", False)
        if stopped:
            return released
        return released + self.matcher.flush()
