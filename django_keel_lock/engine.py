"""What acquiring a lock means, with no I/O: which store call to make, how long to pause, when
to stand in the key's line and when to give up a place or a grant.

An acquire is a generator (`acquisition`: one attempt, or a wait in `waiting`; a grant that
came too late given back) that yields steps and takes back their replies; a driver runs the
steps (`drivers.run` with the store's sync calls and a `Waiter`, `drivers.arun` with its async
calls, `waiting.to_the_end` and an `asyncio.Event`):

- `Call(op, args)`: call the store's `op` (the async driver calls its `a` twin) with `args`;
  the reply is what it returned, or its error is thrown into the generator;
- `TakeTurn(deadline)`: wait for this process's turn at the key (`waiting.Turn`); reply: True
  if it came (held until the generator ends);
- `WATCH`: listen for releases of the key until the generator ends;
- `Pause(seconds, keys, owner)`: sleep, ending early when a release of the key is heard (of
  one of `keys`, for a multi-key waiter: those that refused it, not those it gave back
  itself); with `owner`, reply: the fence of a grant a wake-up carried to it, or None.

How a waiter asks and pauses is a `Policy` (plain, in the store's line, a writer that keeps new
readers out, a permit): the one branch between the ways of waiting. A new way of waiting
(several keys at once) is a policy, or a generator of its own over the same steps, which both
drivers then run unchanged. A direct hand-off (a store that `hands_off`) needs none: the
release grants the lock to the first in line, whose next IN_LINE attempt takes the grant up;
a wait that ends without it leaves the line, which passes the grant on (where it cannot, a
grant not carried lapses within QUEUE_LEASE; a carried one is given back or, where the store
cannot, lasts up to the waiter's ttl: below).

A store's wake-up may carry the grant (`WakeBoard.grant(key, owner, fence)`, at the owner's
whole ttl, made after its last refusal): the driver hands it to the paused IN_LINE waiter as
the `Pause`'s reply, and the waiter becomes the holder with no store call, counting its lock
from its last refused attempt's send time (the grant came after that attempt was answered,
so the store keeps the lock at least that long). A grant of a fence no greater than the
refusal's `last_fence` is stale (pub/sub and commands are not ordered with each other) and
ignored; one that comes when too much of the ttl has gone since that attempt (`CARRIED_AGE`)
is taken up by the next attempt instead. A waiter that stops before taking it leaves the line
as any other, which passes the lock on: it never took it. One that stops on a store error
(it does not leave the line) leaves its grant to its process's board, which gives it back
where the store can (`WakeBoard.give_back`): the driver watches the key as its `owner`.

The sync driver runs an acquire that does not wait from `ask`, `check` and `late` directly,
without the generator, which costs about 0.9 us a run: 15 % of a memory-store cycle.

The engine returns what an acquire came to (`Outcome`); the handle takes it on and turns it
into events (`lock_acquired`, and its meter's acquired, refused or failed: `core.Lock._settle`),
once for both drivers. The events of a held lock (renewed, lost) come from the watchdog's plan
(`watchdog.Renewal.settle`), released and lost from `holding.Holding`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any, NamedTuple, Protocol

from .exceptions import LockStoreUnavailable
from .stores.base import EXCLUSIVE, QUEUE_LEASE, AcquireResult, LockStore, Mode
from .waiting import next_delay

__all__ = [
    "WATCH",
    "Call",
    "Interrupted",
    "Pause",
    "Policy",
    "TakeTurn",
    "Target",
    "acquisition",
    "ask",
    "check",
    "extend_call",
    "first_policy",
    "first_request",
    "give_back",
    "late",
    "release_call",
    "request",
    "subject",
    "waiting",
]

logger = logging.getLogger("django_keel_lock")


class Call(NamedTuple):
    """Step: call the store's `op` with `args`. `quiet`: its error comes back as the reply,
    never thrown (giving back, leaving the line: on the way out of something that may be
    raising already), and a cancellation of the caller meanwhile waits until the end."""

    op: str
    args: tuple[Any, ...]
    quiet: bool = False


class TakeTurn(NamedTuple):
    """Step: wait for this process's turn at the key until `deadline` (monotonic)."""

    deadline: float


class Pause(NamedTuple):
    """Step: sleep `seconds`, or less when a release of the key is heard: of one of `keys`
    when given (a multi-key waiter's, which gave back others itself: their wakes are its
    own), whenever it came since the attempt began. With `owner` (a waiter in the key's
    line), the reply is the fence of a grant of the key carried to it by a wake-up
    (`WakeBoard.take_grant`), None when none came."""

    seconds: float
    keys: tuple[str, ...] = ()
    owner: str = ""


class _Watch(NamedTuple):
    """Step: listen for releases of the key until the generator ends."""


WATCH = _Watch()

Step = Call | TakeTurn | Pause | _Watch
#: What a driver runs: steps out, replies in, and a value at the end.
Steps = Generator[Step, Any, Any]
#: An acquisition's last attempt: the store's answer, and when it was sent (monotonic).
Attempted = tuple[AcquireResult, float]
#: How many attempts an acquisition made so far (one item): read even when it raised.
Tally = list[int]
#: How an acquire ended: its last result, or the error that ended it; when its last attempt
#: was sent; the attempts made.
Outcome = tuple[AcquireResult | BaseException, float, int]


class Interrupted(BaseException):
    """Thrown into a generator by the async driver: the caller was cancelled while a `Call`
    ran (to its end: `reply` is what it returned, None if it raised). The generator undoes
    what the call did and lets it through; the driver then raises `cause`."""

    def __init__(self, cause: BaseException, reply: Any) -> None:
        super().__init__(cause)
        self.cause, self.reply = cause, reply


class Target(Protocol):
    """What the engine reads of the handle it acquires for (`core.Lock`, or a multi-key
    `multi.MultiLock`: `many`, whose store operations take its `keys`)."""

    key: str
    holder: str
    ttl: float
    mode: Mode
    #: An exclusive lock of one key (not `many`): the store's plain `acquire` and `release`
    #: take it, the hot path's one test.
    plain: bool

    @property
    def many(self) -> bool: ...

    @property
    def keys(self) -> tuple[str, ...]: ...

    @property
    def store(self) -> LockStore: ...


class Policy(NamedTuple):
    """How a waiter asks: the store operation, whether it stands in the key's line (every way
    out but the lock or a store error gives the place up) and whether it waits as a writer
    (its attempts keep new readers out for QUEUE_LEASE)."""

    op: str
    queued: bool = False
    writer: bool = False


PLAIN = Policy("acquire")
IN_LINE = Policy("acquire_queued", queued=True)
PERMIT = Policy("acquire_permit")  # a semaphore's permit or a shared lock
WRITER = Policy("acquire_permit", writer=True)
WRITER_IN_LINE = Policy("acquire_permit", queued=True, writer=True)
#: Several keys at once, all or nothing (`LockStore.acquire_many`). Not in any key's line:
#: a waiter never holds a place, nor a key, while it waits for the rest.
MANY = Policy("acquire_many")


def subject(target: Target) -> str | tuple[str, ...]:
    """What the target's store operations take: its key, or a multi-key lock's keys."""
    return target.keys if target.many else target.key


def first_policy(target: Target, wait: bool = False) -> Policy:
    """How the first attempt asks: an exclusive lock as plain `acquire` (the fast path), in
    the store's line when it keeps one and the caller `wait`s; other modes for a permit;
    several keys all at once."""
    if target.many:
        return MANY
    if target.mode is not EXCLUSIVE:
        return PERMIT
    return IN_LINE if wait and target.store.queues else PLAIN


#: The operations of an exclusive lock that turn into a writer's on finding readers (a
#: multi-key lock does not: it waits for the readers to go).
_PLAIN_OPS = ("acquire", "acquire_queued")


def _next_policy(policy: Policy, result: AcquireResult) -> Policy:
    """An exclusive lock asks plainly until it finds readers in its way; from then on, for
    the rest of the wait, as a writer waiting for them (`acquire_permit`), which keeps new
    readers out while it waits and withdraws that when it takes the lock. Taken through
    `acquire`, the mark would keep readers out of a key nobody holds until it lapsed."""
    if policy.op in _PLAIN_OPS and result.held_as == "shared":
        return WRITER_IN_LINE if policy.queued else WRITER
    return policy


def request(
    target: Target, owner: str, policy: Policy, deadline: float | None
) -> tuple[str, tuple[Any, ...]]:
    """One acquire attempt for `owner`, as `policy` asks, waiting as a writer until
    `deadline` (None: no wait): the store operation and its arguments."""
    op = policy.op
    if op != "acquire_permit":
        return op, (subject(target), owner, target.holder, target.ttl)
    # A writer's mark keeps readers out until the deadline, for QUEUE_LEASE at most: it
    # renews it with each attempt, so one that was cancelled, failed or died no longer keeps
    # readers out a moment later.
    left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
    return op, (target.key, owner, target.holder, target.ttl, target.mode, min(left, QUEUE_LEASE))


def first_request(target: Target, owner: str) -> tuple[str, tuple[Any, ...]]:
    """The one attempt of an acquire that does not wait (`once`), as `request` says it."""
    return request(target, owner, first_policy(target), None)


def ask(target: Target, owner: str, policy: Policy, deadline: float | None) -> Call:
    """`request` as a step."""
    return Call(*request(target, owner, policy, deadline))


def check(target: Target, result: AcquireResult) -> AcquireResult:
    """`result`, unless it says the key is in use by the other family of modes: a key is a
    semaphore or a lock (exclusive and shared), not both at once."""
    held = result.held_as
    if held is None or result.fence is not None:
        return result
    if (held == "semaphore") != (target.mode.kind == "semaphore"):
        key = result.blocked[0] if result.blocked else target.key
        raise ValueError(
            f"key {key!r} is held as {kind_phrase(held)} and cannot be taken as "
            f"{kind_phrase(target.mode.kind)} at the same time: a key is a semaphore or a "
            "lock, not both (use a key of its own for each); once every holder has gone it "
            "may be used either way"
        )
    return result


def kind_phrase(kind: str, *, article: bool = True) -> str:
    phrase = {"exclusive": "lock", "shared": "shared lock", "semaphore": "semaphore"}[kind]
    if not article:
        return phrase
    return f"a {phrase}" if kind != "exclusive" else "an exclusive lock"


def _pause(
    target: Target, policy: Policy, result: AcquireResult, retry_delay: float, left: float
) -> float:
    """How long to wait after the refusal `result` of an attempt asked as `policy`: not at
    all when an exclusive lock has just found readers (it asks again at once, as a writer)."""
    if _next_policy(policy, result) is not policy:
        return 0.0
    store = target.store
    pause = min(left, next_delay(retry_delay, result.retry_in, store.push_wakeups))
    # A place in the line, and a waiting writer's mark, last QUEUE_LEASE from the last
    # attempt: keep them. A caller outside the line that an exclusive holder keeps out is
    # not woken by the release when the line has a first waiter, who may never take the
    # lock (its process died; it gave up as the release came): look again as often.
    if policy.queued or policy.writer or (store.queues and result.held_as == "exclusive"):
        return min(pause, QUEUE_LEASE / 2)
    return pause


def release_op(target: Target) -> str:
    """The store operation that releases the target's acquisition (a lock's, a permit's, or
    a multi-key lock's)."""
    if target.many:
        return "release_many"
    return "release" if target.mode is EXCLUSIVE else "release_permit"


def extend_op(target: Target) -> str:
    """The store operation that extends the target's acquisition."""
    if target.many:
        return "extend_many"
    return "extend" if target.mode is EXCLUSIVE else "extend_permit"


def release_call(target: Target, owner: str, quiet: bool = False) -> Call:
    """The step that releases `owner`'s acquisition of the target."""
    return Call(release_op(target), (subject(target), owner), quiet)


def extend_call(target: Target, owner: str, seconds: float) -> Call:
    """The step that makes `owner`'s acquisition of the target live `seconds` more."""
    return Call(extend_op(target), (subject(target), owner, seconds))


def give_back(target: Target, owner: str) -> Call:
    """Release `owner`'s grant, quietly: it came too late or to a caller that has gone."""
    return release_call(target, owner, quiet=True)


def giving_back(
    target: Target, owner: str, why: str = "granted too late", step: Call | None = None
) -> Steps:
    """Give back `owner`'s grant, which came too late (`why`), by `step` (default: releasing
    what the target acquired): an error is logged, not raised (the caller is refusing, or
    raising already); the lock then lives out its ttl."""
    undone = yield give_back(target, owner) if step is None else step
    if isinstance(undone, BaseException):
        logger.warning(
            "lock %r was %s and could not be given back (%s); it expires in %gs",
            target.key,
            why,
            type(undone).__name__,
            target.ttl,
        )


#: What a grant that came too late counts as, once given back.
REFUSED = AcquireResult(None)


def late(target: Target, result: AcquireResult, sent: float) -> bool:
    """Whether `result`, of the attempt sent at monotonic time `sent`, is a grant that came
    too late: the ttl, counted from `sent`, ran out before the answer came, so the lock may
    already be someone else's (the caller gives it back)."""
    if result.fence is None or time.monotonic() < sent + target.ttl:
        return False
    logger.info(
        "lock %r was granted after its ttl of %gs ran out; not taken", target.key, target.ttl
    )
    return True


def _attempt(
    target: Target, owner: str, policy: Policy, deadline: float | None
) -> Generator[Step, Any, AcquireResult]:
    """One attempt; interrupted meanwhile, it gives back what it took."""
    try:
        result = yield ask(target, owner, policy, deadline)
    except Interrupted as stop:
        reply = stop.reply
        if reply is not None and reply.acquired:
            yield from giving_back(target, owner, "acquired as its waiter was cancelled")
        raise
    return result if result.held_as is None else check(target, result)


def once(target: Target, owner: str) -> Generator[Step, Any, Attempted]:
    """An acquisition that does not wait: one attempt."""
    sent = time.monotonic()
    result = yield from _attempt(target, owner, first_policy(target), None)
    return result, sent


def waiting(
    target: Target, owner: str, deadline: float, retry_delay: float, tally: Tally
) -> Generator[Step, Any, Attempted]:
    """An acquisition that waits until `deadline` (monotonic), polling every `retry_delay`
    where the store does not push wake-ups: the attempts (counted in `tally`) until one takes
    the lock or the deadline passes; the last one's result."""
    # A multi-key waiter takes no turn: it would hold the turns of some keys while it
    # waited for the others' (the store's all-or-nothing take is the one gate it passes).
    if not target.many and not (yield TakeTurn(deadline)):
        # The turn did not come by the deadline. Whoever has it may be stuck on a store that
        # does not answer, so ask the store once ourselves: "held by someone else" must be
        # the store's word, and an outage must reach every caller as one.
        return (yield from once(target, owner))
    policy = first_policy(target, wait=True)
    # The key in whose line the waiter stands (a multi-key waiter joins one when refused:
    # `_stand`), given up on every way out but taking the lock (the place goes with it) and
    # the store failing (the place lapses by itself, and a grant a release carries to it
    # is given back by this process's board, which finds nobody waiting as `owner` once the
    # driver's watch ends, or the grant untaken then; trying would only make the error come
    # twice as late): the deadline, a cancellation,
    # an exception from a signal handler (a task's time limit), SystemExit,
    # KeyboardInterrupt.
    place = [target.key if policy.queued else None]
    try:
        yield WATCH
        tally[0] = 0
        while True:
            tally[0] += 1
            sent = time.monotonic()
            result = yield from _try(target, owner, policy, deadline, place)
            left = deadline - time.monotonic()
            if result.fence is not None or left <= 0:
                return result, sent
            pause = _pause(target, policy, result, retry_delay, left)
            claim = owner if policy is IN_LINE and result.last_fence is not None else ""
            policy = _next_policy(policy, result)
            if pause > 0:
                carried = yield Pause(pause, result.blocked, claim)
                if carried is not None and _carried(target, carried, result, sent):
                    place[0] = None  # the release took it out of the line
                    good_for = getattr(carried, "good_for", None)  # a capped grant's
                    return AcquireResult(int(carried), good_for=good_for), sent
    except (LockStoreUnavailable, GeneratorExit):
        place[0] = None
        raise
    finally:
        if place[0] is not None:
            yield from _leave_line(target, owner, place[0])


#: The share of its ttl a waiter may have spent since its last refused attempt and still
#: take a grant carried to it: it counts the lock from that attempt, so taking the grant up
#: with a store call instead (at its whole ttl from then) is worth a round trip past this.
CARRIED_AGE = 0.25


def _carried(target: Target, fence: int, refused: AcquireResult, sent: float) -> bool:
    """Whether a waiter refused (`refused`) by the attempt sent at `sent` takes the grant of
    `fence` a wake-up carried to it (`Pause.owner`), holding the lock from `sent` for its
    ttl: the grant was made after that refusal (a fence above the refusal's `last_fence`:
    else a stale message), so the store keeps it at least that long. Not when `sent` is too
    long ago (`CARRIED_AGE`): its next attempt takes the grant up at its whole ttl."""
    if refused.last_fence is None or fence <= refused.last_fence:
        logger.debug("lock %r: a stale grant (fence %d) was ignored", target.key, fence)
        return False
    return time.monotonic() - sent < target.ttl * CARRIED_AGE


def _try(
    target: Target, owner: str, policy: Policy, deadline: float, place: list[str | None]
) -> Generator[Step, Any, AcquireResult]:
    """One attempt of a wait. A key taken from its line leaves it (`place`); a multi-key
    waiter refused on a store with lines stands in one (`_stand`)."""
    result = yield from _attempt(target, owner, policy, deadline)
    if result.fence is not None:
        if not target.many:  # a multi-key take leaves no line: the waiter leaves its own
            place[0] = None
    elif policy is MANY and result.blocked and target.store.queues:
        result = yield from _stand(target, owner, result, place)
    return result


def _stand(
    target: Target, owner: str, refused: AcquireResult, place: list[str | None]
) -> Generator[Step, Any, AcquireResult]:
    """Put a multi-key waiter that `refused` turned down in the line of the first key that
    blocked it (`place`), so that a stream of single-key waiters does not starve it: a
    release of that key wakes it, and the key goes to nobody behind it in the line.

    It stands in one line at a time, always a key someone holds, and leaves the one it stood
    in before: a free key it is first for is kept from others only until its next attempt,
    so a holder of another of its keys that waits for this one is not held up for long. A
    key the line gives it (free, and it was first) is taken with the others at once, or
    given back: the waiter holds no key while it waits. What the attempts came to."""
    key = refused.blocked[0]
    if place[0] is not None and place[0] != key:
        yield from _leave_line(target, owner, place[0])
    place[0] = key
    queued = Call("acquire_queued", (key, owner, target.holder, target.ttl))
    stood = yield from _taking(target, owner, queued)
    if stood.fence is None:
        if stood.held_as not in (None, "exclusive"):
            place[0] = None  # permits hold it: not queued
        return refused
    place[0] = None  # the key taken: out of its line
    try:
        result = yield from _taking(target, owner, ask(target, owner, MANY, None))
    except (Interrupted, GeneratorExit):
        raise  # `_taking` gave back every key
    except BaseException:
        # The store failed, or a signal handler raised (a task's time limit): the key the
        # line gave is given back, or it would stay held for its ttl.
        yield from _give_back_key(target, owner, key)
        raise
    if result.fence is None:
        yield from _give_back_key(target, owner, key)
    return result


def _give_back_key(target: Target, owner: str, key: str) -> Steps:
    """Release the one `key` a multi-key waiter took from its line; an error is logged."""
    step = Call("release", (key, owner), quiet=True)
    yield from giving_back(target, owner, f"given {key!r} by its line", step)


def _taking(target: Target, owner: str, step: Call) -> Generator[Step, Any, AcquireResult]:
    """Make `_stand`'s store call `step`; interrupted meanwhile, give back whatever key the
    waiter may hold (every key it asks for: `release_many` frees those it holds) before the
    interruption goes on."""
    try:
        return (yield step)  # type: ignore[no-any-return]
    except Interrupted:
        yield from giving_back(target, owner, "acquired as its waiter was cancelled")
        raise


def acquisition(
    target: Target, owner: str, wait: float, retry_delay: float, tally: Tally
) -> Generator[Step, Any, Attempted]:
    """One acquire for `owner`: one attempt (`wait` 0) or a wait of `wait` seconds. A grant
    that came too late is given back, and counts as refused."""
    if wait > 0:
        deadline = time.monotonic() + wait
        result, sent = yield from waiting(target, owner, deadline, retry_delay, tally)
    else:
        result, sent = yield from once(target, owner)
    if late(target, result, sent):
        yield from giving_back(target, owner)
        result = REFUSED
    return result, sent


def _leave_line(target: Target, owner: str, key: str) -> Generator[Step, Any, None]:
    """Give up `owner`'s place in `key`'s line: the next in line is not held up. An error
    is logged, not raised (the wait may be raising already); the place lapses by itself."""
    error = yield Call("leave_queue", (key, owner), quiet=True)
    if isinstance(error, Exception):  # not a cancellation of the call itself
        unreachable = isinstance(error, LockStoreUnavailable)
        logger.log(
            logging.DEBUG if unreachable else logging.WARNING,
            "lock %r: could not leave the line of waiters (%s: %s); the place lapses in %gs",
            key,
            type(error).__name__,
            error,
            QUEUE_LEASE,
            exc_info=None if unreachable else error,
        )
