"""Errors leave the public entry points as themselves, whatever Trio's exception-group
mode: a group with one leaf is unwrapped (keeping the leaf's cause), several stay a group."""

from __future__ import annotations

import pytest
import trio

from cadence.actors import EngineConfig, InvalidRequestError, RequestTooLongError, SamplingParams, open_engine
from cadence.actors.unwrap import sole_error, unwrap_sole_error, unwrapping


def test_one_leaf_comes_out_with_its_own_cause():
    cause = KeyError("k")
    leaf = ValueError("leaf")
    leaf.__cause__ = cause
    with pytest.raises(ValueError) as info, unwrap_sole_error():
        raise BaseExceptionGroup("outer", [ExceptionGroup("inner", [leaf])])
    assert info.value is leaf and info.value.__cause__ is cause
    assert not isinstance(info.value.__context__, BaseExceptionGroup)


def test_several_leaves_stay_a_group():
    group = ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    assert sole_error(group) is group
    with pytest.raises(ExceptionGroup) as info, unwrap_sole_error():
        raise group
    assert info.value is group


async def test_unwrapping_an_async_context_manager_around_nurseries():
    @unwrapping
    def opened():
        return trio.open_nursery()

    async def fail():
        raise InvalidRequestError("from a task")

    with pytest.raises(InvalidRequestError, match="from a task"):
        async with opened() as nursery:
            nursery.start_soon(fail)


async def test_open_engine_raises_the_one_error_from_its_block_and_its_requests():
    config = EngineConfig.from_kwargs(executor="simulated", max_model_len=32)
    with pytest.raises(RequestTooLongError):
        async with open_engine(config) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.submit, "x", SamplingParams(max_tokens=100))
    with pytest.raises(KeyError):
        async with open_engine(config):
            raise KeyError("mine")
