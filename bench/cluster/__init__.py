"""`python -m bench.cluster`: N real daemons on one real etcd, replaying agent sessions, through membership churn.

    __main__.py  `python -m bench.cluster` runs cli.main
    cli.py     arguments, the runs (one node with capacity C; N = 1, 2, 4, 8 nodes sharing C; churn), the JSON
    rig.py     etcd and the daemons: start, join, kill -9, leave (SIGTERM), restart
    drive.py   the replay loop across nodes (round-robin or by session), one record per request
    churn.py   when each event happens and what it cost: failed calls, wrong bytes, hit-rate dip, recovery
    report.py  the table and the plot (hit rate over time, events marked)
    scale.py   `python -m bench.cluster.scale`: 16 to 1,024 nodes simulated (placement, hand-off, fan-out, etcd)
"""
