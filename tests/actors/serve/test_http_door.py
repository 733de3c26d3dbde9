"""The HTTP door under slow and abusive clients, and identity from credentials.

Slow clients (a per-peer cap, a head deadline, a minimum body rate, room made for
new peers at the connection limit), bodies that would hold the event loop (a flood
of one-byte chunks, a conversation of 10^5 turns), malformed JSON (too deep, lone
surrogates) answered 400 with one WARNING, API keys that name the tenant (and so
isolate the prefix cache), and the Authorization and /metrics rules. Everything runs
on loopback with the simulated engine in the test's Trio run; other peers are other
loopback addresses (127.0.0.2, ...), which Linux routes to the same listener.
"""

from __future__ import annotations

import json
import logging
import time

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st
import trio
import trio.testing

from cadence.actors.client import open_client
from cadence.actors.serve import http as http_module
from cadence.actors.serve.http import HttpConfig
from cadence.actors.serve.identity import ApiKeys, KeyGrant
from cadence.actors.serve.server import open_server
from cadence.statemachine.config import CacheConfig
from cadence.statemachine.errors import ConfigError

from test_http_wire import _connect, _HttpClient
from test_server_support import SLOW_STEP, WAIT_S, engine_config, server_config, settled, wait_until

BLOCK_SIZE = 16
# Four whole blocks: a second request with this prompt finds 48 of them cached (all
# blocks but the one holding the last prompt token, which is always computed).
PROMPT = list(range(1, 65))
NUM_CACHEABLE = BLOCK_SIZE * ((len(PROMPT) - 1) // BLOCK_SIZE)
KEYS = {"key-alpha": KeyGrant("alpha"), "key-beta": KeyGrant("beta"),
        "key-slow": KeyGrant("gamma", min_priority=5, max_inflight=1)}


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


async def _connect_from(server, source: str) -> _HttpClient:
    return _HttpClient(await trio.open_tcp_stream(*server.http.address, local_address=source))


async def _closed_within(stream: trio.SocketStream, seconds: float) -> bytes:
    """Everything the server sends before it closes `stream`; fails if it stays open."""
    received = b""
    with trio.fail_after(seconds):
        while data := await stream.receive_some(1 << 16):
            received += data
    return received


# ---- slow clients -------------------------------------------------------------------------

async def test_a_peer_past_its_connection_cap_is_refused_at_once_and_others_are_not():
    http = HttpConfig(port=0, max_connections_per_peer=3)
    async with open_server(engine_config(), server_config(), http=http) as server:
        held = [await _connect_from(server, "127.0.0.2") for _ in range(3)]
        await wait_until(lambda: server.http.peer_connections["127.0.0.2"] == 3, what="3 connections")
        extra = await trio.open_tcp_stream(*server.http.address, local_address="127.0.0.2")
        reply = await _closed_within(extra, 5.0)  # answered before it sent anything
        assert reply.startswith(b"HTTP/1.1 429 ")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        other = await _connect(server)
        status, _ = await other.request("GET", "/health")
        assert status == 200
        for client in held:
            await client.stream.aclose()


async def test_a_request_head_trickling_in_is_closed_at_the_head_deadline():
    # The msgpack handshake timeout (the old bound on a whole first request) is long here:
    # only the HTTP head deadline can close the connection in time.
    http = HttpConfig(port=0, head_timeout_s=0.5)
    async with open_server(engine_config(), server_config(handshake_timeout_s=60.0), http=http) as server:
        stream = await trio.open_tcp_stream(*server.http.address)
        start = time.monotonic()
        with pytest.raises((trio.BrokenResourceError, trio.TooSlowError)):
            with trio.fail_after(5.0):
                for byte in b"GET /health HTTP/1.1\r\nhost: x\r\n" * 100:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.02)
        assert time.monotonic() - start < 3.0
        await wait_until(lambda: not server.http.exchanges, what="the slow connection closing")
        assert not server.http.exchanges


async def test_a_body_below_the_minimum_rate_is_closed_and_one_above_it_is_served():
    http = HttpConfig(port=0, head_timeout_s=0.3, min_body_bytes_per_s=200.0)
    async with open_server(engine_config(), server_config(handshake_timeout_s=60.0), http=http) as server:
        body = json.dumps({"prompt": [1, 2], "max_tokens": 1, "user": "x" * 400}).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
        slow = await trio.open_tcp_stream(*server.http.address)
        await slow.send_all(head)
        start = time.monotonic()
        with pytest.raises((trio.BrokenResourceError, trio.TooSlowError)):
            with trio.fail_after(10.0):
                for index in range(len(body)):
                    await slow.send_all(body[index:index + 1])  # ~20 bytes/s, far below 200
                    await trio.sleep(0.05)
        # Closed once the grace and the bytes' allowance are spent (about 0.4 s), not at 10 s.
        assert time.monotonic() - start < 5.0
        steady = await _connect(server)
        status, _ = await steady.request("POST", "/v1/completions", body)
        assert status == 200
        await steady.stream.aclose()
        await settled(server)


async def test_at_the_connection_limit_a_silent_connection_makes_room_for_a_new_peer():
    config = server_config(max_connections=6, handshake_timeout_s=60.0)
    http = HttpConfig(port=0, head_timeout_s=60.0)
    async with open_server(engine_config(), config, http=http) as server:
        silent = [await trio.open_tcp_stream(*server.http.address, local_address=f"127.0.0.{2 + i % 2}")
                  for i in range(6)]
        await wait_until(lambda: len(server.http.exchanges) == 6, what="6 silent connections")
        newcomer = await _connect(server)
        status, body = await newcomer.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert status == 200, body
        assert server.http.num_evicted == 1
        # The kept-alive newcomer has sent a whole request: it is never the one evicted.
        for _ in range(3):
            await (await trio.open_tcp_stream(*server.http.address, local_address="127.0.0.4")).aclose()
        status, _ = await newcomer.request("GET", "/health")
        assert status == 200
        for stream in silent:
            await stream.aclose()
        await newcomer.stream.aclose()
        await settled(server)


async def test_with_no_silent_connection_left_an_idle_kept_alive_one_makes_room():
    config = server_config(max_connections=2)
    async with open_server(engine_config(), config, http=HttpConfig(port=0)) as server:
        first, second = await _connect(server), await _connect_from(server, "127.0.0.2")
        for client in (first, second):
            assert (await client.request("GET", "/health"))[0] == 200
        third = await _connect_from(server, "127.0.0.3")
        assert (await third.request("GET", "/health"))[0] == 200
        assert await _closed_within(first.stream, 5.0) == b""  # the oldest idle one
        assert (await second.request("GET", "/health"))[0] == 200
        for client in (first, second, third):
            await client.stream.aclose()


# ---- bodies that would hold the event loop -------------------------------------------------

async def _max_tick_gap_during(work) -> float:
    """The longest the event loop went without running another task while `work` ran."""
    gaps, done = [0.0], trio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        try:
            await work()
        finally:
            done.set()
    return max(gaps)


async def test_a_body_of_a_hundred_thousand_one_byte_chunks_is_refused_without_holding_the_loop():
    http = HttpConfig(port=0, max_body_bytes=1 << 20)
    async with open_server(engine_config(), server_config(), http=http) as server:
        body = json.dumps({"prompt": "a" * 100_000, "max_tokens": 1}).encode()
        raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n")
        stream = await trio.open_tcp_stream(*server.http.address)
        replies = []

        async def flood():
            replies.append(await _send_reading(stream, raw))

        gap = await _max_tick_gap_during(flood)
        status_line, _, payload = replies[0].partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 400 ")
        assert json.loads(payload.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_chunks_too_small"
        # Parsed whole, the flood held the loop for about a second, each 64 KiB read (some
        # 11,000 chunks) in one turn; the slicing itself is pinned down by the test below.
        assert gap < 0.25, f"the event loop was held {gap:.3f} s"
        # Chunks of a sensible size are served, however many.
        small = json.dumps({"prompt": [1, 2], "max_tokens": 1, "user": "u" * 500_000}).encode()
        chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                   b"transfer-encoding: chunked\r\n\r\n"
                   + b"".join(b"%x\r\n%b\r\n" % (len(small[i:i + 128]), small[i:i + 128])
                              for i in range(0, len(small), 128)) + b"0\r\n\r\n")
        polite = await trio.open_tcp_stream(*server.http.address)
        await polite.send_all(chunked)
        assert (await _closed_within(polite, WAIT_S)).startswith(b"HTTP/1.1 200 ")
        await settled(server)


async def test_events_already_received_are_parsed_a_slice_per_turn():
    """However many events one read brought, a connection hands the loop over every
    _EVENTS_PER_TURN of them (Trio may run the other task twice in a row, so it sees
    fewer distinct counts than there are turns; read whole, it would see one)."""
    left, right = trio.testing.memory_stream_pair()
    exchange = http_module._Exchange(left, "peer")
    num_events = 50 * http_module._EVENTS_PER_TURN
    exchange.conn.receive_data(
        b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + b"1\r\na\r\n" * num_events)
    turns = []

    async def other_task():
        while True:
            turns.append(len(events))
            await trio.sleep(0)

    events = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.sleep(0)
        for _ in range(num_events + 1):
            events.append(await exchange.next_event())
        nursery.cancel_scope.cancel()
    assert sum(isinstance(event, h11.Data) for event in events) == num_events
    assert len(set(turns)) >= 20, "the other task ran only at " + str(sorted(set(turns)))[:200]


async def _send_reading(stream: trio.SocketStream, raw: bytes) -> bytes:
    """Send `raw` while reading what comes back until the server closes (it may answer
    and close before it has read all of it)."""
    async with trio.open_nursery() as nursery:
        async def send():
            try:
                await stream.send_all(raw)
            except trio.BrokenResourceError:
                pass
        nursery.start_soon(send)
        return await _closed_within(stream, WAIT_S)


async def test_a_chat_of_a_hundred_thousand_turns_is_refused_before_it_is_parsed(monkeypatch):
    parsed = []
    monkeypatch.setattr(http_module, "decode_body", lambda body: parsed.append(body) or {})
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 100_000}).encode()
        stream = await trio.open_tcp_stream(*server.http.address)
        reply = await _send_reading(stream, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                            b"content-length: %d\r\n\r\n%b" % (len(body), body))
        assert reply.startswith(b"HTTP/1.1 400 ")
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert error["param"] == "messages" and "8192" in error["message"]
        assert parsed == []
        # Refused after the first quarter megabyte or so: the rest was never buffered.
        assert server.http.peer_read_after["127.0.0.1"] - trio.current_time() < 0.5 * len(body) / (4 << 20)


async def test_a_conversation_over_the_message_limit_spelled_to_dodge_the_count_is_still_refused():
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        turn = '{"\\u0072ole":"user","content":"x"}'  # "role", escaped
        raw = ('{"messages":[' + ",".join([turn] * 8193) + "]}").encode()
        status, body = await client.request("POST", "/v1/chat/completions", raw)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "messages" and "8193 messages" in error["message"]
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]}
        status, body = await client.request("POST", "/v1/chat/completions", parts)
        assert status == 400 and "1025 parts" in json.loads(body)["error"]["message"]
        await client.stream.aclose()


async def test_a_peer_whose_requests_are_refused_waits_for_its_next_and_others_do_not():
    config = server_config(refused_bytes_per_s=1_000_000.0)
    async with open_server(engine_config(), config, http=HttpConfig(port=0)) as server:
        costly = await _connect_from(server, "127.0.0.2")
        status, _ = await costly.request("POST", "/v1/completions", {"prompt": "a", "user": 7, "x": "y" * 1_000_000})
        assert status == 400
        start = time.monotonic()
        neighbour = await _connect(server)
        status, _ = await neighbour.request("GET", "/health")
        assert status == 200 and time.monotonic() - start < 0.5
        again = await _connect_from(server, "127.0.0.2")  # a new connection waits too
        status, _ = await again.request("GET", "/health")
        assert status == 200 and time.monotonic() - start > 0.8
        for client in (costly, neighbour, again):
            await client.stream.aclose()


# ---- malformed JSON ------------------------------------------------------------------------

MALFORMED = [
    ("/v1/completions", b"[" * 3000 + b"]" * 3000, None, "nested deeper"),
    ("/v1/completions", b'{"prompt":"a","stop":' + b"[" * 65 + b"]" * 65 + b"}", "stop", "nested deeper"),
    ("/v1/completions", b'{"prompt":"a\\ud800b","max_tokens":2}', "prompt", "lone UTF-16 surrogate"),
    ("/v1/completions", b'{"prompt":["ok","\\udc00"],"max_tokens":2}', "prompt", "lone UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi \\ud83d"}]}', "messages",
     "lone UTF-16 surrogate"),
]


@pytest.mark.parametrize(("path", "raw", "param", "words"), MALFORMED)
async def test_malformed_json_is_a_400_and_one_warning_and_the_connection_lives_on(
        path, raw, param, words, caplog):
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0)) as server:
        client = await _connect(server)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            status, body = await client.request("POST", path, raw)
        error = json.loads(body)["error"]
        assert status == 400 and words in error["message"] and error["param"] == param
        assert error["type"] == "invalid_request_error"
        records = [r for r in caplog.records if r.name.startswith("cadence") and r.levelno >= logging.WARNING]
        assert len(records) == 1 and records[0].levelno == logging.WARNING and not records[0].exc_info
        # A surrogate pair (an emoji, as json.dumps escapes it) is valid and served.
        status, body = await client.request("POST", "/v1/completions",
                                            b'{"prompt":"hi \\ud83d\\ude00","max_tokens":2}')
        assert status == 200, body
        await client.stream.aclose()
        await settled(server)


# ---- identity from credentials -------------------------------------------------------------

def test_an_api_key_file_parses_and_names_its_mistakes(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant options\nk1 acme min_priority=2 max_inflight=16\n\nk2 beta  # note\n")
    keys = ApiKeys.from_file(str(path))
    assert keys.grant_of("k1") == KeyGrant("acme", min_priority=2, max_inflight=16)
    assert keys.grant_of("k2") == KeyGrant("beta")
    assert keys.grant_of("k3") is None and keys.grant_of(None) is None and len(keys) == 2
    for text, words in [("k1\n", "line 1: expected"), ("k1 a\nk1 b\n", "line 2: this key is listed twice"),
                        ("k1 a colour=red\n", "unknown option 'colour=red'"),
                        ("k1 a max_inflight=0\n", "max_inflight must be >= 1"),
                        ("k1 a min_priority=x\n", "min_priority must be an integer"), ("# none\n", "no API key"),
                        ("k\u00e9y a\n", "as a Bearer token is")]:
        with pytest.raises(ConfigError, match=words):
            ApiKeys.parse(text, "keys")


def test_a_grant_only_narrows_the_tenant_and_raises_the_priority_to_its_ceiling():
    grant = KeyGrant("acme", min_priority=3)
    assert grant.tenant_of(None) == grant.tenant_of("default") == grant.tenant_of("acme") == "acme"
    assert grant.tenant_of("acme/alice") == "acme/alice"
    for other in ("beta", "acmex", "acme-corp", "/acme"):
        with pytest.raises(Exception, match="not this API key's tenant"):
            grant.tenant_of(other)
    assert grant.priority_of(0) == 3 and grant.priority_of(7) == 7
    assert KeyGrant("x").priority_of(-5) == -5


def test_the_block_salt_separates_tenants_and_salts_within_a_tenant():
    cache = CacheConfig(block_size=BLOCK_SIZE, prefix_cache_sharing="tenant")
    salts = {cache.block_salt(tenant, salt) for tenant in ("a", "b") for salt in (None, "x", "y")}
    assert len(salts) == 6
    assert cache.block_salt("a", "x") == cache.block_salt("a", "x")
    shared = CacheConfig(block_size=BLOCK_SIZE, prefix_cache_sharing="global")
    assert shared.block_salt("a", "x") == shared.block_salt("b", "x") != shared.block_salt("a", "y")


def _keyed_server(**kwargs):
    engine = engine_config(block_size=BLOCK_SIZE, enable_prefix_caching=True, **kwargs.pop("engine", {}))
    config = server_config(api_keys=ApiKeys.from_grants(KEYS), **kwargs)
    return open_server(engine, config, http=HttpConfig(port=0))


async def _cached(client: _HttpClient, key: str, **fields) -> int:
    status, body = await client.request("POST", "/v1/completions",
                                        {"prompt": PROMPT, "max_tokens": 1, **fields}, headers=_bearer(key))
    assert status == 200, body
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_the_prefix_cache_isolates_keys_whatever_tenant_they_name_and_salts_within_a_key():
    async with _keyed_server() as server:
        client = await _connect(server)
        assert await _cached(client, "key-alpha") == 0
        # Another key naming alpha's tenant is refused; naming none, it is its own tenant.
        status, body = await client.request("POST", "/v1/completions",
                                            {"prompt": PROMPT, "max_tokens": 1, "tenant": "alpha"},
                                            headers=_bearer("key-beta"))
        error = json.loads(body)["error"]
        assert status == 403 and error["param"] == "tenant" and error["type"] == "permission_error"
        assert await _cached(client, "key-beta") == 0
        assert await _cached(client, "key-beta", tenant="beta") == NUM_CACHEABLE
        assert await _cached(client, "key-alpha") == NUM_CACHEABLE
        # Within one key, a cache salt keeps its requests apart from the unsalted and other salts.
        assert await _cached(client, "key-alpha", cache_salt="s1") == 0
        assert await _cached(client, "key-alpha", cache_salt="s2") == 0
        assert await _cached(client, "key-alpha", cache_salt="s1") == NUM_CACHEABLE
        # A sub-tenant narrows further: it is a tenant of its own.
        assert await _cached(client, "key-alpha", tenant="alpha/team") == 0
        await client.stream.aclose()
        await settled(server)


async def test_msgpack_tokens_map_to_the_same_identities():
    async with _keyed_server() as server:
        client = await _connect(server)
        assert await _cached(client, "key-alpha") == 0
        async with open_client(server.tcp_address, token="key-beta") as beta:
            with pytest.raises(Exception, match="not this API key's tenant"):
                await (await beta.generate(PROMPT, max_tokens=1, tenant="alpha")).collect()
            assert (await (await beta.generate(PROMPT, max_tokens=1)).collect()).num_cached_tokens == 0
        async with open_client(server.tcp_address, token="key-alpha") as alpha:
            done = await (await alpha.generate(PROMPT, max_tokens=1)).collect()
            assert done.num_cached_tokens == NUM_CACHEABLE
        with pytest.raises(Exception, match="token"):
            async with open_client(server.tcp_address, token="key-nobody") as nobody:
                await (await nobody.generate(PROMPT, max_tokens=1)).collect()
        await client.stream.aclose()
        await settled(server)


async def test_a_key_caps_its_priority_and_its_live_streams_over_both_protocols():
    async with _keyed_server(engine={"latency": SLOW_STEP}) as server:
        async with open_client(server.tcp_address, token="key-slow") as slow:
            stream = await slow.generate([1, 2], max_tokens=1000, ignore_eos=True, priority=-10)
            await wait_until(lambda: len(server.engine.core.requests) == 1, what="the stream starting")
            (request,) = server.engine.core.requests.values()
            assert request.tenant == "gamma" and request.priority == 5
            client = await _connect(server)
            status, body = await client.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                                headers=_bearer("key-slow"))
            error = json.loads(body)["error"]
            assert status == 429 and "max_inflight is 1" in error["message"]
            # Another key is not held back by it.
            status, _ = await client.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                             headers=_bearer("key-alpha"))
            assert status == 200
            await stream.abort()
            await client.stream.aclose()
        await settled(server)
        assert not server.key_inflight


# ---- Authorization and /metrics ------------------------------------------------------------

BAD_AUTHORIZATION = [
    [("authorization", "Bearer wrong"), ("authorization", "Bearer secret")],
    [("authorization", "Bearer secret"), ("authorization", "Bearer secret")],
    [("authorization", "Bearer  secret")], [("authorization", "Bearer secret extra")],
    [("authorization", "Basic secret")], [("authorization", "Bearer")], [("authorization", "secret")],
    [("authorization", "Bearer secr\tet")],
]


@pytest.mark.parametrize("headers", BAD_AUTHORIZATION)
async def test_duplicate_or_malformed_authorization_is_refused(headers):
    async with open_server(engine_config(), server_config(), http=HttpConfig(port=0, api_key="secret")) as server:
        client = await _connect(server)
        status, body = await client.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                            headers=headers)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _ = await client.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                         headers=[("authorization", "bearer secret")])
        assert status == 200
        await client.stream.aclose()
        await settled(server)


@pytest.mark.parametrize("public", [False, True])
async def test_metrics_need_the_key_unless_public(public):
    http = HttpConfig(port=0, api_key="secret", metrics_public=public)
    async with open_server(engine_config(), server_config(), http=http) as server:
        client = await _connect(server)
        status, body = await client.request("GET", "/metrics")
        assert status == (200 if public else 401)
        status, body = await client.request("GET", "/metrics", headers=_bearer("secret"))
        assert status == 200 and b"cadence_" in body
        status, _ = await client.request("GET", "/health")
        assert status == 200
        await client.stream.aclose()


def test_serve_options_for_keys_and_the_door(tmp_path):
    from cadence.actors.serve.http import http_config_from_args
    from cadence.actors.serve.server import add_serve_parser, server_config_from_args
    import argparse

    keys = tmp_path / "keys"
    keys.write_text("k1 acme\n")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-keys", str(keys), "--metrics-public",
                              "--max-connections-per-peer", "9", "--head-timeout-s", "2",
                              "--min-body-bytes-per-s", "100"])
    assert server_config_from_args(args).api_keys.grant_of("k1") == KeyGrant("acme")
    http = http_config_from_args(args)
    assert (http.metrics_public, http.max_connections_per_peer, http.head_timeout_s,
            http.min_body_bytes_per_s, http.api_key) == (True, 9, 2.0, 100.0, None)
    assert http_config_from_args(parser.parse_args(["serve", "--max-connections-per-peer", "0"])
                                 ).max_connections_per_peer is None
    both = parser.parse_args(["serve", "--api-keys", str(keys), "--api-key", "x"])
    with pytest.raises(ConfigError, match="not both"):
        http_config_from_args(both)


_JSON_TEXT = st.text(alphabet=st.sampled_from(["a", "\ud800", "\udc00", "é"]), max_size=3)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _JSON_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_JSON_TEXT, inner, max_size=4),
    max_leaves=20)


@given(_JSON_VALUES, st.integers(0, 70), st.sampled_from(["list", "dict"]))
def test_decode_body_decides_as_the_entry_by_entry_walk(value, depth, wrap):
    """Bodies drawn with lone surrogates, flat and mixed containers, and nesting past
    MAX_JSON_DEPTH: the same payload, or the same refusal (message and param), as
    walking every entry (decode_body's own walk with its fast path off)."""
    from cadence.actors.serve.http import ApiError, decode_body

    for _ in range(depth):
        value = [value] if wrap == "list" else {"k": value}
    body = json.dumps({"prompt": value}).encode()
    try:
        want = ("ok", decode_body(body, walk_every_entry=True))
    except ApiError as exc:
        want = ("refused", exc.message, exc.param)
    try:
        got = ("ok", decode_body(body))
    except ApiError as exc:
        got = ("refused", exc.message, exc.param)
    assert got == want
