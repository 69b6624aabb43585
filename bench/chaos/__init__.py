"""A Jepsen-style chaos run: workers take locks on a few keys and write a fenced PostgreSQL row
while a nemesis kills, pauses and cuts them off and restarts their store; a checker then reads
the whole history. `python -m bench.chaos --help`; bench/README.md has the method."""
