"""Locks in Redis, shared by every process and server that talks to the same Redis.

Three rules shape this module:
- Redis decides expiry (PX / PTTL, milliseconds); the app server's clock is never read.
- Each operation is one Lua script, loaded once and called by SHA: one round trip, atomic.
- Every key of one lock shares the lock key's hash tag, so the scripts run on Redis Cluster.
- On a plain server or behind Sentinel (not Cluster), each thread runs the scripts on a
  connection of its own, without redis-py's client and pool layers (about 50 µs a call in
  Python), and without redis-py's command retries (a retried release whose first reply was
  lost would report the lock lost). The Cluster client is built without retries instead.

Layout of one lock on `key` under the default KEY_PREFIX, "keel-lock:" (a prefix that does not
end with ":" gets one, so "keel-lock" gives the same names):
    keel-lock:{key}        hash: o = owner, h = holder, f = fence, t = acquired (ms), with PX
    keel-lock:{key}:fence  the key's last fence, kept a day after its last acquisition
    keel-lock:released:key pub/sub channel a release publishes on; a process subscribes to it
                           only while one of its threads or tasks waits for `key`
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
import re
import ssl
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from ...exceptions import LockStoreUnavailable
from ..base import AcquireResult, LockInfo, LockStore, PerThread, ReleaseListener, SocketCheck

try:
    import redis
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.exceptions import NoScriptError, RedisClusterException, RedisError
    from redis.retry import Retry
    from redis.sentinel import (
        SentinelConnectionPool,
        SentinelManagedConnection,
        SentinelManagedSSLConnection,
    )
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImproperlyConfigured(
        "RedisLockStore needs redis-py: pip install 'django-keel-lock[redis]'"
    ) from exc

logger = logging.getLogger("django_keel_lock")

DEFAULT_PREFIX = "keel-lock:"
PAGE_SIZE = 500
# Plain URL connections: fail fast instead of hanging a request on a dead server.
SOCKET_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
# Async pools: many concurrent tasks queue for a connection (up to this many seconds) instead of
# failing with "too many connections", which would look like an outage.
POOL_WAIT = 5
LOOP_CLIENTS = "_django_keel_lock_redis_clients"
# What a failing server raises; a cluster rediscovering its nodes raises a plain
# RedisClusterException (not a RedisError) that is an outage too.
STORE_ERRORS = (RedisError, RedisClusterException)
# The listener pings when the channel has been quiet this long, and reconnects when even the
# ping goes unanswered for LISTEN_DEAD seconds: a silently dead link must not keep
# `push_wakeups` True.
LISTEN_PING = 5.0
LISTEN_DEAD = 15.0


class _Script(NamedTuple):
    text: str
    sha: str


def _script(text: str) -> _Script:
    return _Script(text, hashlib.sha1(text.encode()).hexdigest())


# KEYS[1] lock hash, KEYS[2] fence counter; ARGV owner, holder, ttl ms.
# One integer back (cheaper to parse than an array): the fence (> 0) when acquired; when
# someone else holds it, -(pttl + 1) (0 if the key has no expiry). The same owner gets its
# acquisition back (same fence, ttl renewed): a retry after a lost reply is safe.
ACQUIRE = _script(
    """
local current = redis.call('HGET', KEYS[1], 'o')
if current then
    if current ~= ARGV[1] then
        local pttl = redis.call('PTTL', KEYS[1])
        if pttl < 0 then
            return 0
        end
        return -(pttl + 1)
    end
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return tonumber(redis.call('HGET', KEYS[1], 'f'))
end
local now = redis.call('TIME')
-- The fence is one more than the key's last one, and never below the server's clock in
-- microseconds. So the counter may vanish (it expires a day after the key's last acquisition,
-- or with a Redis restarted without persistence) and fences still only go up: acquisitions
-- of one key are at least a round trip apart, far more than a microsecond.
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local fence = math.max(last + 1, now[1] * 1000000 + now[2])
redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', math.max(tonumber(ARGV[3]), 86400000))
redis.call('HSET', KEYS[1], 'o', ARGV[1], 'h', ARGV[2], 'f', fence,
           't', tostring(now[1] * 1000 + math.floor(now[2] / 1000)))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return fence
"""
)

# KEYS[1] lock hash; ARGV owner, the key's release channel. 1 if released (and announced).
RELEASE = _script(
    """
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', ARGV[2], '1')
    return 1
end
return 0
"""
)

# KEYS[1] lock hash; ARGV owner, ttl ms. Expiry becomes max(current, now + ttl): never shorter.
EXTEND = _script(
    """
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
    end
    return 1
end
return 0
"""
)

# KEYS[1] lock hash. {owner, holder, fence, acquired ms, pttl} read atomically, or nil.
GET = _script(
    """
local v = redis.call('HMGET', KEYS[1], 'o', 'h', 'f', 't')
if not v[1] then
    return false
end
return {v[1], v[2], v[3], v[4], redis.call('PTTL', KEYS[1])}
"""
)

SCRIPTS = (ACQUIRE, RELEASE, EXTEND, GET)

_ESCAPES = {"%": "%25", "{": "%7B", "}": "%7D"}
_UNESCAPES = {code: char for char, code in _ESCAPES.items()}
_ESCAPE_RE = re.compile(r"[%{}]")
_UNESCAPE_RE = re.compile(r"%(?:25|7B|7D)")
_GLOB_RE = re.compile(r"([*?\[\]\\])")


def _escape(key: str) -> str:
    """`key` without braces, so it fits inside a hash tag. A prefix code: escaping keeps
    "starts with" intact, which iter_locks' SCAN MATCH relies on."""
    if "%" not in key and "{" not in key and "}" not in key:  # the usual key: no regex
        return key
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group()], key)


def _unescape(text: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPES[m.group()], text)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _seconds(pttl: Any) -> float | None:
    millis = int(pttl)
    return None if millis < 0 else millis / 1000.0


# Connection settings an async pool can take over from a sync pool unchanged.
_PORTABLE_KWARGS = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "client_name",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "health_check_interval",
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_check_hostname",
    }
)


class RedisLockStore(LockStore):
    """Locks in Redis (OPTIONS: CONNECTION or URL, KEY_PREFIX, CLUSTER).

    KEY_PREFIX (default "keel-lock:") starts every key and channel name; a ":" is added to a
    prefix that does not end with one, so "locks" and "locks:" both give locks:{invoice:42}
    ("" is no prefix at all).

    CONNECTION names a django-redis cache alias whose client and pool are reused (Sentinel
    included); URL is a plain redis-py URL (`?socket_timeout=1` etc. honoured), and CLUSTER=True
    makes it a RedisCluster.
    """

    option_names = frozenset({"CONNECTION", "URL", "KEY_PREFIX", "CLUSTER"})
    expires_by_itself = True  # each lock is a key with a PEXPIRE: Redis deletes it at its ttl

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        connection = self.options.get("CONNECTION")
        url = self.options.get("URL")
        if (connection is None) == (url is None):
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS needs exactly one of CONNECTION (a "
                f"django-redis CACHES alias) or URL (redis://host:port/db)"
            )
        if connection is not None and not isinstance(connection, str):
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS CONNECTION must be a CACHES alias (str)"
            )
        if url is not None and not isinstance(url, str):
            raise ImproperlyConfigured(f"KEEL_LOCK_STORES[{alias!r}] OPTIONS URL must be a str")
        prefix = self.options.get("KEY_PREFIX", DEFAULT_PREFIX)
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            # The prefix sits outside the hash tag; a brace in it would move the tag.
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS KEY_PREFIX must be a str without "
                f"braces, got {prefix!r}"
            )
        self.connection_alias: str | None = connection
        self.url: str | None = url
        self.cluster = bool(self.options.get("CLUSTER", False))
        if self.cluster and url is None:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS CLUSTER needs URL (a node of the cluster)"
            )
        # Joined to the rest of the key by ":", as Django's cache joins its KEY_PREFIX: "locks"
        # and "locks:" name the same keys (locks:{invoice:42}).
        if prefix and not prefix.endswith(":"):
            prefix += ":"
        self.prefix = prefix
        self.channel = f"{prefix}released"
        self._mutex = threading.Lock()
        self._client_obj: Any = None
        self._client_pid = 0
        self._owns_client = url is not None
        self._generation = 0  # bumped by close(): async clients made before are not reused
        self._async_factory: Callable[[], Any] | None = None
        self._async_checked = False
        self._threads: PerThread[_Direct] = PerThread(_Direct.close)
        self._direct_possible: bool | None = None  # decided on first use, per client

    # -- connections ----------------------------------------------------------------------
    def _where(self) -> str:
        if self.url is not None:
            return f"URL {redis.connection.parse_url(self.url).get('host', '?')}"
        return f"CACHES[{self.connection_alias!r}]"

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
        return {
            "socket_timeout": SOCKET_TIMEOUT,
            "socket_connect_timeout": CONNECT_TIMEOUT,
        }

    def _build_client(self) -> Any:
        if self.url is not None:
            if self.cluster:
                # No command retries here either; a node that fails still makes the client
                # rediscover the cluster before the error reaches us, so the next call goes
                # to the new master.
                return _no_cluster_retries(
                    redis.RedisCluster.from_url(
                        self.url, retry=Retry(NoBackoff(), 0), **self._url_kwargs()
                    )
                )
            return redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **self._url_kwargs())
        from django_redis import get_redis_connection

        try:
            return get_redis_connection(self.connection_alias or "default", write=True)
        except NotImplementedError:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{self.alias!r}] CONNECTION {self.connection_alias!r} is not "
                f"a django-redis cache (BACKEND django_redis.cache.RedisCache)"
            ) from None

    def release_channel(self, key: str) -> str:
        """Where a release of `key` is announced: one channel per key, so a process hears only
        about the keys it waits for, not every release in the whole Redis."""
        return f"{self.channel}:{key}"

    def _names(self, key: str) -> tuple[str, str]:
        lock_name = f"{self.prefix}{{{_escape(key)}}}"
        return lock_name, lock_name + ":fence"

    def _run(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            direct = self._direct()
            if direct is not None:
                return direct.evalsha(script, keys, args)
            client = self._client()
            try:
                return client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                # A new or restarted server: load every script now, so no later call of
                # another script meets NOSCRIPT (an extra round trip in a critical moment).
                for each in SCRIPTS:
                    client.script_load(each.text)
                return client.evalsha(script.sha, len(keys), *keys, *args)
        except (*STORE_ERRORS, OSError) as exc:
            raise self._unavailable(exc) from exc

    def _direct(self) -> _Direct | None:
        """This thread's own connection for the scripts, when the client is a plain one."""
        direct = self._threads.get()
        if direct is not None or self._direct_possible is False:
            return direct
        client = self._client()
        pool: Any = getattr(client, "connection_pool", None)
        connection_class = getattr(pool, "connection_class", None)
        self._direct_possible = type(client) is redis.Redis and (
            (
                type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
                and connection_class in _DIRECT_CONNECTIONS
            )
            or (
                # Its connections find the master through the pool (in connection_kwargs),
                # asking the sentinels again whenever they reconnect.
                isinstance(pool, SentinelConnectionPool)
                and pool.is_master
                and connection_class in _SENTINEL_CONNECTIONS
            )
        )
        if not self._direct_possible:
            return None
        return self._threads.put(_Direct(pool.connection_class(**pool.connection_kwargs)))

    # -- the protocol ---------------------------------------------------------------------
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        reply = self._run(ACQUIRE, self._names(key), (owner, holder, _ms(ttl)))
        return self._acquired(reply)

    def release(self, key: str, owner: str) -> bool:
        names = self._names(key)
        released = bool(self._run(RELEASE, names[:1], (owner, self.release_channel(key))))
        if released:
            self.wake_board.wake(key)  # our own waiters need not wait for the pub/sub echo
        return released

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        return bool(self._run(EXTEND, self._names(key)[:1], (owner, _ms(ttl))))

    def get(self, key: str) -> LockInfo | None:
        reply = self._run(GET, self._names(key)[:1], ())
        return None if reply is None else self._info(key, *reply)

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Live locks under `prefix`, in key order. SCAN collects only the key names (sorting
        needs them all); the locks themselves are read a page at a time."""
        start = f"{self.prefix}{{"
        pattern = _GLOB_RE.sub(r"\\\1", start + _escape(prefix)) + "*"
        client = self._client()
        try:
            keys = sorted(
                _unescape(name[len(start) : -1])
                for name in map(_text, client.scan_iter(match=pattern, count=PAGE_SIZE))
                if name.endswith("}") and name.startswith(start)
            )
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        for first in range(0, len(keys), PAGE_SIZE):
            page = keys[first : first + PAGE_SIZE]
            try:
                pipe = client.pipeline(transaction=False)
                for key in page:
                    name = self._names(key)[0]
                    pipe.hmget(name, "o", "h", "f", "t")
                    pipe.pttl(name)
                replies = pipe.execute()
            except STORE_ERRORS as exc:
                raise self._unavailable(exc) from exc
            for index, key in enumerate(page):
                fields, pttl = replies[2 * index], replies[2 * index + 1]
                # Released or expired between SCAN and now, or caught mid-change: skip.
                if fields[0] is None or fields[2] is None or int(pttl) <= 0:
                    continue
                owner, holder, fence, acquired = fields
                yield self._info(key, owner, holder, fence, acquired, pttl)

    @staticmethod
    def _acquired(reply: Any) -> AcquireResult:
        value = int(reply)
        if value > 0:
            return AcquireResult(value)
        return AcquireResult(None, None if value == 0 else (-value - 1) / 1000.0)

    @staticmethod
    def _info(key: str, owner: Any, holder: Any, fence: Any, acquired: Any, pttl: Any) -> LockInfo:
        acquired_at = (
            None if acquired is None else datetime.fromtimestamp(int(acquired) / 1000.0, tz=UTC)
        )
        return LockInfo(
            key=key,
            owner=_text(owner),
            holder=_text(holder) if holder is not None else "",
            fence=int(fence),
            acquired_at=acquired_at,
            expires_in=max(0.0, _seconds(pttl) or 0.0),
        )

    # -- wake-ups -------------------------------------------------------------------------
    @property
    def push_wakeups(self) -> bool:
        return self.listener_ready()

    def watch(self, key: str) -> Any:
        self.ensure_listener(lambda: _RedisListener(self))
        return self.wake_board.watch(key)

    def close(self) -> None:
        self.stop_listener()
        self._threads.close_all()
        with self._mutex:
            self._direct_possible = None
            client, self._client_obj = self._client_obj, None
            pid, self._client_pid = self._client_pid, 0
            self._generation += 1
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
    def _loop_client(self) -> Any:
        """This loop's client for this store, or None when it has to be made (the fast path:
        one lookup, no await)."""
        clients: _LoopClients | None = getattr(asyncio.get_running_loop(), LOOP_CLIENTS, None)
        if clients is not None:
            made = clients.made.get(self)
            if made is not None and made[0] == self._generation:
                return made[1]
        return None

    async def _new_loop_client(self) -> tuple[Any, bool]:
        """A new client for this loop and store, and whether the loop keeps it (False: the
        loop would never close it, so the caller closes it after its call)."""
        factory = self._async_client_factory()
        assert factory is not None  # only called when _native_async()
        loop = asyncio.get_running_loop()
        clients: _LoopClients | None = getattr(loop, LOOP_CLIENTS, None)
        if clients is None:
            clients = _LoopClients()
            if await clients.close_at_shutdown_of(loop):
                setattr(loop, LOOP_CLIENTS, clients)
        try:
            client = factory()
        except Exception as exc:
            raise self._unavailable(exc) from exc
        if clients.closer is None:
            return client, False
        stale = clients.made.get(self)  # made before close(): not to be used again
        clients.made[self] = (self._generation, client)
        if stale is not None:
            await _aclose(stale[1])
        return client, True

    def _async_client_factory(self) -> Callable[[], Any] | None:
        """How to make an async client talking to the same server, or None when only the
        sync client knows how (then the async methods run it in a thread)."""
        if self._async_checked:
            return self._async_factory
        factory: Callable[[], Any] | None = None
        if self.url is not None:
            url, kwargs = self.url, self._url_kwargs()
            if self.cluster:
                factory = lambda: _no_cluster_retries(  # noqa: E731
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
            factory = _async_twin(self._client())
        self._async_factory, self._async_checked = factory, True
        return factory

    async def _arun(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        client, kept = self._loop_client(), True
        if client is None:
            client, kept = await self._new_loop_client()
        try:
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                for each in SCRIPTS:
                    await client.script_load(each.text)
                return await client.evalsha(script.sha, len(keys), *keys, *args)
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        except OSError as exc:  # asyncio can surface raw socket errors on connect
            raise self._unavailable(exc) from exc
        finally:
            if not kept:
                await _aclose(client)

    def _native_async(self) -> bool:
        return self._async_client_factory() is not None

    async def aacquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        if not self._native_async():
            return await super().aacquire(key, owner, holder, ttl)
        reply = await self._arun(ACQUIRE, self._names(key), (owner, holder, _ms(ttl)))
        return self._acquired(reply)

    async def arelease(self, key: str, owner: str) -> bool:
        if not self._native_async():
            return await super().arelease(key, owner)
        reply = await self._arun(RELEASE, self._names(key)[:1], (owner, self.release_channel(key)))
        if reply:
            self.wake_board.wake(key)
        return bool(reply)

    async def aextend(self, key: str, owner: str, ttl: float) -> bool:
        if not self._native_async():
            return await super().aextend(key, owner, ttl)
        return bool(await self._arun(EXTEND, self._names(key)[:1], (owner, _ms(ttl))))

    async def aget(self, key: str) -> LockInfo | None:
        if not self._native_async():
            return await super().aget(key)
        reply = await self._arun(GET, self._names(key)[:1], ())
        return None if reply is None else self._info(key, *reply)


# Connection classes a thread's own script connection may be made of: their settings are all
# in the pool's connection_kwargs (for Sentinel's, that includes the pool, to find the master).
_DIRECT_CONNECTIONS = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
)
_SENTINEL_CONNECTIONS = (SentinelManagedConnection, SentinelManagedSSLConnection)


def _pack(*args: str | bytes | int) -> bytes:
    """One command in RESP: an array of bulk strings (str as UTF-8, as redis-py sends it)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Direct:
    """One thread's own connection, on which the scripts run with nothing in between: no pool
    to check a connection out of and back in, no command retries, no response callbacks."""

    __slots__ = ("check", "connection")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.check = SocketCheck()

    def evalsha(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        conn = self.connection
        try:
            self._ready()
            try:
                return self._call(_pack(b"EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:
                for each in SCRIPTS:  # a new or restarted server, as in RedisLockStore._run
                    self._call(_pack(b"SCRIPT", b"LOAD", each.text))
                return self._call(_pack(b"EVALSHA", script.sha, len(keys), *keys, *args))
        except BaseException:
            # Whatever it was in the middle of is not to be continued: after an interruption
            # (a task's time limit, Ctrl-C) an unread reply would answer the next call.
            conn.disconnect()
            raise

    def _ready(self) -> None:
        """Before sending: a connection with something to read is stale (the server closed it,
        or restarted): reconnect now, while nothing of this call has been sent. Connecting
        goes through connect(), where a Sentinel connection asks where the master is."""
        sock = getattr(self.connection, "_sock", None)
        if sock is not None and self._stale(sock):
            self.connection.disconnect()
            sock = None
        if sock is None:
            self.connection.connect()

    def _stale(self, sock: Any) -> bool:
        if isinstance(sock, ssl.SSLSocket):  # TLS records are not replies: ask redis-py
            return self._stale_by_redis_py()
        return self.check.readable(sock.fileno())

    def _stale_by_redis_py(self) -> bool:
        try:
            return bool(self.connection.can_read())
        except (*STORE_ERRORS, OSError):
            return True

    def _call(self, packed: bytes) -> Any:
        self.connection.send_packed_command([packed])
        return self.connection.read_response()

    def close(self) -> None:
        self.connection.disconnect()


class _LoopClients:
    """The async clients one event loop made (store -> (generation, client)), and the async
    generator that closes them when the loop shuts down."""

    __slots__ = ("closer", "made")

    def __init__(self) -> None:
        self.made: dict[RedisLockStore, tuple[int, Any]] = {}
        self.closer: AsyncGenerator[None, None] | None = None

    async def close_at_shutdown_of(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Start the closer on `loop`; False if the loop would not close it (it tracks only
        the async generators started while its own hooks are installed)."""
        firstiter = sys.get_asyncgen_hooks().firstiter
        if getattr(firstiter, "__self__", None) is not loop:
            return False
        self.closer = self._close_all()  # referenced here: the loop's own set of them is weak
        await anext(self.closer)
        return True

    async def _close_all(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            while self.made:
                _, (_, client) = self.made.popitem()
                await _aclose(client)


async def _aclose(client: Any) -> None:
    """Close an async client and its pool (a pool given to a client is not closed with it
    otherwise), and for Sentinel the connections to the sentinels too."""
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    closers = [client, *getattr(manager, "sentinels", ())]
    for each in closers:
        try:
            close = getattr(each, "aclose", None) or each.close  # redis-py 5.0.0: close()
            if isinstance(each, redis.asyncio.RedisCluster):
                await close()
            else:
                await close(close_connection_pool=True)
        except Exception as exc:  # closing: an unreachable server has nothing left to close
            logger.debug("closing an async Redis client failed: %r", exc)


def _async_twin(client: Any) -> Callable[[], Any] | None:
    """A factory for an async client on the same server as the sync `client` (plain pools and
    Sentinel pools), or None for pools we cannot reproduce."""
    from redis.asyncio import connection as aconn
    from redis.asyncio import sentinel as asentinel

    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in _PORTABLE_KWARGS}
    retry = AsyncRetry(NoBackoff(), 0)
    if isinstance(pool, SentinelConnectionPool):
        sentinels = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in pool.sentinel_manager.sentinels
        ]
        service = pool.service_name
        kwargs.pop("host", None)
        kwargs.pop("port", None)

        def sentinel_client() -> Any:
            manager = asentinel.Sentinel(sentinels, socket_timeout=kwargs.get("socket_timeout"))
            return manager.master_for(service, retry=retry, **kwargs)

        return sentinel_client
    classes: dict[type, type] = {
        redis.connection.Connection: aconn.Connection,
        redis.connection.SSLConnection: aconn.SSLConnection,
        redis.connection.UnixDomainSocketConnection: aconn.UnixDomainSocketConnection,
    }
    connection_class = classes.get(pool.connection_class)
    if type(pool) is not redis.ConnectionPool or connection_class is None:
        return None

    def plain_client() -> Any:
        apool = aconn.BlockingConnectionPool(
            connection_class=connection_class, retry=retry, timeout=POOL_WAIT, **kwargs
        )
        return redis.asyncio.Redis(connection_pool=apool)

    return plain_client


class _RedisListener(ReleaseListener):
    """One pub/sub connection per process, subscribed to the release channel of each key this
    process waits for, and to the store's base channel, which keeps the connection up and
    tells when it is.

    It reads the connection with redis-py's parser but without its PubSub object, whose
    per-message bookkeeping (retries, handlers, dicts) took ~0.2 ms between a release arriving
    and the waiter being woken.
    """

    store: RedisLockStore

    def listen(self) -> None:
        store = self.store
        pool = _pubsub_pool(store._client())
        conn = _borrow(pool)
        prefix = store.channel + ":"
        # RESP3 delivers messages as pushes, which read_response() returns only when asked to
        # (older redis-py's Sentinel connections do not even take the argument).
        resp3 = str(getattr(conn, "protocol", 2)) == "3"
        read: dict[str, Any] = {"push_request": True} if resp3 else {}

        def subscribe(keys: list[str]) -> None:
            conn.send_packed_command([_pack(b"SUBSCRIBE", *map(store.release_channel, keys))])

        def unsubscribe(keys: list[str]) -> None:
            conn.send_packed_command([_pack(b"UNSUBSCRIBE", *map(store.release_channel, keys))])

        subscribed: set[str] = set()
        try:
            conn.send_packed_command([_pack(b"SUBSCRIBE", store.channel)])
            self.take_changes()
            self.settle(subscribed, set(store.wake_board.watched_keys()), subscribe, unsubscribe)
            heard = pinged = time.monotonic()
            while not self.stopping.is_set():
                sock = getattr(conn, "_sock", None)
                if sock is None:
                    raise ConnectionError("the pub/sub connection is closed")
                # Everything read so far was handled (the loop below drains redis-py's
                # buffer), so anything new shows up on the socket.
                data, poked = self.wait(sock.fileno(), 1.0)
                if poked:
                    self.settle(subscribed, self.take_changes(), subscribe, unsubscribe)
                now = time.monotonic()
                if data:
                    heard = now
                    # Waiting for a single key, whatever arrived is almost surely its release:
                    # wake its waiters before parsing (they re-check the lock either way; a
                    # PONG costs one needless attempt every LISTEN_PING seconds).
                    single = subscribed if len(subscribed) == 1 else ()
                    for key in single:
                        store.wake_board.wake(key)
                    while True:
                        self._handle(conn.read_response(**read), prefix)
                        if not conn.can_read(timeout=0):
                            break
                elif now - heard > LISTEN_DEAD:
                    raise ConnectionError("no reply to PING on the release channel")
                elif now - heard > LISTEN_PING and now - pinged > LISTEN_PING:
                    conn.send_packed_command([_pack(b"PING")])
                    pinged = now
        finally:
            self.ready.clear()
            try:
                conn.disconnect()  # subscribed: unusable for anything else
                pool.release(conn)
            except Exception:
                pass

    def _handle(self, reply: Any, prefix: str) -> None:
        """One pub/sub reply: [kind, channel, payload or count]; anything else (a PONG) only
        proves the connection alive."""
        if not isinstance(reply, list) or len(reply) < 2:
            return
        board = self.store.wake_board
        kind, channel = _text(reply[0]), _text(reply[1])
        if kind == "message" and channel.startswith(prefix):
            board.wake(channel[len(prefix) :])
        elif kind == "subscribe":
            if channel.startswith(prefix):
                # Redis confirms: from now on the key's releases reach us. One may have come
                # just before, on another connection: its waiters look again.
                board.wake(channel[len(prefix) :])
            else:
                self.ready.set()
                board.wake_all()  # a release may have happened while we were (re)connecting


def _no_cluster_retries(client: Any) -> Any:
    """`client` with no command retries: redis-py 6 and later count them in its `retry`
    (given at construction); earlier versions in this attribute."""
    if hasattr(client, "cluster_error_retry_attempts"):
        client.cluster_error_retry_attempts = 0
    return client


def _borrow(pool: Any) -> Any:
    """A connection from `pool` (redis-py before 5.3 asks for a command name; later versions
    warn when given one)."""
    parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return pool.get_connection("SUBSCRIBE")
    return pool.get_connection()


def _pubsub_pool(client: Any) -> Any:
    """The pool to borrow the listener's connection from: the client's own (a Sentinel pool
    hands out a master connection), or for a cluster its default node's. A release PUBLISHes
    to every node of a cluster, so any node hears it."""
    if isinstance(client, redis.RedisCluster):
        node: Any = client.get_default_node()
        return node.redis_connection.connection_pool
    return client.connection_pool
