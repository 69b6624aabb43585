"""The Lua scripts every operation is, and the key names they work on.

Each operation is one script, loaded once and called by SHA: one round trip, atomic. Every key
of one lock shares the lock key's hash tag, so the scripts run on Redis Cluster.

Layout of one lock on `key` under the default KEY_PREFIX, "keel-lock:" (a prefix that does not
end with ":" gets one, so "keel-lock" gives the same names):
    keel-lock:{key}        hash: o = owner, h = holder, f = fence, t = acquired (ms), with PX
    keel-lock:{key}:fence  the key's last fence, kept a day after its last acquisition
    keel-lock:released:key pub/sub channel a release publishes on; a process subscribes to it
                           only while one of its threads or tasks waits for `key`
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple


class Script(NamedTuple):
    """A Lua script and its SHA1, by which EVALSHA calls it."""

    text: str
    sha: str


def _script(text: str) -> Script:
    return Script(text, hashlib.sha1(text.encode()).hexdigest())


# Take the lock if it is free; the same owner gets its acquisition back (same fence, ttl
# renewed), so a retry after a lost reply is safe.
#   KEYS[1] the lock's hash        KEYS[2] the key's fence counter
#   ARGV[1] owner  ARGV[2] holder  ARGV[3] ttl (ms)
#   -> the fence (> 0) when acquired; when someone else holds it, -(pttl + 1) (0 if the key has
#      no expiry): one integer, as it is simpler for the client to parse than an array.
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

# Free the lock if the owner still holds it, and announce it on the key's release channel.
#   KEYS[1] the lock's hash
#   ARGV[1] owner  ARGV[2] the key's release channel
#   -> 1 if released (and announced), else 0
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

# Let the owner's lock live at least ttl more: expiry becomes max(current, now + ttl).
#   KEYS[1] the lock's hash
#   ARGV[1] owner  ARGV[2] ttl (ms)
#   -> 1 if the owner holds it, else 0
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

# Read the lock atomically.
#   KEYS[1] the lock's hash
#   -> {owner, holder, fence, acquired (ms), pttl}, or nil when free
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
