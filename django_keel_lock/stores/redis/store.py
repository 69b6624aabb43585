"""Locks in Redis, shared by every process and server that talks to the same Redis.

- Redis decides expiry (PX / PTTL, milliseconds); the app server's clock is never read.
- Each operation is one Lua script (`scripts`, which also shows the key layout).
- On a plain server or behind Sentinel (not Cluster), each thread runs the scripts on a
  connection of its own (`clients.ScriptConnection`), without redis-py's client and pool
  layers and without redis-py's command retries (a retried release whose first reply was lost
  would report the lock lost). The Cluster client is built without retries instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

from django.conf import settings
from django.core.cache import InvalidCacheBackendError
from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured

from ...exceptions import LockStoreUnavailable
from ..base import (
    GATE_OWNER,
    PERMIT_OWNERS,
    QUEUE_LEASE,
    AcquireResult,
    Kind,
    LockInfo,
    LockStore,
    Mode,
)
from ..connections import PerThread, socket_timeout_option
from ..wakeups import ListeningStore
from . import checks
from .clients import (
    CONNECT_TIMEOUT,
    LOOP_CLIENTS,
    POOL_WAIT,
    SCRIPT_CONNECTIONS,
    SENTINEL_CONNECTIONS,
    STORE_ERRORS,
    AsyncRetry,
    LoopClient,
    LoopClients,
    NoBackoff,
    NoScriptError,
    Retry,
    ScriptConnection,
    SentinelConnectionPool,
    as_text,
    async_twin,
    close_sentinels,
    key_slot,
    pack_command,
    ready,
    redis,
    run_ready,
    run_script,
    sentinel_master_config,
    timed_kwargs,
    timed_master_pool,
    without_cluster_retries,
)
from .listener import RedisListener
from .scripts import (
    ACQUIRE,
    ACQUIRE_MANY,
    ACQUIRE_PERMIT,
    ACQUIRE_QUEUED,
    EXTEND,
    EXTEND_MANY,
    EXTEND_PERMIT,
    GET,
    GIVE_BACK,
    HOLDERS,
    LEAVE_QUEUE,
    RELEASE,
    RELEASE_MANY,
    RELEASE_PERMIT,
    Script,
    escape_key,
    glob_quote,
    unescape_key,
)

PAGE_SIZE = 500

T = TypeVar("T")

#: One script call: the script, its KEYS, its ARGV.
Call = tuple[Script, tuple[str, ...], tuple[Any, ...]]
#: What a granting call is about: a key, or the keys of a multi-key call.
Granted = str | tuple[str, ...]

logger = logging.getLogger("django_keel_lock")


#: How many key sets a store keeps the names of (`RedisLockStore._many_names`).
MANY_NAMES_KEPT = 512
#: How many keys a store keeps the names of a release's call for (`RedisLockStore._line_names`).
LINE_NAMES_KEPT = 512


class ManyNames(NamedTuple):
    """The KEYS of ACQUIRE_MANY, RELEASE_MANY and EXTEND_MANY for one set of keys, and the
    ARGV of RELEASE_MANY after its owner and wake prefix (`scripts` shows the layouts)."""

    acquire: tuple[str, ...]
    release: tuple[str, ...]
    release_args: tuple[str, ...]
    extend: tuple[str, ...]

    @classmethod
    def of(
        cls,
        keys: tuple[str, ...],
        names: Callable[[str], tuple[str, str]],
        channel: Callable[[str], str],
    ) -> ManyNames:
        """`keys`' names, from each key's lock and fence counter (`names`) and its release
        channel (`channel`)."""
        pairs = [names(key) for key in keys]
        locks = tuple(lock for lock, _ in pairs)
        return cls(
            acquire=tuple(name for pair in pairs for name in pair),
            release=tuple(n for lock in locks for n in (lock, lock + ":line", lock + ":places")),
            release_args=tuple(a for key in keys for a in (channel(key), key)),
            extend=locks,
        )


def _granted(reply: Any) -> bool:
    """Did a script that may grant grant? A fence, an extend's 1 (or count), a list whose
    first item is one of these: > 0 when granted; ACQUIRE_MANY's fences (a string) only
    when granted."""
    if isinstance(reply, list):
        return int(reply[0]) > 0
    return isinstance(reply, (bytes, str)) or int(reply) > 0


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _seconds(pttl: Any) -> float | None:
    millis = int(pttl)
    return None if millis < 0 else millis / 1000.0


class RedisLockStore(ListeningStore, LockStore):
    """Locks in Redis (OPTIONS: CONNECTION or URL, KEY_PREFIX, CLUSTER, SOCKET_TIMEOUT).

    KEY_PREFIX (default "keel-lock:") starts every key and channel name; a ":" is added to a
    prefix that does not end with one, so "locks" and "locks:" both give locks:{invoice:42}
    ("" is no prefix at all).

    CONNECTION names a django-redis cache alias whose client and connection settings are reused
    (Sentinel included); URL is a plain redis-py URL (`?socket_timeout=1` etc. honoured), and
    CLUSTER=True makes it a RedisCluster.

    SOCKET_TIMEOUT (seconds, default 5) is the longest one call waits on the network: for
    connecting, and for each reply. A URL's own `?socket_timeout=` wins; with CONNECTION the
    cache's SOCKET_TIMEOUT is kept when it is shorter.

    MIN_REPLICAS (default 0) makes each acquire and extend wait (WAIT) up to half of
    SOCKET_TIMEOUT for that many replicas to acknowledge it; with fewer, the call raises
    LockStoreUnavailable (an acquire gives the lock back, an extend leaves it the expiry it had).
    """

    option_names = frozenset(
        {"CONNECTION", "URL", "KEY_PREFIX", "CLUSTER", "SOCKET_TIMEOUT", "MIN_REPLICAS"}
    )
    listener_class = RedisListener
    expires_by_itself = True  # each lock is a key with a PEXPIRE: Redis deletes it at its ttl
    queues = True
    hands_off = True  # RELEASE and LEAVE_QUEUE grant the lock to the first live waiter in line

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        return checks.check_config(alias, options)

    @classmethod
    def check_servers(
        cls, stores: Mapping[str, Mapping[str, Any]], *, databases: Sequence[str]
    ) -> list[CheckMessage]:
        """W007, W009: asked whichever database the command checks."""
        found = [checks.check_sentinel_master(alias, stores[alias], cls) for alias in stores]
        return [each for messages in found for each in messages]

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        connection, url, prefix = checks.server_options(alias, self.options)
        self.connection_alias: str | None = connection
        self.url: str | None = url
        self.cluster = bool(self.options.get("CLUSTER", False))
        # On Cluster, keys on several slots are taken a slot at a time (acquire_many).
        self.atomic_many = not self.cluster
        self.prefix = prefix
        self.wake_board.give_back = self.give_back_grant  # a carried grant nobody here takes
        self.channel = f"{prefix}released"
        self.wake_prefix = f"{prefix}wake:"  # + a listener's address: its wake channel
        self.socket_timeout = socket_timeout_option(alias, self.options)
        self.min_replicas = checks.min_replicas_option(alias, self.options)
        #: Whether a release's wake-up carries the grant to a waiter whose process hears it
        #: (`scripts.HAND_ON`), which then holds the lock without a call. Not under
        #: MIN_REPLICAS: an acquisition counts only once replicas acknowledged it, which the
        #: waiter's own call (with WAIT) checks. Not on Cluster: PUBLISH there counts only
        #: the subscribers of the node it ran on, no proof the waiter's process heard it.
        self.carries_grants = not self.cluster and not self.min_replicas
        self._mutex = threading.Lock()
        self._client_obj: Any = None
        self._client_pid = 0
        self._owns_client = url is not None
        self._generation = 0  # bumped by close(): async clients made before are not reused
        # The async clients event loops keep for this store, retired by close().
        self._loop_clients: weakref.WeakSet[LoopClient] = weakref.WeakSet()
        self._async_factory: Callable[[], Any] | None = None
        self._async_checked = False
        self._many_names_kept: dict[tuple[str, ...], ManyNames] = {}
        self._line_names_kept: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._threads: PerThread[ScriptConnection] = PerThread(ScriptConnection.close)
        # Whether threads may have a ScriptConnection of their own: decided on first use, per
        # client.
        self._own_connections: bool | None = None
        # Through Sentinel: the master pool those connections are made from (`_sentinel_pool`).
        self._timed_pool: Any = None

    # -- connections ----------------------------------------------------------------------
    def _where(self) -> str:
        """Where the store's Redis is, for messages: the URL's host:port (or socket path),
        never its credentials; or the cache it goes through."""
        if self.url is None:
            return f"CACHES[{self.connection_alias!r}]"
        try:
            parts = redis.connection.parse_url(self.url)
        except ValueError:
            return "URL ?"
        if "path" in parts:
            return f"URL {parts['path']}"
        host = str(parts.get("host", "localhost"))
        return f"URL {f'[{host}]' if ':' in host else host}:{parts.get('port', 6379)}"

    def _unavailable(self, exc: Exception) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"lock store {self.alias!r} cannot use Redis ({self._where()}): "
            f"{type(exc).__name__}: {exc}"
        )

    def _client(self) -> Any:
        """The sync client: built once per process (redis-py pools are not fork-safe to share
        in flight, and a child must not reuse its parent's sockets)."""
        client = self._client_obj
        if client is not None and self._client_pid == os.getpid():
            return client
        with self._mutex:
            if self._client_obj is None or self._client_pid != os.getpid():
                try:
                    self._client_obj = self._build_client()
                except (ImproperlyConfigured, LockStoreUnavailable):
                    raise
                except Exception as exc:
                    raise self._unavailable(exc) from exc
                self._client_pid = os.getpid()
            return self._client_obj

    def _url_kwargs(self) -> dict[str, Any]:
        # No redis-py retries: a retried script whose first reply was lost could report a
        # release as failed. Stale pooled sockets are reconnected by the pool before use.
        # redis-py lets the URL's own ?socket_timeout= override these.
        return {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": min(CONNECT_TIMEOUT, self.socket_timeout),
        }

    def _build_client(self) -> Any:
        if self.url is not None:
            if self.cluster:
                # No command retries here either; a node that fails still makes the client
                # rediscover the cluster before the error reaches us, so the next call goes
                # to the new master.
                return without_cluster_retries(
                    redis.RedisCluster.from_url(
                        self.url, retry=Retry(NoBackoff(), 0), **self._url_kwargs()
                    )
                )
            return redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **self._url_kwargs())
        from django_redis import get_redis_connection

        try:
            return get_redis_connection(self.connection_alias or "default", write=True)
        except InvalidCacheBackendError:  # Django's says only "The connection 'x' doesn't exist."
            caches = ", ".join(sorted(settings.CACHES)) or "none"
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{self.alias!r}] OPTIONS CONNECTION {self.connection_alias!r} "
                f"is not a CACHES alias (CACHES has: {caches}); name a django-redis cache, or "
                f"use URL"
            ) from None
        except NotImplementedError:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{self.alias!r}] CONNECTION {self.connection_alias!r} is not "
                f"a django-redis cache (BACKEND django_redis.cache.RedisCache)"
            ) from None

    def sentinel_master_config(self, pattern: str) -> dict[str, str] | None:
        """The master's CONFIG GET `pattern` when the store reaches Redis through Sentinel
        (None otherwise), for the system checks: each wait on the network takes at most the
        shorter of SOCKET_TIMEOUT and the connect timeout. Raises LockStoreUnavailable for an
        unreachable server, redis.ResponseError for a refused CONFIG."""
        seconds = min(self.socket_timeout, CONNECT_TIMEOUT)
        try:
            return sentinel_master_config(self._client(), pattern, seconds)
        except redis.ResponseError:
            raise
        except (*STORE_ERRORS, OSError) as exc:
            raise self._unavailable(exc) from exc

    def release_channel(self, key: str) -> str:
        """Where a release of `key` is announced: one channel per key, so a process hears only
        about the keys it waits for, not every release in the whole Redis."""
        return f"{self.channel}:{key}"

    def lock_name(self, key: str) -> str:
        """The Redis key of `key`'s lock: code kept beside the lock (idempotent results) names
        its keys after it, so they share its hash tag and so its Cluster slot."""
        return self._names(key)[0]

    def client(self) -> Any:
        """The sync redis-py client of this process (a RedisCluster with CLUSTER=True)."""
        return self._client()

    def _names(self, key: str) -> tuple[str, str]:
        lock_name = f"{self.prefix}{{{escape_key(key)}}}"
        return lock_name, lock_name + ":fence"

    def _permit_names(self, key: str) -> tuple[str, str, str, str, str]:
        """The keys of the permit scripts, in their KEYS order: gate, permits, holders, fence
        counter, waiting writer (`scripts` shows the layout)."""
        lock_name, fence_name = self._names(key)
        return (
            lock_name,
            lock_name + ":permits",
            lock_name + ":holders",
            fence_name,
            lock_name + ":writer",
        )

    def _run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run `script` and return its reply; LockStoreUnavailable when Redis fails."""
        try:
            own = self._script_connection()
            if own is not None:
                return own.evalsha(script, keys, args)
            client = self._client()
            evalsha, load = ready(client.evalsha), ready(client.script_load)
            return run_ready(run_script(script, keys, args, evalsha, load))
        except (*STORE_ERRORS, OSError) as exc:
            raise self._unavailable(exc) from exc

    def _script_connection(self) -> ScriptConnection | None:
        """This thread's own connection for the scripts, when the client is a plain one. It
        has the pool's settings, with the store's SOCKET_TIMEOUT: a django-redis pool may have
        none, and its sockets wait forever on a frozen server."""
        own = self._threads.get()
        if own is not None or self._own_connections is False:
            return own
        client = self._client()
        pool: Any = getattr(client, "connection_pool", None)
        connection_class = getattr(pool, "connection_class", None)
        self._own_connections = type(client) is redis.Redis and (
            (
                type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
                and connection_class in SCRIPT_CONNECTIONS
            )
            or (
                # Its connections find the master through the pool (in connection_kwargs),
                # asking the sentinels again whenever they reconnect.
                isinstance(pool, SentinelConnectionPool)
                and pool.is_master
                and connection_class in SENTINEL_CONNECTIONS
            )
        )
        if not self._own_connections:
            return None
        if isinstance(pool, SentinelConnectionPool):
            kwargs = self._sentinel_pool(pool).connection_kwargs
        elif self.url is None:  # a URL-made pool has the store's timeouts, or the URL's own
            kwargs = timed_kwargs(pool.connection_kwargs, self.socket_timeout)
        else:
            kwargs = pool.connection_kwargs
        return self._threads.put(ScriptConnection(pool.connection_class(**kwargs)))

    def _sentinel_pool(self, pool: Any) -> Any:
        """The twin of the Sentinel master `pool` that threads' own connections come from:
        reconnecting, they ask the sentinels within SOCKET_TIMEOUT too (`timed_master_pool`)."""
        with self._mutex:
            if self._timed_pool is None:
                self._timed_pool = timed_master_pool(pool, self.socket_timeout)
            return self._timed_pool

    # -- the protocol ---------------------------------------------------------------------
    # Each operation is one script: what it is called with (a `_..._call`: script, keys,
    # arguments) and how its reply is read are written once; the sync method runs the call with
    # `_run`, the async one with `_arun`.
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return self._acquired(
            self._granting(self._acquire_call(key, owner, holder, ttl), key, owner)
        )

    async def aacquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        call = self._acquire_call(key, owner, holder, ttl)
        return self._acquired(await self._agranting(call, key, owner))

    def acquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return self._acquired(
            self._granting(self._queued_call(key, owner, holder, ttl), key, owner)
        )

    async def aacquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        call = self._queued_call(key, owner, holder, ttl)
        return self._acquired(await self._agranting(call, key, owner))

    def leave_queue(self, key: str, owner: str) -> None:
        self._run(*self._line_call(LEAVE_QUEUE, key, owner))

    async def aleave_queue(self, key: str, owner: str) -> None:
        await self._arun(*self._line_call(LEAVE_QUEUE, key, owner))

    def give_back_grant(self, key: str, owner: str, fence: int) -> bool:
        """Give back the grant of `key` (`fence`) a release carried to `owner`, which nobody
        in this process takes (`WakeBoard.give_back`: its owner waits for the key nowhere
        here, or stopped waiting without taking it): the next in line gets the lock. A no-op
        when the owner took it up by a call, holds it by another grant, or left the line."""
        script, keys, args = self._line_call(GIVE_BACK, key, owner)
        return bool(self._run(script, keys, (*args, str(fence))))

    def release(self, key: str, owner: str) -> bool:
        return self._released(key, self._run(*self._line_call(RELEASE, key, owner)))

    async def arelease(self, key: str, owner: str) -> bool:
        return self._released(key, await self._arun(*self._line_call(RELEASE, key, owner)))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        return bool(self._granting(self._extend_call(key, owner, ttl), key, owner, extend=True))

    async def aextend(self, key: str, owner: str, ttl: float) -> bool:
        call = self._extend_call(key, owner, ttl)
        return bool(await self._agranting(call, key, owner, extend=True))

    def get(self, key: str) -> LockInfo | None:
        return self._got(key, self._run(GET, self._names(key)[:1], ()))

    async def aget(self, key: str) -> LockInfo | None:
        return self._got(key, await self._arun(GET, self._names(key)[:1], ()))

    def _acquire_call(self, key: str, owner: str, holder: str, ttl: float) -> Call:
        return ACQUIRE, self._names(key), (owner, holder, _ms(ttl))

    def _queued_call(self, key: str, owner: str, holder: str, ttl: float) -> Call:
        lock_name, fence_name = self._names(key)
        keys = (lock_name, fence_name, lock_name + ":line", lock_name + ":places")
        args = (owner, holder, _ms(ttl), _ms(QUEUE_LEASE), self.wake_address)
        return ACQUIRE_QUEUED, keys, args

    def _line_call(self, script: Script, key: str, owner: str) -> Call:
        """RELEASE's, LEAVE_QUEUE's or GIVE_BACK's call: each may hand the lock over to the first in
        line, for its ttl when the wake-up carries the grant (`carries_grants`, and its process's
        listener hears it), else for QUEUE_LEASE at most until it takes the grant up (so a waiter
        that died first in line holds the others up no longer than its place would have)."""
        keys, rest = self._line_names_kept.get(key) or self._line_names(key)
        return script, keys, (owner, *rest)

    def _line_names(self, key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """`_line_call`'s KEYS, and its ARGV after the owner, for `key`: made once per key (a
        handle releases the key it took, a waiter leaves the line it stood in; a release is
        on the way of a hand-off) and kept for the last LINE_NAMES_KEPT keys."""
        lock_name, fence_name = self._names(key)
        keys = (lock_name, fence_name, lock_name + ":line", lock_name + ":places")
        carry = "1" if self.carries_grants else "0"
        rest = (self.release_channel(key), self.wake_prefix, key, str(_ms(QUEUE_LEASE)), carry)
        if len(self._line_names_kept) >= LINE_NAMES_KEPT:
            self._line_names_kept.clear()
        self._line_names_kept[key] = keys, rest
        return keys, rest

    def _extend_call(self, key: str, owner: str, ttl: float) -> Call:
        return EXTEND, self._names(key)[:1], (owner, _ms(ttl))

    def _released(self, key: str, reply: Any) -> bool:
        """A release script's reply, as a bool; when released, this process's own waiters
        are woken at once, not by the pub/sub echo."""
        if reply:
            self.wake_board.wake(key)
        return bool(reply)

    def _got(self, key: str, reply: Any) -> LockInfo | None:
        """GET's reply: the lock on `key`, or None."""
        return None if reply is None else self._info(key, *reply)

    # -- several keys at once -------------------------------------------------------------
    # One script for keys whose names share a slot: every key on one server or behind
    # Sentinel; on Cluster, keys that start with the same hash tag ("{account}:1"). Keys on
    # several Cluster slots are taken a slot at a time (`_take_by_slot`).
    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        slots = self._slots(keys)
        if len(slots) == 1:
            return self._acquire_slot(keys, owner, holder, ttl)
        take, give_back = ready(self._acquire_slot), ready(self.release_many)
        return run_ready(self._take_by_slot(slots, keys, owner, holder, ttl, take, give_back))

    async def aacquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        slots = self._slots(keys)
        if len(slots) == 1:
            return await self._aacquire_slot(keys, owner, holder, ttl)
        take, give_back = self._aacquire_slot, self.arelease_many
        return await self._take_by_slot(slots, keys, owner, holder, ttl, take, give_back)

    def release_many(self, keys: tuple[str, ...], owner: str) -> bool:
        def run(part: tuple[str, ...]) -> bool:
            return self._released_many(part, self._run(*self._release_many_call(part, owner)))

        if not self.cluster:  # one slot: no coroutine to run the slots
            return run(keys)
        return run_ready(self._each_slot(self._slots(keys), ready(run)))

    async def arelease_many(self, keys: tuple[str, ...], owner: str) -> bool:
        async def run(part: tuple[str, ...]) -> bool:
            reply = await self._arun(*self._release_many_call(part, owner))
            return self._released_many(part, reply)

        return await self._each_slot(self._slots(keys), run)

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        def run(part: tuple[str, ...]) -> bool:
            call = self._extend_many_call(part, owner, ttl)
            return self._extended_many(part, self._granting(call, part, owner, extend=True))

        return run_ready(self._each_slot(self._slots(keys), ready(run)))

    async def aextend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        async def run(part: tuple[str, ...]) -> bool:
            call = self._extend_many_call(part, owner, ttl)
            return self._extended_many(part, await self._agranting(call, part, owner, extend=True))

        return await self._each_slot(self._slots(keys), run)

    def _acquire_slot(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        call = self._acquire_many_call(keys, owner, holder, ttl)
        return self._acquired_many(keys, self._granting(call, keys, owner))

    async def _aacquire_slot(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        call = self._acquire_many_call(keys, owner, holder, ttl)
        return self._acquired_many(keys, await self._agranting(call, keys, owner))

    def _slots(self, keys: tuple[str, ...]) -> list[tuple[str, ...]]:
        """`keys` in groups whose names share a Cluster slot, in the order of their first
        key: one group but on Cluster."""
        if not self.cluster:
            return [keys]
        groups: dict[int, list[str]] = {}
        for key in keys:
            groups.setdefault(key_slot(self._names(key)[0].encode()), []).append(key)
        return [tuple(group) for group in groups.values()]

    async def _take_by_slot(
        self,
        slots: list[tuple[str, ...]],
        keys: tuple[str, ...],
        owner: str,
        holder: str,
        ttl: float,
        take: Callable[..., Awaitable[AcquireResult]],
        give_back: Callable[[tuple[str, ...], str], Awaitable[bool]],
    ) -> AcquireResult:
        """Cluster's way for keys on several slots (for sync and async callers alike, as
        `run_script`): one script per slot, in order; at the first refusal or error every
        key taken so far (and those of the slot in flight, whose reply may be lost) is given
        back. Others may see a part taken meanwhile, never keep it: nobody holds a part
        while waiting for the rest."""
        fences: dict[str, int] = {}
        part: tuple[str, ...] = ()
        try:
            for part in slots:
                result = await take(part, owner, holder, ttl)
                if result.fences is None:
                    await self._give_back_quietly(tuple(fences), owner, give_back)
                    return result
                fences.update(zip(part, result.fences, strict=True))
        except BaseException:
            await self._give_back_quietly((*fences, *part), owner, give_back)
            raise
        ordered = tuple(fences[key] for key in keys)
        return AcquireResult(max(ordered), fences=ordered)

    @staticmethod
    async def _give_back_quietly(
        keys: tuple[str, ...],
        owner: str,
        give_back: Callable[[tuple[str, ...], str], Awaitable[bool]],
    ) -> None:
        """Release `owner`'s `keys` of a refused or failing multi-key acquire; a key that
        cannot be released now lives out its ttl."""
        if keys:
            with contextlib.suppress(Exception):
                await give_back(keys, owner)

    @staticmethod
    async def _each_slot(
        slots: list[tuple[str, ...]], run: Callable[[tuple[str, ...]], Awaitable[bool]]
    ) -> bool:
        """`run` on each slot's keys, all of them even when one fails (its error is raised
        after); True if every one was."""
        every, failed = True, None
        for part in slots:
            try:
                every = await run(part) and every
            except LockStoreUnavailable as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        return every

    def _acquire_many_call(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> Call:
        return ACQUIRE_MANY, self._many_names(keys).acquire, (owner, holder, _ms(ttl))

    def _release_many_call(self, keys: tuple[str, ...], owner: str) -> Call:
        names = self._many_names(keys)
        return RELEASE_MANY, names.release, (owner, self.wake_prefix, *names.release_args)

    def _extend_many_call(self, keys: tuple[str, ...], owner: str, ttl: float) -> Call:
        return EXTEND_MANY, self._many_names(keys).extend, (owner, _ms(ttl))

    def _many_names(self, keys: tuple[str, ...]) -> ManyNames:
        """The names the scripts of several keys take for `keys`, made once per key set: a
        handle acquires, extends and releases the same set, and a caller takes the same sets
        again (a few a request). Kept for the last MANY_NAMES_KEPT sets."""
        names = self._many_names_kept.get(keys)
        if names is None:
            if len(self._many_names_kept) >= MANY_NAMES_KEPT:
                self._many_names_kept.clear()
            names = self._many_names_kept[keys] = ManyNames.of(
                keys, self._names, self.release_channel
            )
        return names

    @staticmethod
    def _acquired_many(keys: tuple[str, ...], reply: Any) -> AcquireResult:
        """ACQUIRE_MANY's reply as an AcquireResult."""
        if not isinstance(reply, list):  # the fences, in one string
            fences = tuple(map(int, reply.split()))
            return AcquireResult(max(fences), fences=fences)
        first = int(reply[0])
        gate_owner = as_text(reply[1])
        return AcquireResult(
            None,
            None if first == 0 else (-first - 1) / 1000.0,
            PERMIT_OWNERS.get(gate_owner, "exclusive"),
            blocked=tuple(keys[int(index) - 1] for index in reply[2:]),
        )

    def _released_many(self, keys: tuple[str, ...], reply: Any) -> bool:
        """RELEASE_MANY's reply: True if every key was released; this process's waiters of
        each released key are woken at once."""
        flags = as_text(reply)
        for key, flag in zip(keys, flags, strict=True):
            if flag == "1":
                self.wake_board.wake(key)
        return "0" not in flags

    @staticmethod
    def _extended_many(keys: tuple[str, ...], reply: Any) -> bool:
        return int(reply) == len(keys)

    # -- replicas (MIN_REPLICAS) ------------------------------------------------------------
    # A script that may grant (acquire, extend and their permit twins) is followed by WAIT on
    # the same connection, in the same round trip: an acquire fewer than MIN_REPLICAS
    # replicas acknowledged within half of SOCKET_TIMEOUT is given back and the call raises,
    # so a failover to a replica that never saw it cannot hand it out again. An extend short
    # of them raises and keeps the lock: its holder, told the store could not say, counts on
    # the expiry it was given last (which the replicas have), and a lock given back then
    # would have two holders. It narrows the failover window, not closes it: replication
    # stays asynchronous, Sentinel may promote a replica that had not acknowledged, and a
    # grant can be acknowledged after WAIT gave up.
    def _granting(
        self, call: Call, key: Granted, owner: str, permit: bool = False, extend: bool = False
    ) -> Any:
        if not self.min_replicas:
            return self._run(*call)
        waiting, run = ready(self._run_waiting), ready(self._run)
        give_back = None if extend else self._give_back_call(key, owner, permit)
        return run_ready(self._on_replicas(call, key, give_back, waiting, run))

    async def _agranting(
        self, call: Call, key: Granted, owner: str, permit: bool = False, extend: bool = False
    ) -> Any:
        if not self.min_replicas:
            return await self._arun(*call)
        give_back = None if extend else self._give_back_call(key, owner, permit)
        return await self._on_replicas(call, key, give_back, self._arun_waiting, self._arun)

    def _give_back_call(self, key: Granted, owner: str, permit: bool) -> Call:
        """The release (owner-checked) of an acquire short of replicas: of `key`, or of
        each key of a multi-key acquire (a tuple)."""
        if isinstance(key, tuple):
            return self._release_many_call(key, owner)
        return (
            self._release_permit_call(key, owner)
            if permit
            else self._line_call(RELEASE, key, owner)
        )

    async def _on_replicas(
        self,
        call: Call,
        key: Granted,
        give_back: Call | None,
        waiting: Callable[..., Awaitable[tuple[Any, int]]],
        run: Callable[..., Awaitable[Any]],
    ) -> Any:
        """`call` with WAIT (`waiting`), for sync and async callers alike (as `run_script`);
        a grant short of acknowledgements raises, an acquire's given back first (`run` of
        `give_back`; an extend has none)."""
        reply, acks = await waiting(*call)
        granted = _granted(reply)
        if granted and acks < self.min_replicas:
            if give_back is not None:
                with contextlib.suppress(LockStoreUnavailable):  # else it expires at its ttl
                    await run(*give_back)
            kept = "it was given back" if give_back else "the lock keeps the expiry it had"
            raise LockStoreUnavailable(
                f"lock store {self.alias!r}: {acks} of the {self.min_replicas} replicas "
                f"(MIN_REPLICAS) acknowledged {key!r} within {self._wait_ms} ms "
                f"({self._where()}); {kept}"
            )
        return reply

    def run_extra(
        self, script: Script, keys: Sequence[str], args: Sequence[Any], *, writes: bool
    ) -> tuple[Any, bool]:
        """Run `script`, one of another part's (idempotent results); one that `writes` what
        must survive a failover is followed by WAIT on its connection with MIN_REPLICAS, in
        the same round trip, as an acquire is: (its reply, whether MIN_REPLICAS replicas
        acknowledged it; True without MIN_REPLICAS or when it does not write)."""
        if not (writes and self.min_replicas):
            return self._run(script, keys, args), True
        reply, acks = self._run_waiting(script, keys, args)
        return reply, acks >= self.min_replicas

    def releasing_call(self, key: str, owner: str) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        """The KEYS and ARGV a script that releases `owner`'s lock on `key` and wakes the
        first in line (scripts.RELEASE_KEEPING) begins its own with: the lock's hash, its
        line and places; owner, release channel, wake channels' prefix, key."""
        lock_name = self._names(key)[0]
        keys = (lock_name, lock_name + ":line", lock_name + ":places")
        return keys, (owner, self.release_channel(key), self.wake_prefix, key)

    def released_by(self, key: str, released: bool) -> bool:
        """A script released `key` (`released`): wake this process's waiters as `release`
        does."""
        return self._released(key, released)

    @property
    def _wait_ms(self) -> int:
        return _ms(self.socket_timeout / 2)

    def _run_waiting(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """`script`'s reply and how many replicas acknowledged its writes (WAIT)."""
        wait = pack_command(b"WAIT", self.min_replicas, self._wait_ms)
        try:
            own = self._script_connection()
            if own is None:
                reply, acks = self._waiting_pipeline(self._client(), script, keys, args)
                return reply, int(acks)
            run = pack_command(b"EVALSHA", script.sha, len(keys), *keys, *args)
            reply, acks = own.call(run, wait, errors_inline=True)
            if isinstance(reply, NoScriptError):  # the whole text this once (NOSCRIPT: no write)
                run = pack_command(b"EVAL", script.text, len(keys), *keys, *args)
                reply, acks = own.call(run, wait)
            elif isinstance(reply, Exception):
                raise reply
            return reply, int(acks)
        except (*STORE_ERRORS, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def _arun_waiting(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int]:
        if not self._native_async():
            return await asyncio.wrap_future(self.submit(self._run_waiting, script, keys, args))
        reply, acks = await self._on_loop_client(
            lambda client: self._waiting_pipeline(client, script, keys, args)
        )
        return reply, int(acks)

    def _waiting_pipeline(
        self, client: Any, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        """EVAL then WAIT in one pipeline of `client` (one connection): its replies, or with
        an async client an awaitable of them."""
        pipe = client.pipeline(transaction=False)
        pipe.eval(script.text, len(keys), *keys, *args)
        pipe.execute_command("WAIT", self.min_replicas, self._wait_ms)
        return pipe.execute()

    # -- permits --------------------------------------------------------------------------
    supports_modes = True

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        return self._acquired(
            self._granting(*self._permit_grant(key, owner, holder, ttl, mode, writer_wait))
        )

    async def aacquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        grant = self._permit_grant(key, owner, holder, ttl, mode, writer_wait)
        return self._acquired(await self._agranting(*grant))

    def release_permit(self, key: str, owner: str) -> bool:
        return self._released(key, self._run(*self._release_permit_call(key, owner)))

    async def arelease_permit(self, key: str, owner: str) -> bool:
        return self._released(key, await self._arun(*self._release_permit_call(key, owner)))

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        call = self._extend_permit_call(key, owner, ttl)
        return bool(self._granting(call, key, owner, True, extend=True))

    async def aextend_permit(self, key: str, owner: str, ttl: float) -> bool:
        call = self._extend_permit_call(key, owner, ttl)
        return bool(await self._agranting(call, key, owner, True, extend=True))

    def holders(self, key: str) -> list[LockInfo]:
        return self._holders(key, self._run(HOLDERS, self._permit_names(key)[:3], ()))

    async def aholders(self, key: str) -> list[LockInfo]:
        return self._holders(key, await self._arun(HOLDERS, self._permit_names(key)[:3], ()))

    def _permit_grant(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float
    ) -> tuple[Call, str, str, bool]:
        """What `_granting` takes for a permit acquire: the call, the key, the owner, and
        whether the grant is a permit (anything but an exclusive acquire)."""
        gate_owner = GATE_OWNER.get(mode.kind, "")  # "" for an exclusive acquire
        wait_ms = round(max(0.0, writer_wait) * 1000)
        args = (owner, holder, _ms(ttl), gate_owner, mode.limit, wait_ms)
        call = ACQUIRE_PERMIT, self._permit_names(key), args
        return call, key, owner, mode.kind != "exclusive"

    def _release_permit_call(self, key: str, owner: str) -> Call:
        return RELEASE_PERMIT, self._permit_names(key)[:3], (owner, self.release_channel(key))

    def _extend_permit_call(self, key: str, owner: str, ttl: float) -> Call:
        return EXTEND_PERMIT, self._permit_names(key)[:3], (owner, _ms(ttl))

    def _holders(self, key: str, reply: Any) -> list[LockInfo]:
        """HOLDERS' reply as LockInfos, soonest expiry first."""
        if reply is None:
            return []
        kind = PERMIT_OWNERS.get(as_text(reply[0]))
        if kind is None:
            return [self._info(key, *reply)]
        infos = []
        for at in range(1, len(reply), 3):
            fence, acquired, holder = as_text(reply[at + 1]).split(":", 2)
            infos.append(self._info(key, reply[at], holder, fence, acquired, reply[at + 2], kind))
        return sorted(infos, key=lambda info: (info.expires_in, info.fence))

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Live locks under `prefix`, in key order (each permit of a key permits hold). SCAN
        collects only the key names (sorting needs them all); the locks themselves are read a
        page at a time."""
        start = f"{self.prefix}{{"
        pattern = glob_quote(start + escape_key(prefix)) + "*"
        try:
            names = self._scan(pattern)
        except (*STORE_ERRORS, OSError) as exc:
            raise self._unavailable(exc) from exc
        keys = sorted(
            unescape_key(name[len(start) : -1])
            for name in map(as_text, names)
            if name.endswith("}") and name.startswith(start)
        )
        for first in range(0, len(keys), PAGE_SIZE):
            page = keys[first : first + PAGE_SIZE]
            try:
                replies = self._read_page([self._names(key)[0] for key in page])
            except (*STORE_ERRORS, OSError) as exc:
                raise self._unavailable(exc) from exc
            for index, key in enumerate(page):
                fields, pttl = replies[2 * index], replies[2 * index + 1]
                if _not_a_lock(fields):
                    # Something else wrote a key under our prefix. The listing shows the locks
                    # and names the stray key, rather than failing.
                    logger.warning(
                        "lock store %r: key %r is not a lock: %s", self.alias, key, fields
                    )
                    continue
                for reply in (fields, pttl):
                    if isinstance(reply, redis.ResponseError):  # NOPERM, MOVED...: the store's
                        raise self._unavailable(reply)
                # Released or expired between SCAN and now, or caught mid-change: skip.
                if fields[0] is None or fields[2] is None or int(pttl) <= 0:
                    continue
                owner, holder, fence, acquired = fields
                if as_text(owner) in PERMIT_OWNERS:  # a gate: its permits are the holders
                    yield from self.holders(key)
                else:
                    yield self._info(key, owner, holder, fence, acquired, pttl)

    def _scan(self, pattern: str) -> list[Any]:
        """The name of every key matching `pattern`, SCANned a page at a time (on this
        thread's own connection when there is one, as the scripts run)."""
        own = self._script_connection()
        if own is None:
            return list(self._client().scan_iter(match=pattern, count=PAGE_SIZE))
        names: list[Any] = []
        cursor: Any = 0
        while True:
            [(cursor, found)] = own.call(
                pack_command(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", PAGE_SIZE)
            )
            names.extend(found)
            if int(cursor) == 0:
                return names

    def _read_page(self, names: Sequence[str]) -> list[Any]:
        """HMGET o h f t, then PTTL, of each lock in `names`: one round trip."""
        own = self._script_connection()
        if own is not None:
            return own.call(
                *(
                    packed
                    for name in names
                    for packed in (
                        pack_command(b"HMGET", name, b"o", b"h", b"f", b"t"),
                        pack_command(b"PTTL", name),
                    )
                ),
                errors_inline=True,
            )
        pipe = self._client().pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "o", "h", "f", "t")
            pipe.pttl(name)
        return list(pipe.execute(raise_on_error=False))

    @staticmethod
    def _acquired(reply: Any) -> AcquireResult:
        held_as: Kind = "exclusive"
        last_fence = None
        if isinstance(reply, list):
            if len(reply) == 3:  # refused in line: [-(ms + 1), '', the key's last fence]
                reply, _, last_fence = reply
            else:  # refused by permits: [-(ms + 1), the gate's owner]
                reply, gate_owner = reply
                held_as = PERMIT_OWNERS[as_text(gate_owner)]
        value = int(reply)
        if value > 0:
            return AcquireResult(value)
        retry_in = None if value == 0 else (-value - 1) / 1000.0
        return AcquireResult(None, retry_in, held_as, last_fence=last_fence)

    @staticmethod
    def _info(
        key: str,
        owner: Any,
        holder: Any,
        fence: Any,
        acquired: Any,
        pttl: Any,
        mode: Kind = "exclusive",
    ) -> LockInfo:
        acquired_at = (
            None if acquired is None else datetime.fromtimestamp(int(acquired) / 1000.0, tz=UTC)
        )
        return LockInfo(
            key=key,
            owner=as_text(owner),
            holder=as_text(holder) if holder is not None else "",
            fence=int(fence),
            acquired_at=acquired_at,
            expires_in=max(0.0, _seconds(pttl) or 0.0),
            mode=mode,
        )

    # -- wake-ups -------------------------------------------------------------------------
    def close(self) -> None:
        self.stop_listener()
        self._threads.close_all()
        with self._mutex:
            self._own_connections = None
            timed_pool, self._timed_pool = self._timed_pool, None
            client, self._client_obj = self._client_obj, None
            pid, self._client_pid = self._client_pid, 0
            self._generation += 1
            retiring, self._loop_clients = list(self._loop_clients), weakref.WeakSet()
        for used in retiring:
            used.retire_soon()
        if timed_pool is not None:
            close_sentinels(timed_pool.sentinel_manager)
        # A django-redis client belongs to the cache; only a client we built is ours to close.
        if client is not None and self._owns_client and pid == os.getpid():
            try:
                client.close()
            except Exception:
                pass

    # -- async ----------------------------------------------------------------------------
    # redis.asyncio clients are bound to the event loop that first used them: one per loop and
    # store, kept on the loop itself (a client refers to its loop, so a registry of ours would
    # keep every finished loop alive). Nothing tells when a loop closes, but the loop's
    # shutdown_asyncgens() tells when it is about to: asyncio.run, async_to_sync (a loop per
    # call under WSGI) and ASGI servers run it, and it closes an async generator we start on
    # the loop, whose `finally` closes the loop's clients while the loop still runs. A loop
    # closed without it leaves its clients, like its own async generators, to the garbage
    # collector.
    def _loop_client(self) -> LoopClient | None:
        """This loop's client for this store, or None when it has to be made (the fast path:
        one lookup, no await)."""
        clients: LoopClients | None = getattr(asyncio.get_running_loop(), LOOP_CLIENTS, None)
        if clients is not None:
            made = clients.made.get(self)
            if made is not None and made.generation == self._generation:
                return made
        return None

    async def _new_loop_client(self) -> LoopClient:
        """A new client for this loop and store; retired from the start (closed after its
        call) when the loop would never close it."""
        factory = self._async_client_factory()
        assert factory is not None  # only called when _native_async()
        loop = asyncio.get_running_loop()
        clients: LoopClients | None = getattr(loop, LOOP_CLIENTS, None)
        if clients is None:
            clients = LoopClients()
            if await clients.close_at_shutdown_of(loop):
                setattr(loop, LOOP_CLIENTS, clients)
        try:
            client = LoopClient(
                factory(), self._generation, loop, clients if clients.keeps else None
            )
        except Exception as exc:
            raise self._unavailable(exc) from exc
        if clients.keeps:
            stale = clients.made.get(self)  # made before close(): no new calls on it
            clients.made[self] = client
            with self._mutex:
                self._loop_clients.add(client)
            if stale is not None:
                await stale.retire()
        return client

    def _async_client_factory(self) -> Callable[[], Any] | None:
        """How to make an async client talking to the same server, or None when only the
        sync client knows how (then the async methods run it in a thread)."""
        if self._async_checked:
            return self._async_factory
        factory: Callable[[], Any] | None = None
        if self.url is not None:
            url, kwargs = self.url, self._url_kwargs()
            if self.cluster:
                factory = lambda: without_cluster_retries(  # noqa: E731
                    redis.asyncio.RedisCluster.from_url(
                        url,
                        retry=AsyncRetry(NoBackoff(), 0),  # type: ignore[arg-type]  # old stubs
                        **kwargs,
                    )
                )
            else:
                retry = AsyncRetry(NoBackoff(), 0)
                factory = lambda: redis.asyncio.Redis(  # noqa: E731
                    connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
                        url, retry=retry, timeout=POOL_WAIT, **kwargs
                    )
                )
        else:
            factory = async_twin(self._client(), self.socket_timeout)
        self._async_factory, self._async_checked = factory, True
        return factory

    async def _arun(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """`_run` for async callers: on this loop's redis.asyncio client, or on the store's
        worker threads when only the sync client knows how to reach the server."""
        if not self._native_async():
            return await asyncio.wrap_future(self.submit(self._run, script, keys, args))
        return await self._on_loop_client(
            lambda client: run_script(script, keys, args, client.evalsha, client.script_load)
        )

    async def _on_loop_client(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """`work(client)` on this loop's redis.asyncio client."""
        used = self._loop_client() or await self._new_loop_client()
        used.calls += 1
        try:
            return await work(used.client)
        except (*STORE_ERRORS, OSError) as exc:  # asyncio can raise raw socket errors on connect
            raise self._unavailable(exc) from exc
        finally:
            used.calls -= 1
            if used.retired and used.calls == 0:
                await used.close()

    def _native_async(self) -> bool:
        return self._async_client_factory() is not None


def _not_a_lock(reply: object) -> bool:
    """Whether a lock's HMGET `reply` says the key holds another type (WRONGTYPE): a key of
    someone else's under the prefix, not a failure of the store."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")
