"""A process campaigning in an election, for tests and the bench:

    python -m tests.support.candidate --store S --name N --ttl T --log PATH [--hold SECONDS]

Campaigns; once leader appends "elected <term> <pid> <wall time>" to PATH, leads for --hold
seconds (default: until killed or stopped), then appends "resign <term> <pid> <wall time>"
and resigns (--end resign), or exits without resigning (--end exit: interpreter exit must
resign for it). --thread: campaign from a thread other than the main one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .child import setup_django


def note(path: str, *words: object) -> None:
    with open(path, "a") as log:
        log.write(" ".join(map(str, [*words, os.getpid(), f"{time.time():.6f}"])) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, default=2)
    parser.add_argument("--log", required=True)
    parser.add_argument("--hold", type=float, default=None)
    parser.add_argument("--end", choices=["resign", "exit"], default="resign")
    parser.add_argument("--thread", action="store_true", help="campaign from another thread")
    args = parser.parse_args(argv)
    setup_django()
    from django_keel_lock import election

    leader = election(args.name, ttl=args.ttl, store=args.store, holder=f"candidate:{os.getpid()}")
    note(args.log, "candidate", "-")
    if args.thread:  # as a web or task worker's thread would
        import threading

        terms: list[int] = []
        campaigning = threading.Thread(target=lambda: terms.append(leader.campaign()))
        campaigning.start()
        campaigning.join()
        (term,) = terms
    else:
        term = leader.campaign()
    note(args.log, "elected", term)
    if args.hold is None:
        while True:
            time.sleep(3600)
    time.sleep(args.hold)
    note(args.log, "resign", term)
    if args.end == "resign":
        leader.resign()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
