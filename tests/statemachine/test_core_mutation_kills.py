"""Tests written against mutants of the core that survived the fast suites
(`python -m cadence.spec.mutation`): each pins a behaviour no other test did."""

from __future__ import annotations

from cadence.statemachine.blocks import NO_PARENT, block_keys_for


def test_a_wide_token_key_is_parent_header_then_the_tokens_spelled_out():
    """The documented layout, parent hash in 8 bytes then one header byte, also
    when a token id does not fit in 32 bits."""
    wide = 2 ** 40
    key = block_keys_for([wide, 7], 2, None)[0]
    assert key[:8] == NO_PARENT.to_bytes(8, "little", signed=True)
    assert key[8] == 1  # the header: tokens spelled out, no salt
    assert key[9:] == repr((wide, 7)).encode()
    salted = block_keys_for([wide, 7], 2, "s")[0]
    assert salted[8] == 3 and salted.endswith(b"s")
