"""The same-node fast path of the control plane: a binary protocol on the daemon's arena socket.

    protocol.py   frames and bodies, encode and decode (sans-IO: no sockets), the one definition both ends use
    wire.py       the field encodings and the bounds-checked body Reader every body codec uses
    spare_bodies.py  the SPARE and STORE bodies: slots held ahead of a connection's puts, a put in one request
    sockets.py    the two socket chores both ends share (the protocol itself stays sans-IO)
    key_index.py  the shared key index: the daemon's writable table per tenant, a client's read-only view

The daemon's side is kvstore/server/fast_server.py, the client's kvstore/client/fast_channel.py; both call the
operations in kvstore/server/ops.py (daemon) through this format.
"""
