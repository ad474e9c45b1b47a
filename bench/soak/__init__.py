"""`python -m bench.soak --minutes M`: a bounded chaos soak on loopback. Last line: one JSON object.

    __main__.py   the command line
    driver.py     the driver: daemons, clients, and the faults it rotates
    worker.py     a client process: puts, gets and prefix lookups, verifying every byte it reads
    values.py     block sizes and contents derived from their keys
    checks.py     the end-of-run invariants
"""
