"""Python client of kvstore-server (see client.py)."""

from kvstore.client.client import Client, EventStream
from kvstore.client.types import Health, KeyInfo, KVEvent, Lease, NamespaceInfo, PutResult, Reservation, SizeClassInfo, Stats

__all__ = ["Client", "EventStream", "KVEvent", "Health", "KeyInfo", "Lease", "NamespaceInfo", "PutResult", "Reservation", "SizeClassInfo", "Stats"]
