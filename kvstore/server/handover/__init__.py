"""Restarts that keep the RAM tier: a running daemon hands everything to its successor, or systemd keeps the files.

    protocol.py   the hand-over's messages on <unix_socket>.handover (a header, a JSON body, blobs, descriptors)
    auth.py       who may take the files: this daemon's user, proving it holds the whole tokens file
    sender.py     the running daemon's side: a listener and one session at a time (offer, prepare, freeze,
                  commit or abort and resume)
    receiver.py   the successor's side (--take-over): take, verify, get ready, take over
    codec.py      the live state, the session book as message bodies and blobs, checked on the way in
    inherit.py    what a successor starts from (Inherited), the arena mapped again, every record verified
    fdstore.py    systemd's file descriptor store: sd_notify, the descriptors passed back at start
    start.py      what a daemon starts from: a hand-over, else systemd's fd store, else nothing
    holds.py      sync points the adversarial tests hold a side at, to kill it there

The daemon's own part (offer .. decline) is kvstore/server/handover_host.py; the gRPC gate, kvstore/server/gate.py.
"""
