"""The Lua scripts every operation is, and the key names they work on.

Each operation is one script, loaded once and called by SHA: one round trip, atomic. Every key
of one lock shares the lock key's hash tag, so the scripts run on Redis Cluster.

The braces are a hash tag: all of `key`, its own braces escaped (`escape_key`), but for a key
that starts with a tag of its own ("{account}:1" is named "keel-lock:{%7Baccount}:1}"): then
that tag alone, so keys starting with the same tag share one slot and one script takes them.

Layout of one lock on `key` under the default KEY_PREFIX, "keel-lock:" (a prefix that does not
end with ":" gets one, so "keel-lock" gives the same names):
    keel-lock:{key}          hash: o = owner, h = holder, f = fence, t = acquired (ms), with PX;
                             g = 1 while a lock handed over is not taken up by a call (any
                             acquire of its owner clears it); a waiter that took a carried
                             grant from its wake-up holds the lock with g still set, and only
                             its own LEAVE_QUEUE or a GIVE_BACK of that fence reads it
    keel-lock:{key}:fence    the key's last fence, kept a day after its last acquisition
    keel-lock:released:key   pub/sub channel a release publishes on; a process subscribes to it
                             only while one of its threads or tasks waits for `key`
The callers waiting for an exclusive lock stand in its line (see LockStore.acquire_queued):
    keel-lock:{key}:line     list: their owners, in the order they first asked
    keel-lock:{key}:places   hash: owner -> "expiry (ms since the epoch):wake address" (as
                             versions before hand-offs wrote and read it, so that their releases
                             still wake waiters of this one during a rolling upgrade), and
                             owner + ":" -> "ttl (ms):holder", what a hand-off writes for it
                             (both expire QUEUE_LEASE after the last attempt of any of them)
    keel-lock:wake:address   pub/sub channel of one process's listener: a release that finds
                             a live waiter first in line hands the lock over to it (the hash
                             written for it, for its grant ttl: min(its ttl, QUEUE_LEASE,
                             what is left of its place)) and publishes the key there, for that
                             waiter only, instead of on the key's release channel; the
                             waiter's next ACQUIRE_QUEUED takes the grant up at its own ttl
    keel-lock:wake:address:grant  the same listener's grant channel, tried first: a release
                             publishes "fence owner key" there when the listener is
                             subscribed (this server counts it), the grant for the waiter's
                             own ttl, and the waiter is its holder with no call (HAND_ON);
                             not heard on a replica unless counted here; a listener of a
                             version before carried grants does not subscribe to it
A key held by permits (a shared lock's readers, a semaphore's holders) also has:
    keel-lock:{key}          the gate: o = the kind's GATE_OWNER ("*shared", "*semaphore"), h
                             empty, f = the latest permit's fence, t = the first permit's time,
                             expiring with the latest permit; so ACQUIRE, unchanged, sees the
                             key held
    keel-lock:{key}:permits  zset: owner -> expiry (ms since the epoch, by the server's TIME)
    keel-lock:{key}:holders  hash: owner -> "fence:acquired (ms):holder"
                             (both expire with the gate; they count only while the gate is a
                             marker, and the first permit of a new gate clears them)
    keel-lock:{key}:writer   the owner of the writer waiting for the readers to go, with PX =
                             its wait: no new shared permit is given meanwhile
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


# The key's next fence, drawn on its counter (kept at least a day, or `ttl` ms), at the
# server's time `now` (TIME's reply): one more than the key's last one, and never below the
# server's clock in microseconds. So the counter may vanish (it expires a day after the key's
# last acquisition, or with a Redis restarted without persistence) and fences still only go
# up: acquisitions of one key are at least a round trip apart, far more than a microsecond.
# Every mode draws on the same counter: fences of a key go up whatever the mode.
_FENCE = """
local function draw_fence(counter, ttl, now)
    local last = tonumber(redis.call('GET', counter) or '0')
    local fence = math.max(last + 1, now[1] * 1000000 + now[2])
    redis.call('SET', counter, string.format('%d', fence), 'PX', math.max(ttl, 86400000))
    return fence
end
"""

# TAKE: take the free lock (KEYS[1], fence counter KEYS[2]) for ARGV[1], holder ARGV[2], ttl
# ARGV[3] (ms); the fence.
_TAKE = (
    _FENCE
    + """
local function take()
    local now = redis.call('TIME')
    local fence = draw_fence(KEYS[2], tonumber(ARGV[3]), now)
    redis.call('HSET', KEYS[1], 'o', ARGV[1], 'h', ARGV[2], 'f', fence,
               't', tostring(now[1] * 1000 + math.floor(now[2] / 1000)))
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return fence
end
"""
)

# The line of waiters (the layout above). first_in_line drops the places at its front that
# have lapsed and gives the first live one (owner, its wake address, the expiry), or nil.
# wake_first, for the releases that do not hand the lock over (RELEASE_MANY, the idempotent
# results' fused releases), tells the first in line that the lock is free, or the key's
# release channel when nobody is in line.
_LINE = """
local function first_in_line(line, places, now_ms)
    while true do
        local first = redis.call('LINDEX', line, 0)
        if not first then
            return nil
        end
        local place = redis.call('HGET', places, first)
        if place then
            local until_ms, address = string.match(place, '^(%d+):(.*)$')
            if tonumber(until_ms) > now_ms then
                return first, address, tonumber(until_ms)
            end
        end
        redis.call('LPOP', line)
        redis.call('HDEL', places, first, first .. ':')
    end
end
local function clock_ms()
    local now = redis.call('TIME')
    return now[1] * 1000 + math.floor(now[2] / 1000)
end
local function wake_first(line, places, wake_prefix, key, channel)
    local first, address = first_in_line(line, places, clock_ms())
    if not first then
        redis.call('PUBLISH', channel, '1')
    elseif address ~= '' then
        redis.call('PUBLISH', wake_prefix .. address, key)
    end
end
"""

# HAND_ON: the lock (KEYS[1], fence counter KEYS[2], line KEYS[3], places KEYS[4]) is free:
# hand it over to the first live waiter in line with a fence from the key's counter, and
# wake it; with nobody in line, announce the release on the key's channel ARGV[2].
# With ARGV[6] = '1' (not under MIN_REPLICAS nor on Cluster: `RedisLockStore.carries_grants`)
# the grant is first carried (`carry`) on its process's grant channel (ARGV[3], the wake
# channels' prefix, .. address .. ':grant'), as "fence owner key" (ARGV[4] the key), when
# that process's listener is subscribed to it on this server (PUBSUB NUMSUB: not a replica's
# subscriber nor a pattern's): the grant is then for the waiter's own ttl, and it is the
# holder without a call; it leaves the line (it holds the lock, or passes
# it on as it leaves: LEAVE_QUEUE). Otherwise the grant is for min(its ttl, ARGV[5] ms, what
# is left of its place: a waiter that died does not hold the others up past its place) and
# the key is published on its wake channel (ARGV[3] .. address: what every version's
# listener hears); the waiter keeps its place until it takes the grant up, so one that missed
# the wake-up and asks after the grant lapsed still finds itself first. A waiter of a
# version before hand-offs (a place without its owner + ":" field) gets a wake-up only.
_HAND_ON = (
    _FENCE
    + _LINE
    + """
local function leave_line(owner)
    if redis.call('HDEL', KEYS[4], owner, owner .. ':') == 0 then
        return false
    end
    redis.call('LREM', KEYS[3], 1, owner)
    return true
end
local function carry(first, address, fence, ttl)
    local channel = ARGV[3] .. address .. ':grant'
    -- Its listener counted first, by this server, on that channel only: Redis passes a
    -- PUBLISH on to its replicas' subscribers (a listener left on a demoted master) and to
    -- pattern subscribers whatever it counted, and no grant written for less than the
    -- waiter's ttl may go out.
    if redis.call('PUBSUB', 'NUMSUB', channel)[2] == 0 then
        return false
    end
    redis.call('PUBLISH', channel, string.format('%d', fence) .. ' ' .. first .. ' ' .. ARGV[4])
    redis.call('PEXPIRE', KEYS[1], ttl)
    leave_line(first)
    return true
end
local function hand_on()
    local now = redis.call('TIME')
    local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
    local first, address, until_ms = first_in_line(KEYS[3], KEYS[4], now_ms)
    if not first then
        redis.call('PUBLISH', ARGV[2], '1')
        return
    end
    local ttl, holder = string.match(redis.call('HGET', KEYS[4], first .. ':') or '',
                                     '^(%d+):(.*)$')
    if ttl then
        local fence = draw_fence(KEYS[2], tonumber(ttl), now)
        redis.call('HSET', KEYS[1], 'o', first, 'h', holder, 'f', fence, 't', tostring(now_ms),
                   'g', '1')
        if ARGV[6] == '1' and address ~= '' and carry(first, address, fence, ttl) then
            return
        end
        redis.call('PEXPIRE', KEYS[1],
                   math.min(tonumber(ttl), tonumber(ARGV[5]), until_ms - now_ms))
    end
    if address ~= '' then
        redis.call('PUBLISH', ARGV[3] .. address, ARGV[4])
    end
end
"""
)

# Refusals: -(ms + 1) (0 when the key has no expiry), one integer, as it is simpler for the
# client to parse than an array; when permits hold the key, {that, the gate's owner}.
_REFUSE = """
local function refuse(ms, held_by)
    local value = 0
    if ms >= 0 then
        value = -(ms + 1)
    end
    if held_by then
        return {value, held_by}
    end
    return value
end
"""

# Take the lock if it is free; the same owner gets its acquisition back (same fence, ttl
# renewed), so a retry after a lost reply is safe.
#   KEYS[1] the lock's hash        KEYS[2] the key's fence counter
#   ARGV[1] owner  ARGV[2] holder  ARGV[3] ttl (ms)
#   -> the fence (> 0) when acquired, else a refusal (_REFUSE) with the holder's pttl
ACQUIRE = _script(
    _TAKE
    + _REFUSE
    + """
local current = redis.call('HGET', KEYS[1], 'o')
if not current then
    return take()
end
if current ~= ARGV[1] then
    -- A gate (owners are hex; only a permit kind's GATE_OWNER starts with '*'): say which
    -- kind of permits hold the key.
    local held_by = nil
    if string.sub(current, 1, 1) == '*' then
        held_by = current
    end
    return refuse(redis.call('PTTL', KEYS[1]), held_by)
end
redis.call('HDEL', KEYS[1], 'g')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return tonumber(redis.call('HGET', KEYS[1], 'f'))
"""
)

# ACQUIRE for a caller that waits its turn (LockStore.acquire_queued): a free lock goes to the
# first live waiter in line, or to anyone while the line is empty; a refusal keeps the
# caller's place, or gives it one at the end, for the lease.
#   KEYS[1] the lock's hash  KEYS[2] the key's fence counter  KEYS[3] line  KEYS[4] places
#   ARGV[1] owner  ARGV[2] holder  ARGV[3] ttl (ms)  ARGV[4] the lease (ms)  ARGV[5] this
#   process's wake address ('' for none)
#   -> as ACQUIRE, but a refusal that keeps the caller in line is {the refusal, '', the key's
#      last fence} (a grant carried to it later with a fence no greater is stale); a
#      refusal's ms is at most the lease. A caller a release handed the lock to finds itself
#      its owner: it gets its fence, at its own ttl from now on.
ACQUIRE_QUEUED = _script(
    _TAKE
    + _LINE
    + _REFUSE
    + """
local owner, lease = ARGV[1], tonumber(ARGV[4])
local now_ms = clock_ms()
local function leave()
    if redis.call('HDEL', KEYS[4], owner, owner .. ':') > 0 then
        redis.call('LREM', KEYS[3], 1, owner)
    end
end
local function stand(ms)
    local place = string.format('%d', now_ms + lease) .. ':' .. ARGV[5]
    if redis.call('HSET', KEYS[4], owner, place) == 1 then
        redis.call('RPUSH', KEYS[3], owner)
    end
    redis.call('HSET', KEYS[4], owner .. ':', ARGV[3] .. ':' .. ARGV[2])
    redis.call('PEXPIRE', KEYS[3], lease)
    redis.call('PEXPIRE', KEYS[4], lease)
    return {refuse(math.min(ms, lease), nil), '', tonumber(redis.call('GET', KEYS[2]) or '0')}
end
local current = redis.call('HGET', KEYS[1], 'o')
if current == owner then
    leave()
    redis.call('HDEL', KEYS[1], 'g')
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return tonumber(redis.call('HGET', KEYS[1], 'f'))
end
if current then
    if string.sub(current, 1, 1) == '*' then
        -- Permits hold it: the caller waits for them as a writer, out of the line.
        leave()
        return refuse(redis.call('PTTL', KEYS[1]), current)
    end
    local pttl = redis.call('PTTL', KEYS[1])
    return stand(pttl >= 0 and pttl or lease)
end
local first, _, until_ms = first_in_line(KEYS[3], KEYS[4], now_ms)
if first and first ~= owner then
    return stand(until_ms - now_ms)
end
leave()
return take()
"""
)

# Take the caller out of the key's line. A caller a release handed the lock to (it gave up
# as the grant came, carried or not: a waiter that took a carried grant never leaves the
# line) passes it on, unless it took the grant up meanwhile (a multi-key waiter takes a key
# of its line with ACQUIRE_MANY, then leaves the line); a free lock goes to whoever is now
# first (HAND_ON).
#   KEYS[1] the lock's hash  KEYS[2] the key's fence counter  KEYS[3] line  KEYS[4] places
#   ARGV[1] owner  ARGV[2] the key's release channel  ARGV[3] the wake channels' prefix
#   ARGV[4] the key  ARGV[5] the longest grant not carried (ms)  ARGV[6] '1': carry grants
#   -> 1 if it was in the line or held the lock, else 0
LEAVE_QUEUE = _script(
    _HAND_ON
    + """
local placed = leave_line(ARGV[1])
local held = redis.call('HMGET', KEYS[1], 'o', 'g')
if held[1] == ARGV[1] and held[2] then
    redis.call('DEL', KEYS[1])
    hand_on()
    return 1
end
if not placed then
    return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
    hand_on()
end
return 1
"""
)

# Give back a grant carried to ARGV[1] (its fence ARGV[7]) that nobody took: its process
# heard it with nobody there waiting for the key (the waiter stopped without leaving the
# line, its last attempt failed). Only that grant, still not taken up by a call (the 'g'
# mark) nor by another wait of the same owner (a later grant has a greater fence); the lock
# goes to whoever is now first (HAND_ON).
#   KEYS and ARGV[1..6] as LEAVE_QUEUE's  ARGV[7] the grant's fence
#   -> 1 if given back, else 0
GIVE_BACK = _script(
    _HAND_ON
    + """
local held = redis.call('HMGET', KEYS[1], 'o', 'f', 'g')
if held[1] == ARGV[1] and held[3] and tonumber(held[2]) == tonumber(ARGV[7]) then
    redis.call('DEL', KEYS[1])
    hand_on()
    return 1
end
return 0
"""
)

# Free the lock if the owner still holds it (and take it out of the line, where a grant it
# did not take up left it) and hand it over to the first live waiter in line, or announce it
# on the key's release channel when nobody is in line (HAND_ON).
#   KEYS and ARGV as LEAVE_QUEUE's
#   -> 1 if released (and handed over or announced), else 0
RELEASE = _script(
    _HAND_ON
    + """
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    redis.call('DEL', KEYS[1])
    leave_line(ARGV[1])  -- handed the lock, it released it without taking the grant up
    hand_on()
    return 1
end
return 0
"""
)

# Idempotent results (`results`): RELEASE fused with what a request does with its key's
# result, so that the request costs a round trip less. KEYS start with the lock's hash, its
# line and places, ARGV with owner, release channel, wake channels' prefix and key
# (`RedisLockStore.releasing_call`); KEYS[4] is the result's hash (f fence, p fingerprint, s
# status, d data, t stored at, ms). It wakes the first in line and does not hand over.
_RELEASE_OWN = """
local function release_own()
    if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
        return 0
    end
    redis.call('DEL', KEYS[1])
    wake_first(KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[2])
    return 1
end
"""

# Keep a result while ARGV[1] owns the lock, over none of a fence as high (and keep the lock).
#   KEYS[1] the lock's hash  KEYS[2] the result's hash
#   ARGV[2] fence  ARGV[3] fingerprint  ARGV[4] status  ARGV[5] data  ARGV[6] ttl (ms)
#   -> 1 kept, else 0
KEEP_RESULT = _script(
    """
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
    return 0
end
local kept = redis.call('HGET', KEYS[2], 'f')
if kept and tonumber(kept) >= tonumber(ARGV[2]) then
    return 0
end
local now = redis.call('TIME')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'f', ARGV[2], 'p', ARGV[3], 's', ARGV[4], 'd', ARGV[5],
           't', string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000)))
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return 1
"""
)

# Keep a result and release the lock, both only while ARGV[1] owns the lock, the result
# only over none of a fence as high.
#   ARGV[5] fence  ARGV[6] fingerprint  ARGV[7] status  ARGV[8] data  ARGV[9] ttl (ms)
#   -> 2 kept and released, 1 released (a result of a fence as high is there), 0 neither
RELEASE_KEEPING = _script(
    _LINE
    + _RELEASE_OWN
    + """
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
    return 0
end
local kept = redis.call('HGET', KEYS[4], 'f')
if kept and tonumber(kept) >= tonumber(ARGV[5]) then
    return release_own()
end
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'f', ARGV[5], 'p', ARGV[6], 's', ARGV[7], 'd', ARGV[8],
           't', string.format('%d', clock_ms()))
redis.call('PEXPIRE', KEYS[4], ARGV[9])
return 1 + release_own()
"""
)

# Read the key's result; when there is one, release the lock of ARGV[1] too.
#   -> {} when no result (the lock is left as it is), else {released (1 or 0), the result's
#   fields as HGETALL gives them}
RELEASE_IF_KEPT = _script(
    _LINE
    + _RELEASE_OWN
    + """
if redis.call('HEXISTS', KEYS[4], 'f') == 0 then
    return {}
end
return {release_own(), redis.call('HGETALL', KEYS[4])}
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

# Several keys at once (LockStore.acquire_many), each an exclusive lock of its own key laid out
# as ACQUIRE's: every key is free or the owner's, and then all are taken (the owner's renewed),
# or none is. Like ACQUIRE, it takes a free key whatever its line of waiters holds. The keys
# share one slot (always, but on Cluster where the store groups them by slot).
#   KEYS[2i - 1] key i's lock hash   KEYS[2i] key i's fence counter
#   ARGV[1] owner  ARGV[2] holder  ARGV[3] ttl (ms)
#   -> each key's fence, in a string ("fence1 fence2 ...": one reply to read, not one a key)
#      when taken; else {-(the soonest expiry among the holders, ms, + 1)
#      (0 when none has one), the first blocked key's gate owner ('' for a lock), then the
#      index (1-based) of each key held by another}
ACQUIRE_MANY = _script(
    _FENCE
    + """
local owner, ttl = ARGV[1], tonumber(ARGV[3])
local blocked, soonest, held_by = {}, -1, ''
for i = 1, #KEYS, 2 do
    local current = redis.call('HGET', KEYS[i], 'o')
    if current and current ~= owner then
        if #blocked == 0 and string.sub(current, 1, 1) == '*' then
            held_by = current
        end
        table.insert(blocked, (i + 1) / 2)
        local pttl = redis.call('PTTL', KEYS[i])
        if pttl >= 0 and (soonest < 0 or pttl < soonest) then
            soonest = pttl
        end
    end
end
if #blocked > 0 then
    local reply = {0, held_by}
    if soonest >= 0 then
        reply[1] = -(soonest + 1)
    end
    for _, index in ipairs(blocked) do
        table.insert(reply, index)
    end
    return reply
end
local now = redis.call('TIME')
local acquired = tostring(now[1] * 1000 + math.floor(now[2] / 1000))
local fences = {}
for i = 1, #KEYS, 2 do
    local fence = tonumber(redis.call('HGET', KEYS[i], 'f'))
    if not fence then
        fence = draw_fence(KEYS[i + 1], ttl, now)
        redis.call('HSET', KEYS[i], 'o', owner, 'h', ARGV[2], 'f', fence, 't', acquired)
    else
        redis.call('HDEL', KEYS[i], 'g')  -- a grant it stood for: taken up
    end
    redis.call('PEXPIRE', KEYS[i], ttl)
    table.insert(fences, string.format('%d', fence))
end
return table.concat(fences, ' ')
"""
)

# RELEASE for several keys: each the owner still holds is freed and announced as RELEASE does,
# and the owner leaves that key's line if it still stands in it (a multi-key waiter leaves the
# line it stood in once it has taken its keys; this covers one whose leaving failed).
#   KEYS[3i - 2] key i's lock hash   KEYS[3i - 1] its line   KEYS[3i] its places
#   ARGV[1] owner  ARGV[2] the wake channels' prefix  ARGV[2i + 1] key i's release channel
#   ARGV[2i + 2] key i
#   -> a string of a character a key: "1" if key i was released (and announced), else "0"
RELEASE_MANY = _script(
    _LINE
    + """
local released = {}
for i = 1, #KEYS / 3 do
    released[i] = '0'
    if redis.call('HGET', KEYS[3 * i - 2], 'o') == ARGV[1] then
        redis.call('DEL', KEYS[3 * i - 2])
        if redis.call('HDEL', KEYS[3 * i], ARGV[1], ARGV[1] .. ':') > 0 then
            redis.call('LREM', KEYS[3 * i - 1], 1, ARGV[1])
        end
        wake_first(KEYS[3 * i - 1], KEYS[3 * i], ARGV[2], ARGV[2 * i + 2], ARGV[2 * i + 1])
        released[i] = '1'
    end
end
return table.concat(released)
"""
)

# EXTEND for several keys: each the owner still holds lives at least ttl more.
#   KEYS[i] key i's lock hash
#   ARGV[1] owner  ARGV[2] ttl (ms)
#   -> how many of the keys the owner holds
EXTEND_MANY = _script(
    """
local held = 0
for i = 1, #KEYS do
    if redis.call('HGET', KEYS[i], 'o') == ARGV[1] then
        if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[2]) then
            redis.call('PEXPIRE', KEYS[i], ARGV[2])
        end
        held = held + 1
    end
end
return held
"""
)

# GET's and HOLDERS' start: the lock's fields in v, or nil when free.
_READ = """
local v = redis.call('HMGET', KEYS[1], 'o', 'h', 'f', 't')
if not v[1] then
    return false
end
"""

# Read the lock atomically.
#   KEYS[1] the lock's hash
#   -> {owner, holder, fence, acquired (ms), pttl}, or nil when free
GET = _script(
    _READ
    + """
return {v[1], v[2], v[3], v[4], redis.call('PTTL', KEYS[1])}
"""
)

# The permit scripts (one acquisition of a key held by permits each). Every one starts with
# _PERMITS: KEYS[1] the gate, KEYS[2] the permits zset, KEYS[3] the holders hash.
# It reads the clock and the gate, and while the gate is a marker drops the expired permits.
_PERMITS = """
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
local gate = redis.call('HGET', KEYS[1], 'o')
-- Permits count only under a live gate: what an expired gate left behind is ignored.
local marker = nil
if gate and string.sub(gate, 1, 1) == '*' then
    marker = gate
    local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
    if #dead > 0 then
        redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
        for _, gone in ipairs(dead) do
            redis.call('HDEL', KEYS[3], gone)
        end
    end
end
-- The gate and both helper keys expire with the latest permit, so nothing outlives them.
local function expire_with_latest()
    local latest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
    local at = string.format('%d', tonumber(latest))
    for i = 1, 3 do
        redis.call('PEXPIREAT', KEYS[i], at)
    end
end
"""

# Take a permit in a mode, or (a writer that found readers) the lock itself. The rules are
# `stores.permits.plan_acquire`'s, in its order; comments name its steps.
#   KEYS[1..3] as _PERMITS   KEYS[4] the key's fence counter   KEYS[5] the waiting writer
#   ARGV[1] owner  ARGV[2] holder  ARGV[3] ttl (ms)  ARGV[4] the mode's GATE_OWNER ('' for
#   exclusive)  ARGV[5] the semaphore's limit  ARGV[6] how long a writer waits (ms)
#   -> the fence (> 0) when acquired, else as ACQUIRE's refusals: -(ms to the soonest holder's
#      expiry + 1), an array {that, the gate's owner} when permits hold the key
ACQUIRE_PERMIT = _script(
    _PERMITS
    + _REFUSE
    + _FENCE
    + """
local owner, ttl, kind = ARGV[1], tonumber(ARGV[3]), ARGV[4]
local function soonest()
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')[2]
    if first then
        return tonumber(first) - now_ms
    end
    return redis.call('PTTL', KEYS[1])
end
local function next_fence()
    return draw_fence(KEYS[4], ttl, now)
end
if kind == '' then
    local writer = redis.call('GET', KEYS[5])
    if not gate or gate == owner then  -- TAKE, as ACQUIRE does
        if writer == owner then
            redis.call('DEL', KEYS[5])
        end
        if gate then
            redis.call('HDEL', KEYS[1], 'g')
            redis.call('PEXPIRE', KEYS[1], ttl)
            return tonumber(redis.call('HGET', KEYS[1], 'f'))
        end
        local fence = next_fence()
        redis.call('HSET', KEYS[1], 'o', owner, 'h', ARGV[2], 'f', fence, 't', tostring(now_ms))
        redis.call('PEXPIRE', KEYS[1], ttl)
        return fence
    end
    if marker == '*shared' then  -- INTEND
        local wait = tonumber(ARGV[6])
        if wait > 0 and (not writer or writer == owner) then
            redis.call('SET', KEYS[5], owner, 'PX', wait)
        end
    end
    if marker then
        return refuse(soonest(), marker)
    end
    return refuse(redis.call('PTTL', KEYS[1]), nil)
end
if gate and not marker then
    return refuse(redis.call('PTTL', KEYS[1]), nil)
end
if marker and marker ~= kind then
    return refuse(soonest(), marker)
end
local expires = now_ms + ttl
local packed = marker and redis.call('HGET', KEYS[3], owner)
if packed and redis.call('ZSCORE', KEYS[2], owner) then  -- RENEW
    redis.call('ZADD', KEYS[2], expires, owner)
    expire_with_latest()
    return tonumber(string.match(packed, '^%d+'))
end
if kind == '*shared' then
    local writer_left = redis.call('PTTL', KEYS[5])
    if writer_left > 0 then
        return refuse(writer_left, nil)
    end
else
    local count = 0
    if marker then
        count = redis.call('ZCARD', KEYS[2])
    end
    if count >= tonumber(ARGV[5]) then
        return refuse(soonest(), marker or kind)
    end
end
local fence = next_fence()  -- GRANT
if marker then
    redis.call('HSET', KEYS[1], 'f', fence)
else
    redis.call('DEL', KEYS[2], KEYS[3])
    redis.call('HSET', KEYS[1], 'o', kind, 'h', '', 'f', fence, 't', tostring(now_ms))
end
redis.call('ZADD', KEYS[2], expires, owner)
redis.call('HSET', KEYS[3], owner,
           string.format('%d', fence) .. ':' .. string.format('%d', now_ms) .. ':' .. ARGV[2])
expire_with_latest()
return fence
"""
)

# Free the owner's permit; the last one frees the key. Either way it is announced on the key's
# release channel: a waiter for a semaphore wants a permit, not the whole key.
#   KEYS[1..3] as _PERMITS
#   ARGV[1] owner  ARGV[2] the key's release channel
#   -> 1 if released (and announced), else 0
RELEASE_PERMIT = _script(
    _PERMITS
    + """
if not marker or not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
    return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('ZCARD', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
else
    expire_with_latest()
end
redis.call('PUBLISH', ARGV[2], '1')
return 1
"""
)

# Let the owner's permit live at least ttl more: expiry becomes max(current, now + ttl).
#   KEYS[1..3] as _PERMITS
#   ARGV[1] owner  ARGV[2] ttl (ms)
#   -> 1 if the owner's permit lives, else 0
EXTEND_PERMIT = _script(
    _PERMITS
    + """
local expiry = marker and redis.call('ZSCORE', KEYS[2], ARGV[1])
if not expiry then
    return 0
end
local wanted = now_ms + tonumber(ARGV[2])
if tonumber(expiry) < wanted then
    redis.call('ZADD', KEYS[2], wanted, ARGV[1])
    expire_with_latest()
end
return 1
"""
)

# Read every holder of the key atomically, writing nothing.
#   KEYS[1..3] as _PERMITS
#   -> nil when free; {owner, holder, fence, acquired (ms), pttl} for a lock; for a gate,
#      {its owner, then per live permit, soonest expiry first: owner, "fence:acquired:holder",
#      ms left}
HOLDERS = _script(
    _READ
    + """
if string.sub(v[1], 1, 1) ~= '*' then
    return {v[1], v[2], v[3], v[4], redis.call('PTTL', KEYS[1])}
end
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[2], string.format('(%d', now_ms), '+inf',
                        'WITHSCORES')
local reply = {v[1]}
for i = 1, #live, 2 do
    local packed = redis.call('HGET', KEYS[3], live[i])
    if packed then
        table.insert(reply, live[i])
        table.insert(reply, packed)
        table.insert(reply, tonumber(live[i + 1]) - now_ms)
    end
end
return reply
"""
)

SCRIPTS = (
    ACQUIRE,
    ACQUIRE_QUEUED,
    LEAVE_QUEUE,
    GIVE_BACK,
    RELEASE,
    EXTEND,
    GET,
    ACQUIRE_PERMIT,
    RELEASE_PERMIT,
    EXTEND_PERMIT,
    HOLDERS,
    ACQUIRE_MANY,
    RELEASE_MANY,
    EXTEND_MANY,
    KEEP_RESULT,
    RELEASE_KEEPING,
    RELEASE_IF_KEPT,
)

_ESCAPES = {"%": "%25", "{": "%7B", "}": "%7D"}
_UNESCAPES = {code: char for char, code in _ESCAPES.items()}
_ESCAPE_RE = re.compile(r"[%{}]")
_UNESCAPE_RE = re.compile(r"%(?:25|7B|7D)")
_GLOB_RE = re.compile(r"([*?\[\]\\])")


def escape_key(key: str) -> str:
    """`key` without braces, so it fits inside a hash tag; but a key that starts with a
    hash tag of its own ("{account}:1") keeps that tag's closing brace, so the lock's name
    ("keel-lock:{%7Baccount}:1}") hashes by the tag alone, and keys starting with the same
    tag share a Cluster slot. A prefix code: escaping keeps "starts with" intact, which
    iter_locks' SCAN MATCH relies on."""
    if "%" not in key and "{" not in key and "}" not in key:  # the usual key: no regex
        return key
    tag_end = key.find("}", 1) if key.startswith("{") else -1
    if tag_end > 1:  # "{}" is no tag, as Redis Cluster reads it
        return f"{_escape(key[:tag_end])}}}{_escape(key[tag_end + 1 :])}"
    return _escape(key)


def _escape(text: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group()], text)


def unescape_key(text: str) -> str:
    """The key that `escape_key` turned into `text` (a lock's name, read back by SCAN)."""
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPES[m.group()], text)


def glob_quote(text: str) -> str:
    """`text` with SCAN MATCH's special characters (* ? [ ] \\) escaped: it matches only
    itself."""
    return _GLOB_RE.sub(r"\\\1", text)
