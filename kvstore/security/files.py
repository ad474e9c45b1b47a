"""Permission checks: a secret another local user can read, or a directory another user can write, is refused
at startup with a message that says how to fix it (the daemon never runs half-protected)."""

from __future__ import annotations

import os
import stat

from kvstore.errors import ConfigError

__all__ = ["check_private_file", "check_not_world_writable_dir", "unreadable"]


def unreadable(what: str, path: str, exc: OSError) -> ConfigError:
    """The one-line error for a file a setting names but the daemon cannot read, with the usual fixes: the
    path is wrong, or (Kubernetes) the Secret mounted there lacks that key or is not mounted at all."""
    fix = ("correct the path, or create the file" if exc.errno != 13 else "make it readable by the daemon's user")
    return ConfigError(f"{what} {path}: cannot read it ({exc.strerror}): {fix} (in Kubernetes: the Secret mounted "
                       f"at {os.path.dirname(path) or '.'} must hold the key {os.path.basename(path)!r}), or unset "
                       f"{what}")


def check_private_file(path: str, what: str) -> None:
    """Refuse a secret file that others can read or write (group or world), or that is not a regular file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise unreadable(what, path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} is readable or writable by other users (mode {stat.S_IMODE(st.st_mode):o}):"
                          f" run `chmod 600 {path}`")


def check_not_world_writable_dir(path: str, what: str) -> None:
    """Refuse a directory any local user may write into (even with the sticky bit: another user could create
    our socket or files there first), or one owned by another (non-root) user, who could swap its contents.
    A directory that does not exist yet is created 0700 by the daemon itself."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot stat it ({exc.strerror})") from exc
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root: "
                          "use a directory of your own")
    if st.st_mode & 0o002:
        raise ConfigError(f"{what} {path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}): use a private "
                          f"directory (e.g. `chmod 700 {path}`, or a path under $XDG_RUNTIME_DIR)")
