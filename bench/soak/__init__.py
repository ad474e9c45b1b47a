"""`python -m bench.soak --minutes M`: a bounded chaos soak on loopback (driver.py: faults; worker.py: clients;
checks.py: the end-of-run invariants; values.py: block contents derived from keys). Last line: one JSON object."""
