"""Dataclass <-> protobuf message, field by field BY NAME: one vocabulary for Stats on both sides of the wire.

Why: the Stats family (engine snapshot -> StatsResponse -> the client's typed Stats) used to be copied field by
field in hand-written positional constructors on both sides, so adding a stat meant editing four places and a
slip put one number under another's name. Here a dataclass field maps to the message field of the same name,
so adding a stat is one dataclass field plus one proto field, and a dataclass field the message lacks is an
error that says so (never a silently dropped number).

    to_message(obj, MessageType, *, ignore=(), **given)   dataclass -> message
    from_message(Class, msg, **given)                     message -> dataclass

Rules, both directions:
  * scalars and enums (IntEnum values are ints) copy as they are;
  * a nested dataclass <-> a sub-message; list[dataclass] <-> repeated message; list <-> repeated scalar;
    dict <-> map (scalar or message values; from_message returns the map sorted by key, so output is stable);
  * `given` supplies (or overrides) fields the object does not hold itself, by message field name (to_message)
    or dataclass field name (from_message); a dataclass, list of dataclasses or message is converted as above;
  * a dataclass field may declare a different wire name with `field(metadata=wire("arena.shm_name"))` (a dotted
    path reads a sub-message's field; from_message only), or that it is not on the wire: `metadata=LOCAL`;
  * to_message: a None value leaves the field unset; `ignore` names fields of `obj` that are not for the wire;
  * from_message: a field typed `X | None` is None when the sub-message is unset or has `enabled` = false
    (the proto's convention for an optional tier: DiskTierStats, PeerTierStats).
Fields the message has and the dataclass lacks are fine: a dataclass may be a view of part of a message.

Not for the hot path (Reserve/Lookup keep their packed arrays): a mapped message costs about twice a
hand-written constructor call (KeyInfo: ~13 us against ~6 us on a busy 2-core machine).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

__all__ = ["PbMapError", "to_message", "from_message", "wire", "LOCAL"]

T = TypeVar("T")
M = TypeVar("M", bound=Message)
_KEY = "kvstore.pbmap"  # dataclass field metadata key: the wire name, or None for a local-only field
_LOCAL = object()


# plans per pair of types, built on first use (a dict write is atomic under the GIL: a race builds one twice)
_KINDS: dict[type, dict[str, bool]] = {}
_OUT_PLANS: dict[tuple[type, type], Any] = {}
_IN_PLANS: dict[tuple[type, type], Any] = {}


class PbMapError(TypeError):
    """A dataclass and a message disagree on a name: a programming error, caught by the first test that maps."""


def wire(path: str) -> dict[str, Any]:
    """Field metadata for a dataclass field whose message field has another name:
    `is_self: bool = field(metadata=wire("self"))`, or lives in a sub-message: `wire("arena.shm_name")`
    (from_message only). Metadata rather than a field() wrapper, so type checkers still see a plain field."""
    return {_KEY: path}


LOCAL: dict[str, Any] = {_KEY: _LOCAL}
"""Field metadata for a dataclass field that is not on the wire (filled in by the receiving side; give it a
default): `client_data: str = field(default="", metadata=LOCAL)`."""


# -- dataclass -> message ------------------------------------------------------------------------------------
def to_message(obj: Any, message_type: type[M], /, *, ignore: Iterable[str] = (), **given: Any) -> M:
    """A new `message_type` holding obj's fields (and `given`) by name; PbMapError names what does not match."""
    plan, missing = _out_plan(type(obj), message_type)
    kinds = _kinds(message_type)
    skip = set(ignore).union(given) if ignore or given else ()
    for attr in missing:
        if attr not in skip:
            raise PbMapError(_missing(type(obj), attr, message_type.DESCRIPTOR, attr))
    values = [(name, getattr(obj, attr)) for attr, name in plan if attr not in skip]
    for name, value in given.items():
        if name not in kinds:
            raise PbMapError(f"{message_type.DESCRIPTOR.full_name} has no field {name!r} (given to to_message): "
                             "check the name against proto/kvstore/v1/kvstore.proto")
        values.append((name, value))
    direct: dict[str, Any] = {}  # what the message's constructor takes as it is (the fast way in)
    nested = []
    for name, value in values:
        if value is None:
            continue
        if kinds[name] or isinstance(value, Message):
            direct[name] = value
        else:
            nested.append((name, value))
    msg = message_type(**direct)
    for name, value in nested:
        _put(msg, message_type.DESCRIPTOR.fields_by_name[name], value)
    return msg


def _kinds(message_type: type[Message]) -> dict[str, bool]:
    """Message field -> whether its constructor takes a plain value (scalar, list of scalars, scalar map)."""
    got = _KINDS.get(message_type)
    if got is not None:
        return got
    out = {}
    for fd in message_type.DESCRIPTOR.fields:
        if _is_map(fd):
            out[fd.name] = fd.message_type.fields_by_name["value"].message_type is None
        else:
            out[fd.name] = fd.message_type is None
    _KINDS[message_type] = out
    return out


OutPlan = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]


def _out_plan(cls: type, message_type: type[Message]) -> OutPlan:
    """(dataclass attribute, message field) pairs, and the dataclass fields the message lacks (an error unless
    the caller ignores or gives them). Built once per pair of types."""
    got = _OUT_PLANS.get((cls, message_type))
    if got is not None:
        return got
    if not dataclasses.is_dataclass(cls):
        raise PbMapError(f"to_message needs a dataclass, got {cls.__name__}")
    desc = message_type.DESCRIPTOR
    plan, missing = [], []
    for f in dataclasses.fields(cls):
        name = f.metadata.get(_KEY, f.name)
        if name is _LOCAL:
            continue
        if name in desc.fields_by_name:
            plan.append((f.name, name))
        else:
            missing.append(f.name)
    out = _OUT_PLANS[(cls, message_type)] = (tuple(plan), tuple(missing))
    return out


def _put(msg: Message, fd: FieldDescriptor, value: Any) -> None:
    name = fd.name
    if _is_map(fd):
        target = getattr(msg, name)
        value_fd = fd.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_fd.message_type is None:
                target[k] = v
            else:
                _fill(target[k], v)
    elif _is_repeated(fd):
        if fd.message_type is None:
            getattr(msg, name).extend(value)
        else:
            target = getattr(msg, name)
            for item in value:
                _fill(target.add(), item)
    elif fd.message_type is not None:
        sub = getattr(msg, name)
        sub.SetInParent()
        _fill(sub, value)
    else:
        setattr(msg, name, value)


def _fill(sub: Message, value: Any) -> None:
    """Copy a message, or a dataclass mapped by name, into the (sub-)message `sub`."""
    if isinstance(value, Message):
        sub.CopyFrom(value)
        return
    desc = sub.DESCRIPTOR
    plan, missing = _out_plan(type(value), type(sub))
    if missing:
        raise PbMapError(_missing(type(value), missing[0], desc, missing[0]))
    for attr, name in plan:
        v = getattr(value, attr)
        if v is not None:
            _put(sub, desc.fields_by_name[name], v)


# -- message -> dataclass ------------------------------------------------------------------------------------
def from_message(cls: type[T], msg: Message, /, **given: Any) -> T:
    """A `cls` built from msg's fields by name (plus `given`); PbMapError names a field the message lacks."""
    kwargs: dict[str, Any] = {}
    for attr, read in _in_plan(cls, type(msg)):
        kwargs[attr] = given[attr] if attr in given else read(msg)
    unknown = set(given) - set(kwargs)
    if unknown:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # _in_plan checked: a dataclass
        bad = sorted(unknown - names)
        if bad:
            raise PbMapError(f"{cls.__name__} has no field {', '.join(map(repr, bad))} (given to from_message)")
        kwargs.update((k, given[k]) for k in unknown)
    return cls(**kwargs)


Reader = Callable[[Message], Any]
InPlan = tuple[tuple[str, Reader], ...]


def _in_plan(cls: type, message_type: type[Message]) -> InPlan:
    """(dataclass attribute, reader of its message field) pairs. Built once per pair of types."""
    got = _IN_PLANS.get((cls, message_type))
    if got is not None:
        return got
    if not dataclasses.is_dataclass(cls):
        raise PbMapError(f"from_message needs a dataclass, got {cls.__name__}")
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        path = f.metadata.get(_KEY, f.name)
        if path is _LOCAL:
            continue
        desc: Descriptor = message_type.DESCRIPTOR
        parts = path.split(".")
        for i, part in enumerate(parts):
            fd = desc.fields_by_name.get(part)
            if fd is None or (i < len(parts) - 1 and fd.message_type is None):
                raise PbMapError(_missing(cls, f.name, message_type.DESCRIPTOR, path))
            desc = fd.message_type
        plan.append((f.name, _reader(parts, fd, hints[f.name], cls)))
    out = _IN_PLANS[(cls, message_type)] = tuple(plan)
    return out


def _reader(parts: list[str], fd: FieldDescriptor, hint: Any, cls: type) -> Reader:
    """A function reading one field (at `parts`) of a message into the value the dataclass field holds."""
    *outer, name = parts

    def container(msg: Message) -> Message:
        for p in outer:
            msg = getattr(msg, p)
        return msg

    inner, optional = _unwrap_optional(hint)
    if _is_map(fd):
        if fd.message_type.fields_by_name["value"].message_type is None:
            return lambda m: dict(sorted(getattr(container(m), name).items()))
        value_type = _arg(inner, 1)
        return lambda m: {k: from_message(value_type, v) for k, v in sorted(getattr(container(m), name).items())}
    if _is_repeated(fd):
        seq = tuple if typing.get_origin(inner) is tuple else list
        if fd.message_type is None:
            return lambda m: seq(getattr(container(m), name))
        item_type = _arg(inner, 0)
        return lambda m: seq(from_message(item_type, x) for x in getattr(container(m), name))
    if fd.message_type is not None:
        if not (isinstance(inner, type) and dataclasses.is_dataclass(inner)):
            raise PbMapError(f"{cls.__name__}.{parts[-1]}: message field {fd.full_name} needs a dataclass type, "
                             f"not {hint!r}")
        enabled = "enabled" in fd.message_type.fields_by_name

        def read_sub(m: Message) -> Any:
            holder = container(m)
            sub = getattr(holder, name)
            if optional and (not holder.HasField(name) or (enabled and not sub.enabled)):
                return None
            return from_message(inner, sub)
        return read_sub
    return lambda m: getattr(container(m), name)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _arg(hint: Any, i: int) -> Any:
    args: tuple[Any, ...] = typing.get_args(hint)
    if len(args) <= i or not isinstance(args[i], type) or not dataclasses.is_dataclass(args[i]):
        raise PbMapError(f"a repeated or map message field needs list[Dataclass] or dict[K, Dataclass], not {hint!r}")
    return args[i]


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _is_repeated(fd: FieldDescriptor) -> bool:
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 6; `label` before it
    return bool(repeated) if repeated is not None else fd.label == FieldDescriptor.LABEL_REPEATED


def _missing(cls: type, attr: str, desc: Descriptor, name: str) -> str:
    return (f"{cls.__name__}.{attr} has no field {name!r} in message {desc.full_name}: add it to "
            "proto/kvstore/v1/kvstore.proto (same name; then `make setup` rebuilds the stubs), rename the dataclass "
            "field to the proto's name, or give it metadata=pbmap.LOCAL when it is not for the wire")
