"""Build an eviction policy from its configured name.

The server config names the policy as a string; keeping the name -> class
table here means adding a policy touches one file, and a typo in the config
fails loudly (ConfigError) with the list of valid names instead of a KeyError.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
}

#: Names accepted by :func:`make_policy`, in a stable order.
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class of the policy called ``name``; ConfigError naming the valid choices if there is none.

    The daemon's config checks its `policy` setting with this, so the rule lives here, once.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"invalid config: policy={name!r}: use one of {', '.join(POLICY_NAMES)}") from None


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """Instantiate the policy called ``name`` with constructor ``options``.

    Raises ConfigError (kvstore.errors) for an unknown ``name`` (naming the valid choices) and for options the
    policy refuses (unknown ones, or values out of range: the constructor's own message is kept).
    """
    cls = policy_class(name)
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: policy {name!r} options {options!r}: {exc}") from exc
