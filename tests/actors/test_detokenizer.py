"""Incremental detokenisation and stop strings: the concatenated deltas equal the
whole decode, a UTF-8 character is never split, and a stop string is found
however the text is cut into deltas, with nothing of it released early."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from cadence.actors.detokenizer import (
    ByteTokenizer, IncrementalDetokenizer, StopStringMatcher, TextAssembler, stop_automaton,
)
from cadence.actors.validation import DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS
from cadence.statemachine.sampling import SamplingParams

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
@example("\ufffd")
@example("x\ufffd\ufffd\ufffd\ufffd\ufffdé")
def test_deltas_concatenate_to_the_text(text):
    pieces = detokenize(list(text.encode()))
    assert "".join(pieces) == text
    if "\ufffd" not in text:  # a split character never shows as U+FFFD
        assert all("\ufffd" not in piece for piece in pieces)


@given(st.binary(max_size=40))
@example(b"\xe2\x82\xff\xff\xe2\x82\xac")
def test_any_bytes_come_out_as_their_whole_decode(data):
    """Byte-fallback tokens can spell invalid UTF-8; the deltas still add up to the
    decode of all of them, whatever mix of real and replacement characters."""
    pieces = detokenize(list(data))
    assert "".join(pieces) == data.decode("utf-8", errors="replace")


def test_a_replacement_character_in_the_text_itself_is_released():
    pieces = detokenize(list("a\ufffdb".encode()))
    assert "".join(pieces) == "a\ufffdb"
    assert pieces[-1] == "", "the text's own U+FFFD is streamed, not held until flush"


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


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The reference: the stop string completed first in `text` (of two completed at
    the same character, the longer), as (its end, the string); None if none is."""
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    for end in range(1, len(text) + 1):
        here = [s for s in stops if text[:end].endswith(s)]
        if here:
            return end, max(here, key=len)
    assert not ends
    return None


@given(st.text(alphabet="abc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                       min_size=1, max_size=4),
       st.lists(st.integers(1, 5), max_size=10), st.booleans())
def test_stop_strings_match_whatever_the_cuts(text, stops, cuts, include):
    """Released text is the text up to the first stop string to be completed (with it,
    when asked), the same however the text is cut into deltas."""
    matcher = StopStringMatcher(stops, include_stop=include)
    released, stopped, pos = [], False, 0
    for size in cuts + [len(text)]:
        piece, pos = text[pos:pos + size], pos + size
        out, stopped = matcher.feed(piece)
        released.append(out)
        if stopped or pos >= len(text):
            break
    if not stopped:
        released.append(matcher.flush())
    hit = first_stop(text, stops)
    if hit is None:
        assert not stopped and "".join(released) == text
    else:
        end, stop = hit
        assert stopped and "".join(released) == text[:end if include else end - len(stop)]


def test_overlapping_stop_strings_the_first_completed_wins():
    """"bc" is complete before "abcd" is, so it ends the text, in one delta or many."""
    assert StopStringMatcher(["abcd", "bc"]).feed("xabcd") == ("xa", True)
    assert StopStringMatcher(["he", "she", "hers"], include_stop=True).feed("ushers") == ("ushe", True)


def test_a_bare_stop_string_is_matched_whole():
    """stop="abc" stops at "abc", not at the first "a"."""
    params = SamplingParams(stop="abc")
    assembler = TextAssembler(TOKENIZER, [], params.stop)
    out = [assembler.push(t) for t in b"xa-abc"]
    assert "".join(text for text, _ in out) == "xa-" and out[-1][1]


def test_matching_the_largest_allowed_stop_list_costs_steps_linear_in_the_text():
    """16 stop strings of 256 characters, each a run of "a" that breaks at a different
    place: a scan per stop string would cost 16 x 256 per character; the automaton
    follows at most two transitions per character, amortised, whatever the list."""
    stops = ["a" * k + "b" + "a" * (DEFAULT_MAX_STOP_CHARS - k - 1)
             for k in range(0, DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_CHARS // DEFAULT_MAX_STOP_STRINGS)]
    assert len(stops) == DEFAULT_MAX_STOP_STRINGS and {len(s) for s in stops} == {DEFAULT_MAX_STOP_CHARS}
    matcher = StopStringMatcher(stops)
    num_chars = 0
    # Long runs of "a" keep every stop string in play; "b" then 14 "a"s and a "c"
    # breaks each one a character short of completing it.
    for piece in (["a" * 7] * 40 + ["ba", "a" * 13, "c"]) * 20:
        out, stopped = matcher.feed(piece)
        num_chars += len(piece)
        assert not stopped
    assert matcher.num_steps <= 2 * num_chars
    assert len(matcher.held) < DEFAULT_MAX_STOP_CHARS


def test_the_automaton_of_a_stop_list_is_built_once_and_shared():
    """Requests with the same stop strings share one automaton."""
    assert stop_automaton(("x", "yz")) is stop_automaton(["x", "yz"])
    assert StopStringMatcher(["x", "yz"]).automaton is stop_automaton(("x", "yz"))


def test_assembler_combines_both():
    assembler = TextAssembler(TOKENIZER, [], ["é!"])
    out = [assembler.push(t) for t in "xé!".encode()]
    assert out == [("x", False), ("", False), ("", False), ("", True)]
