"""Test support that runs the real parts: used by tests/, bench/ and the demo, shipped so that a downstream
project (a connector, a deployment check) can start a real daemon the same way.

    daemon.py      DaemonProcess: a real kvstore-server on a free loopback port and a private socket;
                   free_port, wait_until (poll with a deadline instead of sleeping), raw_stub
    etcd.py        EtcdProcess: a real etcd on free ports (stop / start keep its data); peer_options, the
                   DaemonProcess options that make a daemon join it; etcd_binary
    gated_io.py    GatedIO: a real BlockIO that holds a chosen disk call at a gate (an explicit sync point),
                   on top of FaultyIO (kvstore/tiers/disk/io.py), which makes chosen calls fail
    fuzz.py        random and malformed requests for every RPC and frames for the peer data port
    fuzz_fast.py   random and malformed frames for the same-node fast path
    systemd.py     FakeSystemd: sd_notify with the fd store, and the descriptors passed at the next start

Only daemon.py's and etcd.py's names are re-exported here (`from kvstore.testing import DaemonProcess`): they
need nothing beyond the client. gated_io (the disk tier) and the fuzzers (the proto descriptors, hypothesis-
friendly sources) are imported from their modules by the tests that use them.
"""

from kvstore.testing.daemon import DaemonProcess, free_port, raw_stub, wait_until
from kvstore.testing.etcd import EtcdProcess, etcd_binary, peer_options

__all__ = ["DaemonProcess", "free_port", "wait_until", "raw_stub", "EtcdProcess", "etcd_binary", "peer_options"]
