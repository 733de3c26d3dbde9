"""Incremental detokenisation and stop strings: the concatenated deltas equal the
whole decode, a UTF-8 character is never split, and a stop string is found
however the text is cut into deltas, with nothing of it released early."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cadence.actors.detokenizer import (
    ByteTokenizer, IncrementalDetokenizer, StopStringMatcher, TextAssembler,
)

TOKENIZER = ByteTokenizer()


def detokenize(token_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER, list(b"prompt"))
    pieces = [detok.push(t) for t in token_ids]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_come_out_whole():
    text = "aé€🙂z"
    pieces = detokenize(list(text.encode()))
    assert "".join(pieces) == text
    assert [p for p in pieces if p] == ["a", "é", "€", "🙂", "z"]


def test_invalid_bytes_come_out_as_replacement_characters_without_stalling():
    pieces = detokenize([0xFF, 0xFF, 0xFF, 0xFF, 0xFF, ord("x")])
    assert "".join(pieces) == "\ufffd" * 5 + "x"


@given(st.text(max_size=40))
def test_deltas_concatenate_to_the_text(text):
    pieces = detokenize(list(text.encode()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_split_over_deltas_is_found_and_held_back():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P tail") == ("", True)


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("x") == ("abx", False)
    assert matcher.flush() == ""
    assert matcher.feed("ab") == ("", False)
    assert matcher.flush() == "ab"


def test_the_earliest_stop_string_wins_and_may_be_kept():
    matcher = StopStringMatcher(["world", "o w"], include_stop=True)
    assert matcher.feed("hello world") == ("hello w", True)


@given(st.text(alphabet="abc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=3),
                                                       min_size=1, max_size=3),
       st.lists(st.integers(1, 5), max_size=10))
def test_stop_strings_match_whatever_the_cuts(text, stops, cuts):
    """Released text is the text seen so far up to the first stop string in it, checked
    after each delta (as a stream must), however the text is cut."""
    matcher = StopStringMatcher(stops)
    released, stopped, pos = [], False, 0
    expected, seen = None, ""
    for size in cuts + [len(text)]:
        piece, pos = text[pos:pos + size], pos + size
        seen += piece
        hits = [seen.find(s) for s in stops if s in seen]
        if hits and expected is None:
            expected = seen[:min(hits)]
        out, stopped = matcher.feed(piece)
        released.append(out)
        if stopped or pos >= len(text):
            break
    if not stopped:
        released.append(matcher.flush())
    assert "".join(released) == (expected if expected is not None else text)
    assert stopped == (expected is not None)


def test_assembler_combines_both():
    assembler = TextAssembler(TOKENIZER, [], ["é!"])
    out = [assembler.push(t) for t in "xé!".encode()]
    assert out == [("x", False), ("", False), ("", False), ("", True)]
