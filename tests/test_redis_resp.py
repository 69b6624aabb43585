"""The release listener reads its subscribed connection's socket itself (`resp.Replies`): every
reply that has arrived whole, however the bytes were cut, in RESP2 and RESP3 alike; an error
reply, the end of the connection and what is not RESP raise; and a carried grant reaches its
waiter on a connection of either protocol."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from redis.exceptions import ResponseError

from django_keel_lock import lock
from django_keel_lock.stores.redis import RedisLockStore
from django_keel_lock.stores.redis.resp import Replies

from .conftest import needs_store, serving
from .test_database_faults import wait_until

MESSAGE = b"*3\r\n$7\r\nmessage\r\n$15\r\nkeel-lock:wake:\r\n$6\r\nfoobar\r\n"
PUSH = b">3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:3\r\n"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Replies]]:
    """(what the server writes to, the replies read on the other end)."""
    ours, server = socket.socketpair()
    try:
        yield server, Replies(ours)
    finally:
        ours.close()
        server.close()


def test_a_reply_cut_anywhere_is_read_once_it_has_arrived_whole(
    pair: tuple[socket.socket, Replies],
) -> None:
    server, replies = pair
    for cut in range(1, len(MESSAGE)):
        server.sendall(MESSAGE[:cut])
        assert replies.read() == []
        server.sendall(MESSAGE[cut:])
        assert replies.read() == [[b"message", b"keel-lock:wake:", b"foobar"]]


def test_replies_that_arrived_together_are_read_together_resp3_pushes_too(
    pair: tuple[socket.socket, Replies],
) -> None:
    server, replies = pair
    server.sendall(PUSH + MESSAGE + b"+PONG\r\n_\r\n%1\r\n$1\r\nk\r\n:1\r\n" + MESSAGE[:9])
    assert replies.read() == [
        [b"subscribe", b"c", b"3"],
        [b"message", b"keel-lock:wake:", b"foobar"],
        b"PONG",
        None,
        [b"k", b"1"],
    ]
    server.sendall(MESSAGE[9:])
    assert replies.read() == [[b"message", b"keel-lock:wake:", b"foobar"]]


def test_an_error_reply_raises_it(pair: tuple[socket.socket, Replies]) -> None:
    server, replies = pair
    server.sendall(b"-NOPERM no permissions to access the channel\r\n")
    with pytest.raises(ResponseError, match="NOPERM"):
        replies.read()


def test_the_end_of_the_connection_raises(pair: tuple[socket.socket, Replies]) -> None:
    server, replies = pair
    server.close()
    with pytest.raises(ConnectionError):
        replies.read()


def test_what_is_not_resp_raises(pair: tuple[socket.socket, Replies]) -> None:
    server, replies = pair
    server.sendall(b"*x\r\n")
    with pytest.raises(ValueError):
        replies.read()


def test_nothing_to_read_after_all_reads_nothing(pair: tuple[socket.socket, Replies]) -> None:
    _, replies = pair
    replies._sock.setblocking(False)
    assert replies.read() == []


@needs_store("redis")
@pytest.mark.parametrize("protocol", [2, 3])
def test_a_carried_grant_reaches_its_waiter_on_either_protocol_with_no_call(
    protocol: int, key: str
) -> None:
    url = f"{settings.REDIS_URL}?protocol={protocol}"
    other = RedisLockStore(f"resp{protocol}-other", {"URL": settings.REDIS_URL})
    store = RedisLockStore(f"resp{protocol}", {"URL": url})
    try:
        assert other.acquire(key, "a" * 32, "holder", 30).acquired
        with serving(store) as alias:
            store.ensure_listener()
            assert wait_until(store.listener_ready, 10), "the listener never connected"
            calls: list[Any] = []
            queued = store.acquire_queued

            def counted(*args: Any) -> Any:
                calls.append(args)
                return queued(*args)

            store.acquire_queued = counted  # type: ignore[method-assign]
            handle = lock(key, ttl=30, holder="waiter", store=alias)
            thread = threading.Thread(target=handle.acquire, kwargs={"timeout": 20})
            thread.start()
            deadline = time.monotonic() + 10
            while not calls:  # refused: it stands in line
                assert time.monotonic() < deadline, "the waiter never asked"
                time.sleep(0.01)
            time.sleep(0.2)  # and asked again when its key's channel was subscribed
            asked = len(calls)
            assert other.release(key, "a" * 32)
            thread.join(10)
            assert handle.held and len(calls) == asked  # the grant came in the wake-up
            info = other.get(key)
            assert info is not None and info.holder == "waiter"
            assert info.expires_in > 20  # its whole ttl: carried
            assert handle.release()
    finally:
        other.close()


def test_replies_nested_past_any_real_one_raise_value_error_not_recursion_error(
    pair: tuple[socket.socket, Replies],
) -> None:
    # A read error (`RedisListener.read_errors`) hangs up and reconnects; a RecursionError
    # would end a waiting thread's acquire() instead.
    server, replies = pair
    server.sendall(b"*1\r\n" * 5000 + b":1\r\n")
    with pytest.raises(ValueError):
        replies.read()


def test_a_line_that_never_ends_is_not_kept_without_bound(
    pair: tuple[socket.socket, Replies],
) -> None:
    server, replies = pair
    server.setblocking(False)
    with pytest.raises(ValueError):
        for _ in range(100):  # 6.5 MB of a "line" with no CRLF: not RESP from Redis
            with contextlib.suppress(BlockingIOError):
                server.send(b"+" + b"x" * 65535)
            replies.read()


@needs_store("redis")
def test_a_wake_up_read_but_not_handled_when_a_signal_interrupts_is_not_lost(
    key: str,
) -> None:
    # A waiting thread reads the connection (`read_here`): a signal handler's exception (a
    # task's time limit, Ctrl-C) may come after the read took both releases off the socket
    # and before the second was handled. Its key's waiters must still be woken.
    import select
    import sys

    import redis

    store = RedisLockStore("resp-interrupted", {"URL": settings.REDIS_URL})
    publisher = redis.Redis.from_url(settings.REDIS_URL)
    try:
        store.ensure_listener()
        assert wait_until(store.listener_ready, 10), "the listener never connected"
        listener = store._listener
        assert listener is not None
        with store.watch(key + ":1") as first, store.watch(key + ":2") as second:
            assert wait_until(lambda: len(listener.subscribed) == 2, 10)
            time.sleep(0.3)  # the subscriptions confirmed, their wake-ups gone by
            first.poll(), second.poll()
            with listener._reading:  # as a waiting thread does: the listener's thread waits
                pipe = publisher.pipeline(transaction=True)
                pipe.publish(store.release_channel(key + ":1"), "1")
                pipe.publish(store.release_channel(key + ":2"), "1")
                pipe.execute()
                poller = select.poll()
                poller.register(listener.socket(), select.POLLIN)
                assert poller.poll(5000)
                time.sleep(0.1)  # both arrived

                def interrupt(frame: Any, event: str, arg: Any) -> None:
                    if event == "call" and frame.f_code.co_name == "_handle":
                        sys.settrace(None)
                        raise KeyboardInterrupt

                sys.settrace(interrupt)
                try:
                    with pytest.raises(KeyboardInterrupt):
                        listener.dispatch(True)
                finally:
                    sys.settrace(None)
            assert second.wait(5), "the second release's wake-up was lost"
    finally:
        publisher.close()
        store.close()


def test_a_long_string_arriving_over_many_reads_is_parsed_once_not_once_per_read(
    pair: tuple[socket.socket, Replies],
) -> None:
    # Anyone may PUBLISH to a channel the listener is subscribed on: a 64 MB message read
    # 64 KB at a time must not hold the reading thread (a waiter: `read_here`) for long.
    import select

    server, replies = pair
    size = 64 * 1024 * 1024
    message = b"*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$%d\r\n%s\r\n" % (size, b"x" * size)
    sender = threading.Thread(target=server.sendall, args=(message + PUSH,))
    sender.start()
    poller = select.poll()
    poller.register(replies._sock, select.POLLIN)
    got: list[Any] = []
    began = time.monotonic()
    while len(got) < 2:
        assert poller.poll(10_000)
        got += replies.read()
    took = time.monotonic() - began
    sender.join()
    assert got[0][2] == b"x" * size and got[1] == [b"subscribe", b"c", b"3"]
    assert took < 5, f"{took:.1f} s"


def test_a_resp3_attribute_is_not_a_reply_nor_an_element_of_one(
    pair: tuple[socket.socket, Replies],
) -> None:
    # An attribute (|) comes before the reply or element it describes, and is not counted.
    server, replies = pair
    attribute = b"|1\r\n+key-popularity\r\n%1\r\n$1\r\na\r\n,0.19\r\n"
    server.sendall(attribute + PUSH + b">3\r\n" + attribute + MESSAGE[4:])
    assert replies.read() == [
        [b"subscribe", b"c", b"3"],
        [b"message", b"keel-lock:wake:", b"foobar"],
    ]


def test_over_tls_a_record_that_arrived_in_part_reads_nothing_yet_without_waiting_for_it(
    tmp_path: Any,
) -> None:
    # poll() finds the socket readable on a record's first bytes (or on a record that is no
    # reply: a TLS 1.3 session ticket); the reading thread (a waiter: `read_here`) must not
    # then wait for the rest for as long as the socket's timeout allows, past its own.
    import select
    import ssl

    from .support.etcd import make_certificates

    paths = make_certificates(str(tmp_path))
    listening = socket.create_server(("127.0.0.1", 0))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths["server"], paths["server-key"])
    client_ctx = ssl.create_default_context(cafile=paths["ca"])
    client = socket.create_connection(listening.getsockname())
    raw, _ = listening.accept()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(incoming, outgoing, server_side=True)

    def handshake() -> None:
        while True:
            try:
                server.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                incoming.write(raw.recv(65536))
        raw.sendall(outgoing.read())

    shaking = threading.Thread(target=handshake)
    shaking.start()
    ours = client_ctx.wrap_socket(client, server_hostname="127.0.0.1")
    shaking.join()
    try:
        ours.settimeout(10)  # as redis-py's socket_timeout
        replies = Replies(ours)
        server.write(MESSAGE)
        record = outgoing.read()
        raw.sendall(record[:10])
        poller = select.poll()
        poller.register(ours, select.POLLIN)
        assert poller.poll(5000)
        began = time.monotonic()
        assert replies.read() == []
        assert time.monotonic() - began < 1
        raw.sendall(record[10:])
        assert poller.poll(5000)
        assert replies.read() == [[b"message", b"keel-lock:wake:", b"foobar"]]
        assert ours.gettimeout() == 10  # as redis-py left it
    finally:
        ours.close()
        raw.close()
        listening.close()
