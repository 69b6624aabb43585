"""redis-py as the store uses it: the import, the error classes, a thread's own script
connection, async clients per event loop, and the shims for redis-py versions."""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
import sys
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.core.exceptions import ImproperlyConfigured

from ..connections import SocketCheck
from .scripts import SCRIPTS, Script

try:
    import redis
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.crc import key_slot
    from redis.exceptions import NoScriptError, RedisClusterException, RedisError
    from redis.retry import Retry
    from redis.sentinel import (
        Sentinel,
        SentinelConnectionPool,
        SentinelManagedConnection,
        SentinelManagedSSLConnection,
    )
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImproperlyConfigured(
        "RedisLockStore needs redis-py: pip install 'django-keel-lock[redis]'"
    ) from exc

if TYPE_CHECKING:
    from .store import RedisLockStore

# redis-py's names the store uses come from here, after the import above had its chance to
# say what to install.
__all__ = [
    "CONNECT_TIMEOUT",
    "LOOP_CLIENTS",
    "POOL_WAIT",
    "SCRIPT_CONNECTIONS",
    "SENTINEL_CONNECTIONS",
    "STORE_ERRORS",
    "AsyncRetry",
    "LoopClient",
    "LoopClients",
    "NoBackoff",
    "NoScriptError",
    "Ready",
    "Retry",
    "ScriptConnection",
    "SentinelConnectionPool",
    "as_text",
    "async_twin",
    "borrow_connection",
    "close_sentinels",
    "key_slot",
    "pack_command",
    "pubsub_pool",
    "ready",
    "redis",
    "run_ready",
    "run_script",
    "sentinel_master_config",
    "timed_kwargs",
    "timed_master_pool",
    "without_cluster_retries",
]

logger = logging.getLogger("django_keel_lock")

# Connecting takes at most the shorter of this and OPTIONS SOCKET_TIMEOUT.
CONNECT_TIMEOUT = 2.0
# Async pools: many concurrent tasks queue for a connection (up to this many seconds) instead of
# failing with "too many connections", which would look like an outage.
POOL_WAIT = 5
LOOP_CLIENTS = "_django_keel_lock_redis_clients"
# What a failing server raises; a cluster rediscovering its nodes raises a plain
# RedisClusterException (not a RedisError) that is an outage too.
STORE_ERRORS = (RedisError, RedisClusterException)


def as_text(value: Any) -> str:
    """A reply's value as str: redis-py gives bytes, or str when decode_responses is on."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


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


# Connection classes a thread's own script connection may be made of: their settings are all
# in the pool's connection_kwargs (for Sentinel's, that includes the pool, to find the master).
SCRIPT_CONNECTIONS = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
)
SENTINEL_CONNECTIONS = (SentinelManagedConnection, SentinelManagedSSLConnection)


# Where a connection's settings say how long its socket waits. The orig_* ones (newer redis-py)
# are what a connection goes back to after a server's maintenance notice relaxed its timeouts.
_TIMEOUT_KWARGS = (
    "socket_timeout",
    "socket_connect_timeout",
    "orig_socket_timeout",
    "orig_socket_connect_timeout",
)


def timed_kwargs(kwargs: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """A copy of a pool's connection settings whose sockets wait at most `seconds` for
    anything (a shorter timeout of the pool's own is kept; None, no timeout, is not)."""
    timed = {"socket_timeout": None, "socket_connect_timeout": None, **kwargs}
    for name in _TIMEOUT_KWARGS:
        if name in timed:
            own = timed[name]
            timed[name] = seconds if own is None else min(float(own), seconds)
    return timed


def pack_command(*args: str | bytes | int) -> bytes:
    """One command in RESP: an array of bulk strings (str as UTF-8, as redis-py sends it)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


T = TypeVar("T")


async def run_script(
    script: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    evalsha: Callable[..., Awaitable[Any]],
    load: Callable[[str], Awaitable[Any]],
) -> Any:
    """Run `script` by its SHA (`evalsha(sha, numkeys, *keys, *args)`). A new or restarted
    server answers NOSCRIPT: then every script is loaded (`load(text)`) before this one runs
    again, so no later call of another script meets NOSCRIPT (an extra round trip in a
    critical moment).

    Written once for sync and async callers: an async one passes its client's coroutine
    methods and awaits it; a sync one passes calls that return `Ready` values and runs it
    with `run_ready`."""
    try:
        return await evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        for each in SCRIPTS:
            await load(each.text)
        return await evalsha(script.sha, len(keys), *keys, *args)


class Ready(Generic[T]):
    """An awaitable whose value is already there: awaiting it returns the value without
    suspending, so a coroutine that awaits only these runs to its end in one `run_ready`."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, T]:
        yield from ()
        return self.value


def ready(call: Callable[..., T]) -> Callable[..., Ready[T]]:
    """`call` (a sync client's method) as a function returning its value `Ready`."""
    return lambda *args: Ready(call(*args))


def run_ready(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to its end on this thread, with no event loop: it may await only
    `Ready` values (anything else would need a loop, and is an error)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("run_ready: the coroutine awaited something that is not Ready")


class ScriptConnection:
    """One thread's own connection, on which the scripts run with nothing in between: no pool
    to check a connection out of and back in, no command retries, no response callbacks."""

    __slots__ = ("check", "connection")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.check = SocketCheck()

    def evalsha(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        conn = self.connection
        try:
            self._ready()
            try:  # by its SHA, without `run_script`'s coroutine: the usual case, called cold
                return self._call(pack_command(b"EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:  # a new or restarted server: `run_script` loads them all
                return run_ready(run_script(script, keys, args, self._evalsha, self._load))
        except BaseException:
            # Whatever it was in the middle of is not to be continued: after an interruption
            # (a task's time limit, Ctrl-C) an unread reply would answer the next call.
            conn.disconnect()
            raise

    def call(self, *commands: bytes, errors_inline: bool = False) -> list[Any]:
        """Send packed `commands` at once and read their replies, in order; with
        `errors_inline`, a command the server refused (redis.ResponseError) has its error in
        its place instead of raising (the replies after it are still read)."""
        conn = self.connection
        try:
            self._ready()
            conn.send_packed_command(list(commands))
            return [self._reply(errors_inline) for _ in commands]
        except BaseException:  # as in evalsha: no unread reply may answer the next call
            conn.disconnect()
            raise

    def _reply(self, errors_inline: bool) -> Any:
        try:
            return self.connection.read_response()
        except redis.ResponseError as error:  # the whole reply was read: still in step
            if not errors_inline:
                raise
            return error

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

    def _evalsha(self, *args: str | bytes | int) -> Ready[Any]:
        return Ready(self._call(pack_command(b"EVALSHA", *args)))

    def _load(self, text: str) -> Ready[Any]:
        return Ready(self._call(pack_command(b"SCRIPT", b"LOAD", text)))

    def close(self) -> None:
        self.connection.disconnect()


class LoopClient:
    """One store's async client on one event loop, and how many calls are using it. A retired
    one takes no new calls and is closed by whichever call ends last (or at once if idle)."""

    __slots__ = (
        "__weakref__",
        "calls",
        "client",
        "closed",
        "generation",
        "loop",
        "owner",
        "retired",
    )

    def __init__(
        self,
        client: Any,
        generation: int,
        loop: asyncio.AbstractEventLoop,
        owner: LoopClients | None,
    ) -> None:
        self.client, self.generation, self.loop = client, generation, loop
        #: The loop's LoopClients that closes it at shutdown; None: closed after its call.
        self.owner = owner
        self.calls, self.closed, self.retired = 0, False, owner is None
        if owner is not None:
            owner.live.add(self)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.owner is not None:
                self.owner.live.discard(self)
            await _aclose(self.client)

    async def retire(self) -> None:
        """On its loop: no new calls; closed now if idle, else when its last call ends."""
        self.retired = True
        if self.calls == 0:
            await self.close()

    def retire_soon(self) -> None:
        """`retire` from any thread (its store was closed): on its loop, if that still runs."""
        self.retired = True
        try:
            self.loop.call_soon_threadsafe(self._retire_on_loop)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            pass

    def _retire_on_loop(self) -> None:
        if self.calls == 0 and not self.closed:
            task = self.loop.create_task(self.close())
            _CLOSING.add(task)  # the loop keeps only a weak reference to its tasks
            task.add_done_callback(_CLOSING.discard)


_CLOSING: set[asyncio.Task[None]] = set()


class LoopClients:
    """The async clients one event loop uses (weakly by store: a store the project replaced
    must not live on with the loop), and the async generator that closes them when the loop
    shuts down."""

    __slots__ = ("closer", "live", "made")

    def __init__(self) -> None:
        #: The client each store uses on this loop, found by store.
        self.made: weakref.WeakKeyDictionary[RedisLockStore, LoopClient] = (
            weakref.WeakKeyDictionary()
        )
        #: Every client made for this loop and not closed yet, its store alive or not.
        self.live: set[LoopClient] = set()
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

    @property
    def keeps(self) -> bool:
        """Whether a new client is kept for the loop's later calls."""
        return self.closer is not None

    async def _close_all(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            # The loop's other async generators are closed at the same time, and one may be
            # releasing a lock right now: a client in use closes when its call ends, and the
            # calls that come after get clients of their own, closed after each.
            self.closer = None
            self.made = weakref.WeakKeyDictionary()
            for each in list(self.live):
                await each.retire()


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


def async_twin(client: Any, socket_timeout: float) -> Callable[[], Any] | None:
    """A factory for an async client on the same server as the sync `client` (plain pools and
    Sentinel pools) whose sockets wait at most `socket_timeout`, or None for pools we cannot
    reproduce."""
    from redis.asyncio import connection as aconn
    from redis.asyncio import sentinel as asentinel

    pool = client.connection_pool
    portable = {k: v for k, v in pool.connection_kwargs.items() if k in _PORTABLE_KWARGS}
    kwargs = timed_kwargs(portable, socket_timeout)
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


def without_cluster_retries(client: Any) -> Any:
    """`client` with no command retries: redis-py 6 and later count them in its `retry`
    (given at construction); earlier versions in this attribute."""
    if hasattr(client, "cluster_error_retry_attempts"):
        client.cluster_error_retry_attempts = 0
    return client


def borrow_connection(pool: Any) -> Any:
    """A connection from `pool` (redis-py before 5.3 asks for a command name; later versions
    warn when given one)."""
    parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return pool.get_connection("SUBSCRIBE")
    return pool.get_connection()


def pubsub_pool(client: Any) -> Any:
    """The pool to borrow the listener's connection from: the client's own (a Sentinel pool
    hands out a master connection), or for a cluster its default node's. A release PUBLISHes
    to every node of a cluster, so any node hears it."""
    if isinstance(client, redis.RedisCluster):
        node: Any = client.get_default_node()
        return node.redis_connection.connection_pool
    return client.connection_pool


def timed_sentinels(manager: Any, seconds: float) -> Any:
    """A Sentinel manager for the sentinels that `manager` asks, on connections of its own
    without retries, whose sockets wait at most `seconds`: the manager's own may wait
    forever (no timeout before redis-py 8, or a longer one in SENTINEL_KWARGS)."""
    addresses = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in manager.sentinels
    ]
    return Sentinel(
        addresses,
        min_other_sentinels=manager.min_other_sentinels,
        force_master_ip=getattr(manager, "_force_master_ip", None),
        sentinel_kwargs={
            **timed_kwargs(manager.sentinel_kwargs, seconds),
            "retry": Retry(NoBackoff(), 0),
        },
    )


def timed_master_pool(pool: Any, seconds: float) -> Any:
    """A twin of the Sentinel master pool `pool` for a thread's own connections: they wait at
    most `seconds` on their sockets, and when they connect they find the master through
    `timed_sentinels`, not the pool's sentinels. Keep it while its connections live: they
    reach it through a weak reference."""
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    return SentinelConnectionPool(
        pool.service_name,
        timed_sentinels(pool.sentinel_manager, seconds),
        is_master=True,
        check_connection=getattr(pool, "check_connection", False),
        connection_class=pool.connection_class,
        **timed_kwargs(kwargs, seconds),
    )


def close_sentinels(manager: Any) -> None:
    """Close the connections of `manager`'s sentinel clients."""
    for each in manager.sentinels:
        each.close()


def sentinel_master_config(client: Any, pattern: str, seconds: float) -> dict[str, str] | None:
    """CONFIG GET `pattern` on the master that `client` writes to through Sentinel; None for a
    client that does not go through Sentinel.

    The sentinels and the master are asked on connections of our own, without retries, whose
    sockets wait at most `seconds` each time: the client's own may have no timeout at all.
    Raises what redis-py raises: ConnectionError (MasterNotFoundError included), TimeoutError,
    ResponseError (CONFIG renamed away, or not allowed for the user).
    """
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool) or not pool.is_master:
        return None
    no_retries = Retry(NoBackoff(), 0)
    sentinels = timed_sentinels(pool.sentinel_manager, seconds)
    try:
        host, port = sentinels.discover_master(pool.service_name)
    finally:
        close_sentinels(sentinels)
    # The pool's own connection class would ask the pool's sentinels again, on their sockets.
    ssl_class = issubclass(pool.connection_class, redis.connection.SSLConnection)
    connection_class = redis.connection.SSLConnection if ssl_class else redis.connection.Connection
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    kwargs.update(host=host, port=port, retry=no_retries)
    connection = connection_class(**timed_kwargs(kwargs, seconds))
    try:
        connection.connect()
        connection.send_command("CONFIG", "GET", pattern)
        reply = connection.read_response()
    finally:
        connection.disconnect()
    if isinstance(reply, Mapping):  # RESP3 answers with a map
        return {as_text(name): as_text(value) for name, value in reply.items()}
    values = [as_text(each) for each in reply]
    return dict(zip(values[::2], values[1::2], strict=True))
