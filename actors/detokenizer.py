"""Incremental detokenisation and stop strings, as the request actor applies them.

Text is produced token by token without ever splitting a multi-byte UTF-8
character across deltas: a decode window that still ends in an incomplete
character (U+FFFD) is held back until the next token completes it. Stop
strings are matched on the produced text, including matches that straddle
deltas; text that might be the start of a stop string is held back until it
is known not to be one.
"""

from __future__ import annotations

import json
from collections import deque
from functools import lru_cache
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["Tokenizer", "ByteTokenizer", "IncrementalDetokenizer", "KeepSpecialTokens", "token_text_function", "StopAutomaton",
           "stop_automaton", "StopStringMatcher", "TextAssembler", "max_bytes_per_token"]

_REPLACEMENT = "\ufffd"
# Longest UTF-8 sequence: after this many held tokens a trailing U+FFFD may be real text.
_MAX_HELD_TOKENS = 4
# Held tokens after which a tail with no settled token boundary is released as it decodes.
_GIVE_UP_HELD_TOKENS = 16
# Prompt tokens kept as decoding context, so a first token that decodes differently
# after a word (leading spaces in sentencepiece vocabularies) comes out right.
_CONTEXT_TOKENS = 4
# Decoded ids before the window are dropped once this many pile up.
_TRIM_AT = 64
# Automata of stop lists up to this many characters in all are kept for reuse
# (the default request limits allow 16 x 256), the most recent this many of them.
_CACHED_AUTOMATON_CHARS = 4096
_CACHED_AUTOMATA = 64
# Pre-tokenisers that split text without dropping any of it (Split also, unless it removes).
_LOSSLESS_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_ids: Sequence[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens left out."""


def max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, or None when unknown.

    A tokenizer may declare it (`max_bytes_per_token`). For a Hugging Face
    tokenizer it is read from the vocabulary, but only for byte-level BPE with
    no normaliser and no pre-tokeniser that drops text: there every byte of a
    prompt is kept by some token, so a prompt of B bytes has at least B / k
    tokens. Any other tokenizer gets None (its prompts are tokenised to be
    counted).
    """
    declared = getattr(tokenizer, "max_bytes_per_token", None)
    if declared is not None:
        return int(declared)
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str") or not _keeps_every_byte(backend):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    # A byte-level token's string has one character per byte, each at most 2 bytes
    # in UTF-8; an added token's string is its text: this over-counts, never under.
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


def _keeps_every_byte(backend) -> bool:
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None:
        return False
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = {part.get("type") for part in parts}
    dropping = [part for part in parts if part.get("type") == "Split"
                and part.get("behavior") == "Removed"]
    return "ByteLevel" in kinds and kinds <= _LOSSLESS_PRE_TOKENIZERS and not dropping


class ByteTokenizer:
    """Text as its UTF-8 bytes: token id b < 256 is the byte b, 256 is end of sequence.

    The default tokenizer of the simulated executor, so text prompts work with
    no model at all.
    """

    vocab_size = 257
    max_bytes_per_token = 1
    eos_token_id = 256
    eos_token_ids = (256,)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of the byte tokens; end-of-sequence and unknown ids are skipped."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


def token_text_function(tokenizer: Tokenizer | None):
    """The text of one token id, special tokens spelled out (for logprobs); without
    a tokenizer, "token_id:N"."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    try:
        tokenizer.decode([0], skip_special_tokens=False)
    except TypeError:
        return lambda token_id: tokenizer.decode([token_id])
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


class KeepSpecialTokens:
    """A tokenizer whose text keeps special tokens (`skip_special_tokens=False`)."""

    __slots__ = ("tokenizer", "eos_token_ids")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens spelled out."""
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)
        except TypeError:  # a tokenizer without special tokens (the byte tokenizer)
            return self.tokenizer.decode(token_ids)


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
        if not text.endswith(_REPLACEMENT):
            return self._advance(text)
        held = len(ids) - self.read
        if held < _MAX_HELD_TOKENS:
            return ""
        # Held long enough for the last character to be real text, or a new one still
        # incomplete: release the tokens whose text is settled (every character but the
        # last one is: adding bytes only changes how an incomplete tail decodes).
        settled = text[:-1]
        for end in range(len(ids) - 1, self.read, -1):
            head = self.tokenizer.decode(ids[self.prefix:end])
            if settled.startswith(head) and head.startswith(self.prefix_text):
                return self._advance(head, end)
        if held < _GIVE_UP_HELD_TOKENS:
            return ""
        return self._advance(text)  # no token boundary settles: give up holding

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        return self._advance(self.tokenizer.decode(self.ids[self.prefix:]))

    def _advance(self, text: str, end: int | None = None) -> str:
        """Emit `text` (the decode of the window up to `end`, default all held tokens)
        past what was already said, and move the window on to `end`."""
        prefix_text = self.prefix_text
        if text.startswith(prefix_text):
            new = text[len(prefix_text):]
        else:
            # The context decodes differently once followed by more tokens (merged
            # whitespace, normalisation): emit only what lies past its length.
            new = text[len(prefix_text):] if len(text) > len(prefix_text) else ""
        ids = self.ids
        self.prefix, self.read = self.read, len(ids) if end is None else end
        if self.prefix > _TRIM_AT:
            del ids[:self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        self.prefix_text = self.tokenizer.decode(ids[self.prefix:self.read])
        return new


class StopAutomaton:
    """An Aho-Corasick automaton over one request's stop strings, built once.

    States are the prefixes of the stop strings (0 is the empty one). Feeding
    a character follows the trie where it can and the failure links where it
    cannot, so matching costs amortised O(1) per character of text whatever
    the number or length of the stop strings. Immutable once built: requests
    with the same stop strings share one (`stop_automaton`).
    """

    __slots__ = ("goto", "fail", "depth", "match", "num_chars")

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        match = [0]  # per state: the longest stop string ending there (0: none)
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    match.append(0)
                state = nxt
            match[state] = len(stop)
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                back = fail[state]
                while back and ch not in goto[back]:
                    back = fail[back]
                fail[nxt] = goto[back].get(ch, 0)
                # A state that completes no stop string still ends one its suffix completes.
                match[nxt] = match[nxt] or match[fail[nxt]]
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.match = goto, fail, depth, match
        self.num_chars = sum(map(len, stops))


@lru_cache(maxsize=_CACHED_AUTOMATA)
def _cached_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


def stop_automaton(stops: Sequence[str]) -> StopAutomaton:
    """The automaton of `stops`, shared between requests when the list is small."""
    stops = tuple(stops)
    if sum(map(len, stops)) <= _CACHED_AUTOMATON_CHARS:
        return _cached_automaton(stops)
    return StopAutomaton(stops)


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    The first stop string to be completed wins (of two completed by the same
    character, the longer), so the outcome does not depend on how the text is
    cut into deltas. `feed` returns the text that is safe to release and
    whether a stop string was found; text that could be the beginning of a
    stop string is held until later text settles it. `num_steps` counts the
    automaton's transitions, the whole cost of matching.
    """

    __slots__ = ("automaton", "include_stop", "held", "state", "num_steps", "matched")

    def __init__(self, stops: Sequence[str] | StopAutomaton, include_stop: bool = False) -> None:
        self.automaton = stops if isinstance(stops, StopAutomaton) else stop_automaton(stops)
        self.include_stop = include_stop
        self.matched: str | None = None  # the stop string found, once one is
        self.held = ""
        self.state = 0
        self.num_steps = 0

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text to release, whether a stop string ended it)."""
        automaton = self.automaton
        goto, fail, match = automaton.goto, automaton.fail, automaton.match
        state, steps = self.state, 0
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
                steps += 1
            state = goto[state].get(ch, 0)
            steps += 1
            if match[state]:
                self.num_steps += steps
                buffer = self.held + text[:i + 1]
                self.matched = buffer[len(buffer) - match[state]:]
                end = len(buffer) if self.include_stop else len(buffer) - match[state]
                self.held, self.state = "", 0
                released = buffer[:end]
                return released, True
        self.num_steps += steps
        self.state = state
        buffer = self.held + text
        keep = automaton.depth[state]  # the longest suffix that begins some stop string
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """Release the held text (the request ended without a stop string)."""
        held, self.held, self.state = self.held, "", 0
        return held


class TextAssembler:
    """Detokeniser plus stop strings: token ids in, released text out."""

    __slots__ = ("detokenizer", "matcher")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stops: Sequence[str] | StopAutomaton = (), include_stop: bool = False) -> None:
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
