"""The stores a chaos run can target: each starts what it needs (its own redis-server, cluster
or sentinel; a database of the run's own behind a fault proxy), says how the run's processes
reach it (Django settings) and which store faults the nemesis may inject.

Store faults touch only what the run started or owns: its own redis-servers, its proxy, and on
PostgreSQL and MariaDB the store's own sessions (by application_name, or by the database only
the run uses), never other sessions of the shared servers.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from tests.support.redis_servers import (
    FaultyProxy,
    RedisServer,
    master_of,
    redis_cluster,
    redis_sentinel,
    wait_for,
)

DATABASE = "keel_lock_chaos"
PG: dict[str, Any] = {
    "HOST": os.environ.get("PGHOST", "127.0.0.1"),
    "PORT": int(os.environ.get("PGPORT", "5432")),
    "USER": os.environ.get("PGUSER", "postgres"),
}
MY: dict[str, Any] = {
    "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
    "PORT": int(os.environ.get("MYSQL_PORT", "3306")),
    "USER": os.environ.get("MYSQL_USER", "root"),
}
#: Every store call gives up after this long: faults turn into LockStoreUnavailable quickly.
SOCKET_TIMEOUT = 1.0
#: A fault's log entry: the nemesis adds its kind and times.
Fault = Callable[[random.Random], dict[str, Any]]


def resource_database(run: str, name: str) -> dict[str, Any]:
    """The fenced resource's database: PostgreSQL, reached directly (never through a proxy
    and never faulted: it is the judge), its sessions named apart from the store's."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        **PG,
        "NAME": name,
        "OPTIONS": {"application_name": f"keel-chaos-resource-{run}"},
    }


def postgres_admin(sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """`sql`'s rows, run on PostgreSQL's own database in a session of its own (autocommit)."""
    import psycopg

    with psycopg.connect(
        host=PG["HOST"], port=PG["PORT"], user=PG["USER"], dbname="postgres", autocommit=True
    ) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


@contextmanager
def postgres_database(name: str) -> Iterator[None]:
    """A PostgreSQL database `name` for as long as the block runs, dropped after it with any
    session still on it."""
    postgres_admin(f"CREATE DATABASE {name}")
    try:
        yield
    finally:
        postgres_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Target:
    """A store under test: `open()` brings its servers up and returns the store's and the
    databases' settings; `faults` the store faults it supports; `close()` stops what it started."""

    name = ""
    #: Workers are threads of the run's own process (the memory store lives in one process).
    threads = False
    #: The store has semaphores (the run's semaphore keys are left out where it has not).
    modes = True

    def __init__(self, run: str) -> None:
        self.run = run
        #: The run's own database on each server it uses, so that runs side by side (CI's two
        #: passes) share no table: one run's schema set-up once deadlocked another's writes.
        self.database = f"{DATABASE}_{run.replace('-', '_')}"
        self.stack = ExitStack()
        self.faults: dict[str, Fault] = {}

    def open(self) -> dict[str, Any]:
        """The run's PostgreSQL database (the resource's), then the store's servers."""
        self.stack.enter_context(postgres_database(self.database))
        return self.start()

    def start(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        self.stack.close()

    def settings(self, config: dict[str, Any], **databases: dict[str, Any]) -> dict[str, Any]:
        """The run's settings: the store's `config` (a KEEL_LOCK_STORES entry) and the
        resource's database next to `databases` (the store's, as "store")."""
        default = resource_database(self.run, self.database)
        return {"store": config, "databases": {"default": default, **databases}}

    def add_proxy(self, port: int) -> FaultyProxy:
        """A FaultyProxy in front of `port`, with its stall and drop faults."""
        proxy = FaultyProxy(port)
        self.stack.callback(proxy.close)

        def stall(rng: random.Random) -> dict[str, Any]:
            proxy.mode = "stall"
            time.sleep(rng.uniform(0.5, 3 * SOCKET_TIMEOUT))
            proxy.mode = "pass"
            return {}

        def drop(rng: random.Random) -> dict[str, Any]:
            proxy.drop_connections()
            return {}

        self.faults.update(proxy_stall=stall, proxy_drop=drop)
        return proxy


class Memory(Target):
    name = "memory"
    threads = True

    def start(self) -> dict[str, Any]:
        return self.settings({"BACKEND": "django_keel_lock.stores.MemoryLockStore"})


class SQLite(Target):
    name = "sqlite"

    def start(self) -> dict[str, Any]:
        folder = tempfile.mkdtemp(prefix="keel-chaos-sqlite-")
        path = os.path.join(folder, "locks.sqlite3")
        self.stack.callback(shutil.rmtree, folder, ignore_errors=True)
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": path}
        return self.settings(_db_store(), store=database)


def _db_store(**options: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": "store", "SOCKET_TIMEOUT": SOCKET_TIMEOUT, **options},
    }


class Postgres(Target):
    name = "postgres"
    durable = True

    def start(self) -> dict[str, Any]:
        proxy = self.add_proxy(PG["PORT"])
        application = f"keel-chaos-store-{self.run}"

        def terminate(rng: random.Random) -> dict[str, Any]:
            rows = postgres_admin(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s",
                [application],
            )
            return {"sessions": len(rows)}

        self.faults["terminate_sessions"] = terminate
        database = _behind(
            proxy, "postgresql", PG["USER"], self.database, application_name=application
        )
        return self.settings(_db_store(DURABLE=self.durable), store=database)


class PostgresFast(Postgres):
    name = "postgres-fast"
    durable = False


class MariaDB(Target):
    name = "mariadb"

    def start(self) -> dict[str, Any]:
        import MySQLdb

        # The store's sessions are the ones on the run's own database.
        name = self.database
        admin = {"host": MY["HOST"], "port": MY["PORT"], "user": MY["USER"], "passwd": ""}

        def execute(sql: str) -> None:
            conn = MySQLdb.connect(**admin)
            try:
                conn.cursor().execute(sql)
            finally:
                conn.close()

        execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
        self.stack.callback(execute, f"DROP DATABASE IF EXISTS {name}")
        proxy = self.add_proxy(MY["PORT"])

        def kill(rng: random.Random) -> dict[str, Any]:
            conn = MySQLdb.connect(**admin)
            try:
                cursor = conn.cursor()
                cursor.execute(
                    "SELECT ID FROM information_schema.PROCESSLIST "
                    "WHERE DB = %s AND ID <> CONNECTION_ID()",
                    [name],
                )
                ids = [row[0] for row in cursor.fetchall()]
                for session in ids:
                    try:
                        cursor.execute(f"KILL {int(session)}")
                    except MySQLdb.OperationalError:
                        pass  # it ended meanwhile
            finally:
                conn.close()
            return {"sessions": len(ids)}

        self.faults["kill_sessions"] = kill
        database = _behind(proxy, "mysql", MY["USER"], name, charset="utf8mb4")
        return self.settings(_db_store(), store=database)


def _behind(
    proxy: FaultyProxy, vendor: str, user: str, name: str, **options: Any
) -> dict[str, Any]:
    """The store's database, reached through `proxy`."""
    return {
        "ENGINE": f"django.db.backends.{vendor}",
        "HOST": "127.0.0.1",
        "PORT": proxy.port,
        "USER": user,
        "NAME": name,
        "OPTIONS": options,
    }


def _restart(server: RedisServer) -> Fault:
    """Kill `server` (SIGKILL: it forgets everything, there is no persistence) and start it
    again on its port after a moment."""

    def restart(rng: random.Random) -> dict[str, Any]:
        server.kill()
        time.sleep(rng.uniform(0.2, 2.0))
        server.start()
        return {"port": server.port}

    return restart


class Redis(Target):
    name = "redis"

    def start(self) -> dict[str, Any]:
        server = RedisServer().start()
        self.stack.callback(server.stop)
        proxy = self.add_proxy(server.port)
        self.faults["server_restart"] = _restart(server)
        return self.settings(_redis_store(proxy.url))


def _redis_store(url: str, **options: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_keel_lock.stores.RedisLockStore",
        "OPTIONS": {"URL": url, "SOCKET_TIMEOUT": SOCKET_TIMEOUT, **options},
    }


class RedisCluster(Target):
    """Three masters, no replicas: a node restarted without persistence comes back (its
    nodes.conf keeps its slots) having forgotten its locks."""

    name = "redis-cluster"

    def start(self) -> dict[str, Any]:
        nodes = self.stack.enter_context(redis_cluster(3))

        def restart(rng: random.Random) -> dict[str, Any]:
            node = rng.choice(nodes)
            _restart(node)(rng)
            wait_for(lambda: "cluster_state:ok" in node.cli("cluster", "info"), what="the cluster")
            return {"port": node.port}

        self.faults["node_restart"] = restart
        return self.settings(_redis_store(nodes[0].url, CLUSTER=True))


class RedisSentinel(Target):
    """A master, a replica and a sentinel; the store finds the master through django-redis'
    SentinelClient. A failover promotes the replica: locks not yet replicated are lost, which
    the fenced resource must show as refused writes, never accepted stale ones.

    The servers refuse writes without a replica in sync (`GUARD`): after a failover that
    finds the old master alive (SENTINEL FAILOVER, a partition), Sentinel turns it into a
    replica only at its next look, up to 10 s later, and until then it goes on granting locks
    to the clients still connected to it. Without the guard ("redis-sentinel-plain") two
    holders of one lock for seconds, neither told, are what a failover does (rule 1)."""

    name = "redis-sentinel"
    service = "keelchaos"
    GUARD: tuple[str, ...] = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "1")

    def start(self) -> dict[str, Any]:
        setup = self.stack.enter_context(
            redis_sentinel(self.service, down_after_ms=1000, replicas=1)
        )
        servers = {server.port: server for server in (setup.master, *setup.replicas)}
        for server in servers.values():
            for name, value in zip(self.GUARD[::2], self.GUARD[1::2], strict=True):
                server.cli("config", "set", name.lstrip("-"), value)

        def current() -> RedisServer:
            port = master_of(setup.sentinel, self.service)
            assert port is not None
            return servers[port]

        def kill_master(rng: random.Random) -> dict[str, Any]:
            old = current()
            if "state=online" not in old.cli("info", "replication"):
                # Killed now, it would leave no master at all (Sentinel promotes only a
                # replica in sync): an outage, not a failover.
                raise RuntimeError("no replica in sync to fail over to")
            old.kill()
            try:
                wait_for(
                    lambda: master_of(setup.sentinel, self.service) != old.port,
                    seconds=60,
                    what="failover",
                )
            except RuntimeError:
                old.start()  # as it was, for the rest of the run
                raise
            new = current()
            time.sleep(rng.uniform(0.2, 1.0))
            old.extra = ["--replicaof", "127.0.0.1", str(new.port), *self.GUARD]
            old.start()
            return {"old": old.port, "new": new.port}

        def failover(rng: random.Random) -> dict[str, Any]:
            old = current()
            reply = setup.sentinel.cli("sentinel", "failover", self.service).strip()
            if reply != "OK":  # no replica it trusts yet (one restarted a moment ago)
                raise RuntimeError(f"SENTINEL FAILOVER refused: {reply}")
            wait_for(
                lambda: master_of(setup.sentinel, self.service) != old.port,
                seconds=60,
                what="failover",
            )
            return {"old": old.port, "new": current().port}

        self.faults.update(master_kill=kill_master, failover=failover)
        caches = {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "sentinel": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{self.service}/0",
                "OPTIONS": {
                    "CLIENT_CLASS": "django_redis.client.SentinelClient",
                    "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                    "SENTINELS": [("127.0.0.1", setup.sentinel.port)],
                    "SOCKET_TIMEOUT": SOCKET_TIMEOUT,
                    "SOCKET_CONNECT_TIMEOUT": SOCKET_TIMEOUT,
                },
            },
        }
        store = {
            "BACKEND": "django_keel_lock.stores.RedisLockStore",
            "OPTIONS": {"CONNECTION": "sentinel", "SOCKET_TIMEOUT": SOCKET_TIMEOUT},
        }
        return {**self.settings(store), "caches": caches}


class RedisSentinelPlain(RedisSentinel):
    name = "redis-sentinel-plain"
    GUARD = ()


class RedisSentinelWaits(RedisSentinelPlain):
    """redis-sentinel-plain with the store's MIN_REPLICAS 1: each acquire and extend waits
    for the replica (WAIT) and gives the lock back when it does not acknowledge."""

    name = "redis-sentinel-waits"

    def start(self) -> dict[str, Any]:
        settings = super().start()
        settings["store"]["OPTIONS"]["MIN_REPLICAS"] = 1
        return settings


class Etcd(Target):
    """A 3-member etcd cluster (tests/support/etcd.py), reached through a proxy in front of
    each member's client port. Faults: a member killed (the leader half the time) and
    restarted a moment later with its data; a member stopped (SIGSTOP) past the election
    timeout, then continued; a proxy stalled or its connections dropped (a member cut off from
    the clients). No semaphores: the store has none."""

    name = "etcd"
    modes = False

    def start(self) -> dict[str, Any]:
        from tests.support.etcd import etcd_cluster

        cluster = self.stack.enter_context(etcd_cluster())
        proxies = [FaultyProxy(member.client_port) for member in cluster.members]
        for proxy in proxies:
            self.stack.callback(proxy.close)

        def kill(rng: random.Random) -> dict[str, Any]:
            leader = rng.random() < 0.5
            member = cluster.leader() if leader else rng.choice(cluster.members)
            member.kill()
            time.sleep(rng.uniform(0.2, 2.0))
            cluster.restart(member)
            return {"member": member.name, "leader": leader}

        def pause(rng: random.Random) -> dict[str, Any]:
            member = rng.choice(cluster.members)
            member.pause()
            time.sleep(rng.uniform(0.5, 3.0))
            member.resume()
            return {"member": member.name}

        def stall(rng: random.Random) -> dict[str, Any]:
            proxy = rng.choice(proxies)
            proxy.mode = "stall"
            time.sleep(rng.uniform(0.5, 3 * SOCKET_TIMEOUT))
            proxy.mode = "pass"
            return {"port": proxy.port}

        def drop(rng: random.Random) -> dict[str, Any]:
            proxy = rng.choice(proxies)
            proxy.drop_connections()
            return {"port": proxy.port}

        self.faults.update(member_kill=kill, member_pause=pause, proxy_stall=stall, proxy_drop=drop)
        endpoints = [f"http://127.0.0.1:{proxy.port}" for proxy in proxies]
        store = {
            "BACKEND": "django_keel_lock.stores.EtcdLockStore",
            "OPTIONS": {"ENDPOINTS": endpoints, "SOCKET_TIMEOUT": SOCKET_TIMEOUT},
        }
        return self.settings(store)


TARGETS: dict[str, type[Target]] = {
    target.name: target
    for target in (
        Memory,
        SQLite,
        Postgres,
        PostgresFast,
        MariaDB,
        Redis,
        RedisCluster,
        RedisSentinel,
        RedisSentinelPlain,
        RedisSentinelWaits,
        Etcd,
    )
}
