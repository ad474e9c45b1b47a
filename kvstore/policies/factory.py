"""Build an eviction policy from its configured name.

The server config names the policy as a string; keeping the name -> class
table here means adding a policy touches one file, and a typo in the config
fails loudly with the list of valid names instead of a KeyError.
"""

from __future__ import annotations

from typing import Any

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
}

#: Names accepted by :func:`make_policy`, in a stable order.
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """Instantiate the policy called ``name`` with constructor ``options``.

    Raises ``ValueError`` naming the valid choices if ``name`` is unknown;
    unknown ``options`` raise ``TypeError`` from the constructor.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        valid = ", ".join(repr(n) for n in POLICY_NAMES)
        raise ValueError(f"unknown eviction policy {name!r}; valid names: {valid}") from None
    return cls(**options)
