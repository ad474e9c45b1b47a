"""Python client of kvstore-server (see client.py)."""

from kvstore.client.client import Client
from kvstore.client.types import Health, KeyInfo, Lease, NamespaceInfo, PutResult, Reservation, SizeClassInfo, Stats

__all__ = ["Client", "Health", "KeyInfo", "Lease", "NamespaceInfo", "PutResult", "Reservation", "SizeClassInfo", "Stats"]
