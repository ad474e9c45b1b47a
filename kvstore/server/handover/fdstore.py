"""systemd's file descriptor store: the arena's memory files outlive a daemon that stops or crashes.

Under systemd (Type=notify, FileDescriptorStoreMax= in deploy/systemd/kvstore.service) the daemon hands every
arena file and its RAM journal to systemd with `FDSTORE=1` (sd_notify's protocol: a datagram to
$NOTIFY_SOCKET with the descriptor attached), named `kvstore-journal` and `kvstore-arena-<i>` (i: the domain's
index in the journal, 0 = the shared file). When the service restarts (systemctl restart, a crash with
Restart=on-failure, an upgrade by package), systemd passes them back ($LISTEN_FDS, $LISTEN_FDNAMES, $LISTEN_PID:
sd_listen_fds' protocol) and the new daemon adopts what verifies (inherit.py), as after a hand-over but without
the live state (new incarnation, leases and reservations gone). A daemon that starts cold removes the old
descriptors from the store (FDSTOREREMOVE=1), so their memory goes.

Memory: the store holds the files, so their memory stays allocated while the service is restarting; it goes
when the unit stops for good (FileDescriptorStorePreserve=no) or the new daemon removes them.

Both protocols are a few lines of socket code; no libsystemd needed. `fdstore = auto` (the default) uses the
store when $NOTIFY_SOCKET is set, `on` requires it, `off` never uses it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

from kvstore.arena.journal import JournalMismatch, RamJournal
from kvstore.arena.layout import ArenaLayout
from kvstore.errors import ConfigError
from kvstore.server.config.rules import FDSTORE_MODES
from kvstore.server.handover.inherit import Inherited, open_arena

__all__ = ["Notifier", "listen_fds", "inherited_from_store", "JOURNAL_NAME", "arena_name", "FDSTORE_MODES"]

log = logging.getLogger(__name__)

JOURNAL_NAME = "kvstore-journal"
_FIRST_FD = 3  # SD_LISTEN_FDS_START


def arena_name(index: int) -> str:
    return f"kvstore-arena-{index}"


class Notifier:
    """sd_notify to $NOTIFY_SOCKET (a no-op without one), and the fd store when `mode` allows it."""

    def __init__(self, mode: str, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        if mode not in FDSTORE_MODES:
            raise ConfigError(f"fdstore={mode!r}: use one of {', '.join(FDSTORE_MODES)}")
        addr = env.get("NOTIFY_SOCKET", "")
        if mode == "on" and not addr:
            raise ConfigError("fdstore=on but $NOTIFY_SOCKET is not set: run under systemd with Type=notify and "
                              "FileDescriptorStoreMax= (deploy/systemd/kvstore.service), or set fdstore=auto")
        self._addr = ("\0" + addr[1:]) if addr.startswith("@") else addr
        self.store_enabled = bool(addr) and mode != "off"
        self.stored: dict[str, int] = {}  # names this daemon put in the store

    @property
    def active(self) -> bool:
        return bool(self._addr)

    def notify(self, message: str, fds: list[int] | None = None) -> bool:
        if not self._addr:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(self._addr)
                if fds:
                    socket.send_fds(s, [message.encode()], fds)
                else:
                    s.send(message.encode())
            return True
        except OSError as exc:
            log.warning("sd_notify %r failed: %s", message.split("\n", 1)[0], exc)
            return False

    def store(self, name: str, fd: int) -> None:
        """Keep `fd` in systemd's store under `name` (replacing what was stored under it)."""
        if not self.store_enabled:
            return
        self.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
        if self.notify(f"FDSTORE=1\nFDNAME={name}", [fd]):
            self.stored[name] = fd

    def remove(self, name: str) -> None:
        if self.store_enabled:
            self.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
            self.stored.pop(name, None)


def listen_fds(environ: MutableMapping[str, str] | None = None, unset: bool = True) -> dict[str, list[int]]:
    """The descriptors systemd passed to this process, by name ({} when none, or not for this pid). `unset`
    removes the variables so that a child (a successor started by SIGUSR2) does not take them for its own."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    try:
        if int(env.get("LISTEN_PID", "0")) != os.getpid():
            return {}
        n = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    out: dict[str, list[int]] = {}
    for i in range(max(0, n)):
        fd = _FIRST_FD + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue
        out.setdefault(names[i] if i < len(names) else "unknown", []).append(fd)
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    return out


def inherited_from_store(layout: ArenaLayout, passed: dict[str, list[int]], *, isolated: bool,
                         lock: str) -> Inherited | None:
    """What systemd passed back of a previous daemon's arena (None: nothing), mapped as its journal says; an
    Inherited without an arena (and `why`) when it cannot be used: the daemon then starts cold."""
    journals = passed.get(JOURNAL_NAME, [])
    arenas = {name: fds for name, fds in passed.items() if name.startswith("kvstore-arena-")}
    if not journals and not arenas:
        return None
    for fd in journals[1:] + [fd for fds in arenas.values() for fd in fds[1:]]:
        os.close(fd)
    inh = Inherited("fd store")
    if not journals:
        for fds in arenas.values():
            os.close(fds[0])
        inh.why = "systemd kept arena files but no RAM journal"
        return inh
    try:
        peek = RamJournal.open(os.dup(journals[0]), layout)
        domains = peek.domains()
        peek.close()
    except JournalMismatch as exc:
        for fd in [journals[0]] + [fds[0] for fds in arenas.values()]:
            os.close(fd)
        inh.why = str(exc)
        return inh
    files: dict[str, int] = {}
    for name, fds in arenas.items():
        try:
            index = int(name.rsplit("-", 1)[1])
        except ValueError:
            index = -1
        if index in domains:
            files[domains[index]] = fds[0]
        else:
            os.close(fds[0])
    inh.arena, inh.why = open_arena(layout, journals[0], files, isolated=isolated, lock=lock)
    return inh
