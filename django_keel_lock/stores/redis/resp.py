"""RESP, the Redis protocol, as the release listener's subscribed connection receives it:
read straight off the socket and parsed here, not by redis-py's parser, whose dozen Python calls
per reply (buffer, parser, decoder, and a can_read of three system calls) stood between a
grant arriving and its waiter holding the lock."""

from __future__ import annotations

import os
import ssl
from typing import Any

from redis.exceptions import ResponseError

_BULKS = frozenset(b"$=!")  # bulk string, verbatim string, bulk error (RESP3)
_LISTS = frozenset(b"*>~")  # array, push, set
_PAIRS = frozenset(b"%|")  # map, attribute: a key and a value per entry
_ATTRIBUTE = ord("|")
_ERROR = ord("-")
_NULL = ord("_")
#: The most read from the socket at once; what is left stays there, readable.
READ_SIZE = 65536
#: Past these, what arrives is not a reply Redis sends (a pub/sub reply is two levels deep, a
#: line a length or a word; 512 MB is Redis's own longest string): a ValueError, not memory
#: kept for ever or the stack overflowed.
MAX_DEPTH = 16
MAX_LINE = 65536
MAX_BULK = 512 * 1024 * 1024


class Incomplete(Exception):
    """The data ends before the reply does: the rest has not arrived yet. `need`: how long
    the data must be at least before parsing again can get further (a string's end)."""

    def __init__(self, need: int = 0) -> None:
        self.need = need


def parse(data: bytes, pos: int, depth: int = 0) -> tuple[Any, int]:
    """The reply that starts at `pos` of `data`, and where the next one starts; Incomplete
    when `data` ends first. Bulk strings are bytes, an error a ResponseError, an aggregate a
    list (a map's keys and values alternate), a null None, anything else its line's bytes; an
    attribute is skipped for what follows it.
    ValueError for what is not RESP (or nested deeper than MAX_DEPTH, or longer than
    MAX_LINE or MAX_BULK)."""
    end = data.find(b"\r\n", pos, pos + MAX_LINE)
    if end < 0:
        if len(data) - pos >= MAX_LINE:
            raise ValueError(f"a RESP line longer than {MAX_LINE} bytes")
        raise Incomplete
    kind, line, pos = data[pos], data[pos + 1 : end], end + 2
    if kind in _BULKS:
        size = int(line)
        if size < 0:
            return None, pos
        if size > MAX_BULK:
            raise ValueError(f"a RESP string of {size} bytes")
        if len(data) < pos + size + 2:
            raise Incomplete(pos + size + 2)
        return data[pos : pos + size], pos + size + 2
    if kind in _LISTS or kind in _PAIRS:
        count = int(line)
        if count < 0:
            return None, pos
        if depth >= MAX_DEPTH:
            raise ValueError(f"RESP nested more than {MAX_DEPTH} deep")
        items = []
        for _ in range(count * 2 if kind in _PAIRS else count):
            item, pos = parse(data, pos, depth + 1)
            items.append(item)
        if kind == _ATTRIBUTE:  # about what follows, which is the reply (or element)
            return parse(data, pos, depth + 1)
        return items, pos
    if kind == _ERROR:
        return ResponseError(line.decode("utf-8", "replace")), pos
    return (None if kind == _NULL else line), pos


class Replies:
    """The replies arriving on one socket: `read()` them once poll() finds it readable."""

    __slots__ = ("_need", "_rest", "_size", "_sock")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        # The start of a reply whose end has not arrived, in the pieces read, their length,
        # and the length before which parsing it again would get no further: a long string
        # arriving over many reads is joined and parsed once, not once per read.
        self._rest: list[bytes] = []
        self._size = self._need = 0

    def read(self) -> list[Any]:
        """The whole replies that arrived since the last read (of a reply that came in part,
        the rest is awaited by the next). Only once the socket is readable: it may wait
        otherwise. ConnectionError when the server closed the connection, ResponseError for
        an error reply, ValueError for what is not RESP."""
        received = self._receive()
        if received is None:
            return []
        if self._rest:
            self._rest.append(received)
            self._size += len(received)
            if self._size < self._need:
                return []
            data = b"".join(self._rest)
        else:
            data = received
        replies: list[Any] = []
        pos = need = 0
        try:
            while pos < len(data):
                reply, pos = parse(data, pos)
                if type(reply) is ResponseError:
                    raise reply
                replies.append(reply)
        except Incomplete as short:
            need = short.need - pos
        self._rest = [data[pos:]] if pos < len(data) else []
        self._size, self._need = len(data) - pos, need
        return replies

    def _receive(self) -> bytes | None:
        """What the socket has (None: nothing after all)."""
        sock = self._sock
        try:
            if isinstance(sock, ssl.SSLSocket):
                data = _receive_tls(sock)
            else:  # the socket's own recv() would poll() first: a system call more
                data = os.read(sock.fileno(), READ_SIZE)
        except (BlockingIOError, ssl.SSLWantReadError):  # nothing after all
            return None
        if not data:
            raise ConnectionError("the server closed the pub/sub connection")
        return data


def _receive_tls(sock: ssl.SSLSocket) -> bytes:
    """What a TLS socket has now. Its recv() would wait, for as long as the socket's timeout
    allows, for the rest of a record that arrived in part, or for a reply after a record that
    is none (a session ticket): without a timeout for now, as redis-py's can_read() does."""
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        data = sock.recv(READ_SIZE)
        while data and sock.pending():  # records decrypted but not read stay there
            data += sock.recv(READ_SIZE)
        return data
    finally:
        sock.settimeout(timeout)
