"""A cache-aware router: several engine replicas behind one address.

    async with open_router(RouterConfig(replicas=("127.0.0.1:8471", "unix:/tmp/b.sock"))) as router:
        print(router.tcp_address)

The router speaks the client protocol of PROTOCOL.md on both sides. Clients
connect to it as to a server (Hello, Generate, Abort, Stats, Health); it keeps
one client connection (`open_client`) to each replica and forwards every
request to one of them, relaying the replica's frames back on the client's own
stream id.

Placement is a `PlacementPolicy`. The default, `PrefixAffinityPolicy`, keeps
for each replica a bounded LRU `PrefixIndex` of the chained block hashes of the
prompts sent there (the same chaining as the core's prefix cache, so two
prompts share index entries exactly as far as they share whole KV blocks) and
sends a request where the longest prefix of its blocks is indexed; with no
match, to the replica with the least outstanding work. `RoundRobinPolicy` is
the baseline it is measured against.

Each replica takes at most `max_inflight_per_replica` requests at once. When
every healthy replica is full, requests wait in the router's `AdmissionQueue`,
which releases them by priority (lower first), then per-tenant round robin
within a priority, then arrival: the engine's priority and fairness rules,
applied before the replicas see the requests.

A replica that refuses connections, closes its connection, or fails a health
check within `health_timeout_s` leaves the rotation and is reconnected every
`reconnect_interval_s`; it rejoins only once it has answered "ok" for
`rejoin_after_s`, so a replica that keeps failing stays out. Its requests that had sent nothing to the client yet
are placed again elsewhere (at most `max_retries` times); those that had
streamed output end with an `executor_error` Error frame saying the replica
was lost.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Protocol, Sequence, Union, runtime_checkable

import attrs
import trio

from cadence.statemachine.config import PREFIX_CACHE_SHARING, CacheConfig
from cadence.statemachine.errors import ConfigError

from ..client import AsyncClient, AsyncStream, open_client, parse_address
from ..unwrap import unwrapping
from ..validation import REQUEST_LIMIT_NAMES, RequestLimits
from ..wire import (
    Accepted, ClientTimeoutError, ConnectionClosedError, Error,
    ErrorCode, Generate, HealthReply, Output, ServerError, StatsReply, Welcome, encode, pack_frame,
)
from .connection import (
    Connection, ConnectionConfig, Front, StreamState, bare_errors, port_number, positive,
)

__all__ = [
    "DEFAULT_ROUTER_PORT",
    "RouterConfig",
    "RoutedRequest",
    "Replica",
    "PrefixIndex",
    "PlacementPolicy",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "LeastLoadedPolicy",
    "POLICIES",
    "make_policy",
    "AdmissionQueue",
    "prompt_block_keys",
    "Router",
    "open_router",
]

_log = logging.getLogger("cadence.router")

DEFAULT_ROUTER_PORT = 8480
ROUTER_NAME = "cadence-router/0.1"
# Text prompts hashed without a tokenizer: bytes per index block are the block
# size times this, a typical bytes-per-token ratio, so a text block covers
# roughly what one KV block holds.
TEXT_BYTES_PER_TOKEN = 4
# Error codes after which a request that has produced no output is placed
# again: the replica could not take it, through no fault of the request (an
# Error flagged `poison` says the request was the fault, and is never retried).
_RETRY_CODES = frozenset({
    ErrorCode.QUEUE_FULL.value, ErrorCode.ENGINE_CLOSED.value, ErrorCode.SHUTDOWN.value,
    ErrorCode.EXECUTOR_ERROR.value,
})
# Codes that mean the replica as a whole is unusable, not just busy.
_REPLICA_DOWN_CODES = frozenset({ErrorCode.ENGINE_CLOSED.value, ErrorCode.SHUTDOWN.value})
# Stats keys that are ratios or gauges, not counters: never summed across replicas.
_AVERAGED_STATS = frozenset({"avg_batch_size", "kv_usage", "avg_wait_s", "prefix_hit_rate",
                             "tokens_per_s", "requests_per_s", "elapsed_s"})
# Stats queries one connection may have in flight at once (each asks every replica).
_STATS_QUERIES_PER_CONNECTION = 4
# Admissions remembered in `Router.recent_admissions`.
_ADMISSION_LOG = 1024

Address = Union[str, tuple]


def _non_negative(instance, attribute, value) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


def _sharing(instance, attribute, value) -> None:
    if value not in PREFIX_CACHE_SHARING:
        raise ConfigError(f"{attribute.name} must be one of {', '.join(PREFIX_CACHE_SHARING)}, "
                          f"got {value!r}")


def _addresses(value) -> tuple:
    """One address or several, as a tuple of addresses (each checked)."""
    single = isinstance(value, str) or (
        isinstance(value, tuple) and len(value) == 2 and type(value[1]) is int)
    out = (value,) if single else tuple(value)
    for address in out:
        parse_address(address)  # raises ConfigError for a malformed one
    return out


# ---------------------------------------------------------------------------
# Configuration.


@attrs.frozen
class RouterConfig(ConnectionConfig):
    """What the router forwards to, where it listens, and how it places requests:
    the client-side connection limits of `ConnectionConfig` (keyword-only, with the
    server's meaning; no idle timeout by default), and

    replicas: the replicas' addresses ("host:port", (host, port), "unix:/path").
    port: where clients connect (default DEFAULT_ROUTER_PORT; 0: any free port; None: no TCP).
    replica_token: the token the router presents to the replicas.
    policy: "prefix" (longest cached prefix, then least loaded), "least_loaded",
      "round_robin", or a PlacementPolicy instance.
    max_inflight_per_replica: requests forwarded to one replica at once; beyond
      it requests wait in the router's global queue.
    max_queued: requests waiting in that queue before new ones get `queue_full`.
    block_size: tokens per index block (None: the replicas' KV block size).
    index_blocks_per_replica: LRU bound of each replica's prefix index.
    tokenizer: encodes text prompts for the index (None: hash UTF-8 bytes).
    prefix_cache_sharing: the replicas' setting ("tenant" or "global"), so the
      index shares blocks exactly where the replicas' caches do.
    health_interval_s, health_timeout_s: how often each replica is asked for
      its health, and how long it has to answer before it leaves the rotation.
    reconnect_interval_s: pause between attempts to reach a lost replica.
    rejoin_after_s: a replica that left the rotation rejoins only after
      answering every health check "ok" for this long (no flapping).
    replica_timeout_s: longest wait for any single frame of a forwarded stream.
    start_timeout_s: `open_router` waits this long for the replicas to answer.
    max_retries: placements after the first for a request whose replica was
      lost before it produced output.
    """

    kind = "router"

    replicas: tuple = attrs.field(converter=_addresses)
    port: int | None = attrs.field(default=DEFAULT_ROUTER_PORT, validator=port_number, kw_only=True)
    replica_token: str | None = attrs.field(default=None, repr=False, kw_only=True)
    policy: Any = attrs.field(default="prefix", kw_only=True)
    max_inflight_per_replica: int = attrs.field(default=64, validator=positive, kw_only=True)
    max_queued: int = attrs.field(default=4096, validator=positive, kw_only=True)
    block_size: int | None = attrs.field(default=None, validator=positive, kw_only=True)
    index_blocks_per_replica: int = attrs.field(default=1 << 16, validator=positive, kw_only=True)
    tokenizer: Any = attrs.field(default=None, kw_only=True)
    prefix_cache_sharing: str = attrs.field(default="tenant", validator=_sharing, kw_only=True)
    health_interval_s: float = attrs.field(default=1.0, validator=positive, kw_only=True)
    health_timeout_s: float = attrs.field(default=2.0, validator=positive, kw_only=True)
    reconnect_interval_s: float = attrs.field(default=1.0, validator=positive, kw_only=True)
    rejoin_after_s: float = attrs.field(default=5.0, validator=_non_negative, kw_only=True)
    replica_timeout_s: float = attrs.field(default=600.0, validator=positive, kw_only=True)
    start_timeout_s: float = attrs.field(default=10.0, validator=positive, kw_only=True)
    max_retries: int = attrs.field(default=2, validator=_non_negative, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("the router needs at least one replica address")
        super().__attrs_post_init__()
        make_policy(self.policy)  # fails here, where the config is made

    def limits(self) -> dict[str, int | float | None]:
        """The limits a client is told about in Welcome."""
        return {**super().limits(), "max_inflight_per_tenant": None,
                "max_inflight_per_replica": self.max_inflight_per_replica,
                "max_queued": self.max_queued}


# ---------------------------------------------------------------------------
# The prefix index.


def prompt_block_keys(prompt: str | Sequence[int], block_size: int, salt: str | None = None,
                      tokenizer: Any = None) -> list[int]:
    """Chained hashes of the prompt's whole blocks: key k covers blocks 0..k.

    Token prompts (or text with a tokenizer) hash `block_size` token ids per
    block; text without a tokenizer hashes `block_size * TEXT_BYTES_PER_TOKEN`
    UTF-8 bytes per block. The salt enters every key, as in the core, so
    requests with different salts never look alike.
    """
    if isinstance(prompt, str):
        if tokenizer is not None:
            units: Sequence = tokenizer.encode(prompt)
        else:
            units = prompt.encode("utf-8")
            block_size *= TEXT_BYTES_PER_TOKEN
    else:
        units = prompt
    keys: list[int] = []
    parent = hash(("cadence-router", salt, isinstance(units, bytes)))
    for start in range(0, len(units) - block_size + 1, block_size):
        parent = hash((parent, tuple(units[start:start + block_size])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """A bounded LRU set of block keys: which prompt blocks a replica has seen lately."""

    __slots__ = ("capacity", "_keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` are indexed (the chaining makes a
        later hit without the earlier ones meaningless, so the count stops at the first miss)."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def add(self, keys: Sequence[int]) -> None:
        """Index (or refresh) `keys`, evicting the least recently used beyond capacity."""
        index = self._keys
        for key in keys:
            if key in index:
                index.move_to_end(key)
            else:
                index[key] = None
        while len(index) > self.capacity:
            index.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the replica restarted, its cache is gone)."""
        self._keys.clear()


# ---------------------------------------------------------------------------
# Requests, replicas and placement.


@attrs.define(eq=False)
class RoutedRequest:
    """One client request as the router sees it: the message, its block keys,
    the work it represents (prompt plus max_tokens) and its arrival order."""

    message: Generate
    keys: list[int]
    num_tokens: int
    seq: int
    replica: Replica | None = None
    placed: trio.Event = attrs.Factory(trio.Event)

    @property
    def priority(self) -> int:
        """The client's priority (lower first)."""
        return self.message.priority

    @property
    def tenant(self) -> str:
        """Who the request is accounted to."""
        return self.message.tenant


@attrs.define(eq=False)
class Replica:
    """One replica: its connection, whether it is in rotation, its load, its index."""

    position: int
    address: Address
    index: PrefixIndex
    client: AsyncClient | None = None
    welcome: Welcome | None = None
    healthy: bool = False
    num_inflight: int = 0
    num_inflight_tokens: int = 0
    last_health: HealthReply | None = None
    num_failures: int = 0
    last_state: str = ""
    down: trio.Event = attrs.Factory(trio.Event)

    @property
    def name(self) -> str:
        """A short name for request ids and logs: r0, r1, ..."""
        return f"r{self.position}"

    @property
    def load(self) -> tuple[int, int]:
        """Outstanding work: in-flight requests, then their tokens."""
        return self.num_inflight, self.num_inflight_tokens


@runtime_checkable
class PlacementPolicy(Protocol):
    """Chooses the replica for a request among those with room (never empty,
    sorted by position). Users may plug in their own."""

    name: str

    def choose(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Replica:
        """The replica `request` goes to."""


class LeastLoadedPolicy:
    """The replica with the fewest in-flight requests (then tokens, then position)."""

    name = "least_loaded"

    def choose(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Replica:
        """The least loaded replica."""
        return min(replicas, key=lambda r: (r.load, r.position))


class PrefixAffinityPolicy:
    """The replica whose index holds the longest prefix of the request's blocks;
    ties, and requests with no match anywhere, go to the least loaded."""

    name = "prefix"

    def choose(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Replica:
        """The longest-prefix replica, least loaded among equals."""
        keys = request.keys
        return min(replicas, key=lambda r: (-r.index.match(keys), r.load, r.position))


class RoundRobinPolicy:
    """Each replica in turn, skipping those without room; ignores the cache."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Replica:
        """The next replica in turn."""
        later = [r for r in replicas if r.position >= self._next]
        chosen = later[0] if later else replicas[0]
        self._next = chosen.position + 1
        return chosen


POLICIES = {cls.name: cls for cls in (PrefixAffinityPolicy, LeastLoadedPolicy, RoundRobinPolicy)}


def make_policy(policy: str | PlacementPolicy) -> PlacementPolicy:
    """A policy from its name, or the instance itself."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ConfigError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        return POLICIES[policy]()
    if not isinstance(policy, PlacementPolicy):
        raise ConfigError(f"router policy must be a name or have choose(request, replicas), "
                          f"got {type(policy).__name__}")
    return policy


def _seq(item) -> int:
    return item.seq


class AdmissionQueue:
    """The router's global waiting queue, sans-IO.

    `pop` takes the lowest priority value first; within a priority, tenants
    take turns (round robin in the order they started waiting) and each
    tenant's requests leave in arrival order.
    """

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[str, deque]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item) -> None:
        """Queue an item with `.priority`, `.tenant` and `.seq` (its arrival order)."""
        level = self._levels.setdefault(item.priority, OrderedDict())
        items = level.setdefault(item.tenant, deque())
        if items and items[-1].seq > item.seq:
            # Tasks may reach the queue out of order; arrival (seq) decides.
            items.insert(bisect.bisect_right(items, item.seq, key=_seq), item)
        else:
            items.append(item)
        self._size += 1

    def pop(self):
        """The next item to admit; IndexError when empty."""
        if not self._size:
            raise IndexError("pop from an empty AdmissionQueue")
        priority = min(self._levels)
        level = self._levels[priority]
        tenant, items = next(iter(level.items()))
        item = items.popleft()
        if items:
            level.move_to_end(tenant)
        else:
            del level[tenant]
            if not level:
                del self._levels[priority]
        self._size -= 1
        return item

    def remove(self, item) -> bool:
        """Take `item` out wherever it waits; False if it is not queued."""
        level = self._levels.get(item.priority)
        items = level.get(item.tenant) if level is not None else None
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del level[item.tenant]
            if not level:
                del self._levels[item.priority]
        self._size -= 1
        return True


# ---------------------------------------------------------------------------
# The router.


class _Refused(Exception):
    """Ends a client stream with this Error frame."""

    def __init__(self, frame: Error) -> None:
        super().__init__(frame.message)
        self.frame = frame


class _Retry(Exception):
    """The replica could not serve a request that has produced no output: place it again.
    `code` is the Error code to end the request with if no attempt is left."""

    def __init__(self, reason: str, code: str = ErrorCode.EXECUTOR_ERROR.value) -> None:
        super().__init__(reason)
        self.code = code


class Router(Front):
    """Serves many clients from several replicas; see the module docstring.

    Run it with `nursery.start(router.serve)` (returns once it listens and the
    replicas have answered); `shutdown()` closes every connection and returns.
    """

    kind = "router"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.policy = make_policy(config.policy)
        self._cache = CacheConfig(prefix_cache_sharing=config.prefix_cache_sharing)
        self.replicas = [Replica(i, address, PrefixIndex(config.index_blocks_per_replica))
                         for i, address in enumerate(config.replicas)]
        self.queue = AdmissionQueue()
        self.welcome: Welcome | None = None
        self.num_inflight = 0
        self.num_retries = 0
        self.num_replica_failures = 0
        self.recent_admissions: deque[tuple[int, str, int]] = deque(maxlen=_ADMISSION_LOG)
        self._num_requests = 0
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._replica_up = trio.Event()

    # ---- lifecycle ---------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the replicas, listen, and serve until `shutdown()`. Raises
        ConnectionClosedError (a bare one, not in a group) if no replica answers."""
        listeners = await self.open_listeners()
        answered = True
        try:
            async with trio.open_nursery() as nursery:
                for replica in self.replicas:
                    nursery.start_soon(self._supervise, replica)
                answered = await self._wait_for_replicas()
                if answered:
                    nursery.start_soon(self.accept, listeners, nursery)
                    nursery.start_soon(self.watch_sends)
                    task_status.started(self)
                    await self._serve_until_stopped()
                nursery.cancel_scope.cancel()
        finally:
            await self.close_listeners(listeners)
            self._stopped.set()
        if not answered:
            raise ConnectionClosedError(f"no replica answered within {self.config.start_timeout_s} s: "
                                        f"{', '.join(map(str, self.config.replicas))}")

    async def _serve_until_stopped(self) -> None:
        await self._stop.wait()
        self.draining = True
        self.stop_accepting()
        for conn in list(self.connections.values()):
            conn.close(Error(ErrorCode.SHUTDOWN.value, "the router is shutting down", fatal=True),
                       "shutdown")
        with trio.move_on_after(self.config.handshake_timeout_s):
            await self.wait_connections_gone()

    def shutdown(self) -> None:
        """Close every client connection (live streams get a fatal `shutdown`) and stop."""
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Wait until `serve` has returned."""
        await self._stopped.wait()

    async def _wait_for_replicas(self) -> bool:
        """Whether some replica answered within start_timeout_s (all of them: sooner)."""
        with trio.move_on_after(self.config.start_timeout_s):
            while not all(r.welcome is not None for r in self.replicas):
                self._replica_up = trio.Event()
                await self._replica_up.wait()
        return self.welcome is not None

    def make_connection(self, stream: trio.SocketStream, conn_id: int) -> _RouterConnection:
        """A connection whose requests go to the replicas."""
        return _RouterConnection(self, stream, conn_id)

    def stream_finished(self, state: _RouterStream) -> None:
        """A client stream ended."""
        self.num_inflight -= 1

    # ---- replicas ----------------------------------------------------------------
    async def _supervise(self, replica: Replica) -> None:
        """Keep a connection to one replica, checking its health; reconnect after losing it."""
        config = self.config
        while True:
            replica.down = trio.Event()
            try:
                # Connecting and the handshake get the health timeout; a replica
                # that accepts connections but never answers counts as down.
                with trio.CancelScope(deadline=trio.current_time() + config.health_timeout_s) as scope:
                    async with open_client(replica.address, token=config.replica_token,
                                           timeout_s=config.replica_timeout_s,
                                           client_name=ROUTER_NAME) as client:
                        scope.deadline = math.inf
                        if await self._on_probation(replica, client):
                            self._replica_connected(replica, client)
                            await self._watch_health(replica, client)
                if scope.cancelled_caught:
                    _log.info("replica %s (%s): no handshake within %s s", replica.name,
                              replica.address, config.health_timeout_s)
            except (ConnectionClosedError, ClientTimeoutError, ServerError, OSError) as exc:
                self._log_state(replica, f"unavailable: {exc}")
            self.replica_failed(replica)
            await trio.sleep(config.reconnect_interval_s)

    async def _on_probation(self, replica: Replica, client: AsyncClient) -> bool:
        """Whether a newly connected replica may join the rotation: it must answer
        "ok" to its first health check, and one that has left the rotation before
        must go on answering "ok" for rejoin_after_s, so a replica that keeps
        failing stays out instead of flapping in and out."""
        config = self.config
        until = trio.current_time() + (config.rejoin_after_s if replica.num_failures else 0.0)
        while True:
            reply = None
            with trio.move_on_after(config.health_timeout_s):
                reply = await client.health()
            if reply is None or reply.status != "ok":
                self._log_state(replica, "no health reply" if reply is None else reply.status)
                return False
            replica.last_health = reply
            if trio.current_time() >= until:
                return True
            await trio.sleep(min(config.health_interval_s, max(0.0, until - trio.current_time())))

    def _log_state(self, replica: Replica, state: str) -> None:
        """Log why a replica is out of rotation, once per change of reason."""
        if replica.last_state != state:
            replica.last_state = state
            _log.info("replica %s (%s) out of rotation: %s", replica.name, replica.address, state)

    def _replica_connected(self, replica: Replica, client: AsyncClient) -> None:
        replica.client, replica.welcome, replica.healthy = client, client.welcome, True
        replica.index.clear()
        if self.welcome is None:
            self._set_welcome(client.welcome)
        replica.last_state = "ok"
        _log.info("replica %s (%s) in rotation", replica.name, replica.address)
        self._replica_up.set()
        self._dispatch()

    async def _watch_health(self, replica: Replica, client: AsyncClient) -> None:
        config = self.config
        while True:
            reply = None
            with trio.move_on_after(config.health_timeout_s):
                reply = await client.health()
            if reply is None:
                self._log_state(replica, f"no health reply within {config.health_timeout_s} s")
                return
            if reply.status != "ok":
                self._log_state(replica, reply.status)
                return
            replica.last_health = reply
            if not replica.healthy:
                return  # a stream saw it fail: reconnect
            with trio.move_on_after(config.health_interval_s):
                await replica.down.wait()
                return

    def replica_failed(self, replica: Replica, client: AsyncClient | None = None) -> None:
        """Take a replica out of rotation (its supervisor reconnects later). With
        `client`, only if that is still the replica's connection: a failure seen
        on an old connection says nothing about a new one."""
        if client is not None and replica.client is not client:
            return
        if replica.healthy:
            self.num_replica_failures += 1
            replica.num_failures += 1
        replica.healthy = False
        replica.client = None
        replica.index.clear()
        replica.down.set()

    def _set_welcome(self, welcome: Welcome) -> None:
        block_size = self.config.block_size or welcome.block_size
        self.block_size = block_size
        # The replicas' request limits (checked here too, see RequestLimits.from_welcome), then the router's own.
        request_limits = {name: welcome.limits[name] for name in REQUEST_LIMIT_NAMES if name in welcome.limits}
        self.welcome = attrs.evolve(welcome, server=ROUTER_NAME,
                                    limits={**request_limits, **self.config.limits()})
        self.welcome_frame = pack_frame(encode(self.welcome))

    # ---- placement ---------------------------------------------------------------
    async def make_request(self, message: Generate) -> RoutedRequest:
        """The routed form of a Generate: block keys (hashed in a worker thread for a
        long prompt) and outstanding-work estimate."""
        salt = self._cache.block_salt(message.tenant, message.cache_salt)
        prompt = message.prompt
        keys = await self.run_sized(len(prompt), prompt_block_keys, prompt, self.block_size, salt,
                                    self.config.tokenizer)
        num_prompt = len(prompt) if not isinstance(prompt, str) else len(prompt) // TEXT_BYTES_PER_TOKEN
        self._num_requests += 1
        return RoutedRequest(message, keys, num_prompt + message.params.max_tokens, self._num_requests)

    def _available(self) -> list[Replica]:
        cap = self.config.max_inflight_per_replica
        return [r for r in self.replicas if r.healthy and r.num_inflight < cap]

    def _place(self, request: RoutedRequest, candidates: list[Replica]) -> None:
        replica = self.policy.choose(request, candidates)
        replica.num_inflight += 1
        replica.num_inflight_tokens += request.num_tokens
        replica.index.add(request.keys)
        request.replica = replica
        self.recent_admissions.append((request.seq, replica.name, request.priority))
        request.placed.set()

    def _dispatch(self) -> None:
        """Admit queued requests while some replica has room."""
        while len(self.queue):
            candidates = self._available()
            if not candidates:
                return
            self._place(self.queue.pop(), candidates)

    def submit(self, request: RoutedRequest) -> None:
        """Place `request` on a replica now, or queue it while every replica is full.

        Synchronous, so requests are placed or queued in the order their frames
        arrived; raises _Refused when no replica is up or the queue is full."""
        request.replica, request.placed = None, trio.Event()
        if not any(r.healthy for r in self.replicas):
            raise _Refused(Error(ErrorCode.ENGINE_CLOSED.value, "no replica is available",
                                 stream=request.message.stream))
        candidates = self._available()
        if not len(self.queue) and candidates:
            self._place(request, candidates)
            return
        if len(self.queue) >= self.config.max_queued:
            raise _Refused(Error(ErrorCode.QUEUE_FULL.value,
                                 f"the router's queue already holds {len(self.queue)} requests",
                                 stream=request.message.stream, limit="max_queued"))
        self.queue.push(request)

    async def wait_placed(self, request: RoutedRequest) -> Replica:
        """The replica a submitted request was placed on, once it has one."""
        await request.placed.wait()
        return request.replica

    def withdraw(self, request: RoutedRequest) -> None:
        """The request is over: leave the queue, or free its replica's place."""
        if request.replica is not None:
            self.release(request)
        else:
            self.queue.remove(request)

    def release(self, request: RoutedRequest) -> None:
        """The request no longer occupies its replica; admit the next in line."""
        replica = request.replica
        if replica is None:
            return
        request.replica = None
        replica.num_inflight -= 1
        replica.num_inflight_tokens -= request.num_tokens
        self._dispatch()

    # ---- stats and health --------------------------------------------------------
    async def stats(self, ref: int) -> StatsReply:
        """Every replica's counters summed, plus the router's own and a per-replica list."""
        per_replica: list[dict[str, Any]] = [{} for _ in self.replicas]

        async def fetch(replica: Replica) -> None:
            client = replica.client
            if client is None:
                return
            with trio.move_on_after(self.config.health_timeout_s):
                try:
                    per_replica[replica.position] = await client.stats()
                except (ConnectionClosedError, ClientTimeoutError, ServerError):
                    pass

        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                nursery.start_soon(fetch, replica)
        total = _sum_stats([s for s in per_replica if s])
        total.update(
            num_connections=len(self.connections), num_inflight_streams=self.num_inflight,
            num_queued=len(self.queue), num_retries=self.num_retries,
            num_replica_failures=self.num_replica_failures,
            num_replicas_healthy=sum(r.healthy for r in self.replicas),
            replicas=[{"name": r.name, "address": str(r.address), "healthy": r.healthy,
                       "num_inflight": r.num_inflight, "num_index_blocks": len(r.index),
                       "stats": per_replica[r.position]} for r in self.replicas])
        return StatsReply(ref=ref, stats=total)

    def health(self, ref: int) -> HealthReply:
        """"ok" while some replica is in rotation, else "closed"; gauges summed over replicas."""
        live = [r for r in self.replicas if r.healthy]
        status = "closed" if not live else "draining" if self._stop.is_set() else "ok"
        replies = [r.last_health for r in live if r.last_health is not None]
        return HealthReply(
            ref=ref, status=status, num_running=sum(h.num_running for h in replies),
            num_waiting=sum(h.num_waiting for h in replies) + len(self.queue),
            kv_usage=sum(h.kv_usage for h in replies) / len(replies) if replies else 0.0,
            num_connections=len(self.connections))


def _sum_stats(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed; maps of counters summed key by key; rates recomputed."""
    out: dict[str, Any] = {}
    for stats in all_stats:
        for key, value in stats.items():
            if key in _AVERAGED_STATS or type(value) not in (int, float, dict):
                continue
            if type(value) is dict:
                merged = out.setdefault(key, {})
                for k, v in value.items():
                    if type(v) in (int, float):
                        merged[k] = merged.get(k, 0) + v
            else:
                out[key] = out.get(key, 0) + value
    query = out.get("num_prefix_query_tokens", 0)
    out["prefix_hit_rate"] = out.get("num_prefix_hit_tokens", 0) / query if query else 0.0
    out["kv_usage"] = (sum(s.get("kv_usage", 0.0) for s in all_stats) / len(all_stats)
                       if all_stats else 0.0)
    return out


# ---------------------------------------------------------------------------
# Client connections.


@attrs.define(eq=False)
class _RouterStream(StreamState):
    """One live client stream."""

    request: RoutedRequest | None = None
    remote: AsyncStream | None = None
    accepted: bool = False
    streamed: bool = False


class _RouterConnection(Connection):
    """A client connection of the router: each Generate is placed on a replica."""

    router: Router

    def __init__(self, router: Router, stream: trio.SocketStream, conn_id: int) -> None:
        super().__init__(router, stream, conn_id)
        self.router = router
        self._stats_slots = trio.Semaphore(_STATS_QUERIES_PER_CONNECTION)

    async def answer_stats(self, ref: int) -> None:
        """Every replica's Stats, gathered in a task of its own (a few at once per
        connection: beyond that the reader waits, so queries cannot pile up)."""
        await self._stats_slots.acquire()
        self.streams_nursery.start_soon(self._answer_stats, ref)

    async def _answer_stats(self, ref: int) -> None:
        try:
            await self.send(await self.router.stats(ref))
        finally:
            self._stats_slots.release()

    async def answer_health(self, ref: int) -> None:
        """The router's Health."""
        await self.send(self.router.health(ref))

    def refuse_generate(self, message: Generate) -> Error | None:
        """A conversation (`messages`) is rendered by a server, and the router does
        not forward it; a request the replicas would refuse (their model's limits,
        from Welcome) is refused here, so it reaches no replica."""
        if message.messages is not None:
            return Error(ErrorCode.INVALID_REQUEST.value,
                         "the router forwards prompts only; send the conversation to a server, "
                         "or render it into a prompt", stream=message.stream)
        if message.params.n != 1:
            return Error(ErrorCode.INVALID_REQUEST.value,
                         f"n is {message.params.n}: the router places one sample per Generate; send n "
                         "Generates, or the request to a server", stream=message.stream)
        return message.refusal(RequestLimits.from_welcome(self.router.welcome))

    async def open_stream(self, message: Generate) -> None:
        """Place (or queue) the request now, so requests keep their arrival order."""
        request = await self.router.make_request(message)
        try:
            self.router.submit(request)
        except _Refused as refused:
            await self.send(refused.frame)
            return
        state = _RouterStream(message.stream, request=request)
        self.router.num_inflight += 1
        self.add_stream(state, self._run_stream)

    async def abort_stream(self, state: _RouterStream) -> None:
        """Abort on the replica, or end a request still waiting for one here."""
        if state.remote is not None:
            await self._abort_remote(state.remote)
        elif state.request.replica is None:
            state.scope.cancel()

    async def _abort_remote(self, remote: AsyncStream) -> None:
        try:
            await remote.abort()
        except (ConnectionClosedError, ClientTimeoutError, ServerError):
            pass  # the relay sees the failure too and handles it

    # ---- one stream --------------------------------------------------------------
    async def _run_stream(self, state: _RouterStream) -> None:
        request = state.request
        error: Error | None = None
        try:
            with state.scope:
                error = await self._place_and_forward(state, request)
            if error is None and state.abort_requested and not state.streamed:
                await self._finish_aborted(state, request)
        except _Refused as refused:
            error = refused.frame
        finally:
            self.router.withdraw(request)
            self.end_stream(state, error)

    async def _place_and_forward(self, state: _RouterStream, request: RoutedRequest) -> Error | None:
        """Forward until a replica finishes the request; the Error to end it with, if any.
        The first placement was made when the Generate arrived."""
        router, retries = self.router, []
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                router.num_retries += 1
                router.submit(request)
            replica = await router.wait_placed(request)
            try:
                await self._forward(state, request, replica)
                return None
            except _Retry as retry:
                retries.append(retry)
                if state.abort_requested:
                    return None
            finally:
                router.release(request)
        return Error(retries[-1].code, f"no replica could serve the request in {len(retries)} "
                     f"attempts; last: {retries[-1]}", stream=state.stream)

    async def _finish_aborted(self, state: _RouterStream, request: RoutedRequest) -> None:
        """A request aborted before any replica took it ends as one aborted there would."""
        text = "" if self.router.welcome.has_tokenizer else None
        await self.send(Accepted(state.stream, f"queued-{request.seq}", 0))
        await self.send(Output(state.stream, [], text, 0, "abort", "aborted by client", 0))

    async def _forward(self, state: _RouterStream, request: RoutedRequest, replica: Replica) -> None:
        """Run the request on `replica`, relaying its frames; _Retry if it could not start."""
        client, message = replica.client, request.message
        if client is None:
            raise _Retry(f"replica {replica.name} is gone")
        try:
            remote = await client.generate(
                message.prompt, message.params, priority=message.priority, tenant=message.tenant,
                deadline_s=message.deadline_s, timeout_s=message.timeout_s,
                cache_salt=message.cache_salt)
        except (ConnectionClosedError, ClientTimeoutError, ServerError) as exc:
            self.router.replica_failed(replica, client)
            raise _Retry(f"replica {replica.name}: {exc}") from None
        state.remote = remote
        try:
            if state.abort_requested:
                await self._abort_remote(remote)
            async for out in remote:
                if not state.accepted:
                    state.accepted = True
                    await self.send(Accepted(state.stream, f"{replica.name}/{remote.request_id}",
                                             remote.num_prompt_tokens or 0))
                state.streamed = True
                await self.send(attrs.evolve(out, stream=state.stream))
                if out.finished:
                    return
            raise ConnectionClosedError("the replica ended the stream without a finish")
        except ServerError as exc:
            if exc.fatal or exc.stream is None:
                self.router.replica_failed(replica, client)
                self._lost(state, replica, exc)
            if exc.code in _REPLICA_DOWN_CODES:
                self.router.replica_failed(replica, client)
                self._lost(state, replica, exc)
            if (exc.code in _RETRY_CODES and not exc.poison and not state.streamed
                    and not state.abort_requested):
                raise _Retry(f"replica {replica.name}: {exc}", exc.code) from None
            raise _Refused(Error(exc.code, exc.args[0] if exc.args else str(exc),
                                 stream=state.stream, limit=exc.limit, poison=exc.poison)) from None
        except (ConnectionClosedError, ClientTimeoutError) as exc:
            self.router.replica_failed(replica, client)
            self._lost(state, replica, exc)
        finally:
            state.remote = None
            with trio.CancelScope(shield=True):
                await remote.aclose()

    def _lost(self, state: _RouterStream, replica: Replica, exc: BaseException) -> None:
        if not state.streamed:
            raise _Retry(f"replica {replica.name} was lost: {exc}")
        raise _Refused(Error(
            ErrorCode.EXECUTOR_ERROR.value,
            f"replica {replica.name} ({replica.address}) was lost after the request had started "
            f"streaming; its output is incomplete ({exc})", stream=state.stream))


@unwrapping
@asynccontextmanager
async def open_router(config: RouterConfig) -> AsyncIterator[Router]:
    """Run a router for the duration of an `async with` block (it is listening
    and the replicas have answered when the block starts)."""
    router = Router(config)
    with bare_errors():
        async with trio.open_nursery() as nursery:
            await nursery.start(router.serve)
            try:
                yield router
            finally:
                router.shutdown()
                with trio.CancelScope(shield=True):
                    await router.wait_stopped()
