"""The namespace table: registration (a namespace's description is fixed once given), lookup by name, owners.

A namespace is named by RPCs and described by (model, layout digest, tenant, tokens per block); registering
it again with another description is a ConflictError that says how to fix it. Namespaces known only from the
disk tier after a restart are `recovered`: the next registration adopts its description. The namespaces
themselves live in the catalog (catalog.py); this part holds the rules. `check` runs with no lock; the rest is
called under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.engine.catalog import Catalog, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.errors import ConflictError, InvalidRequestError, UnknownNamespaceError
from kvstore.tiers.disk import DISK_CODECS
from kvstore.validation import check_label, check_namespace_name, check_tokens_per_block

__all__ = ["NamespaceTable"]


class NamespaceTable:
    """Name -> Namespace with the registration rules. Called under the engine's lock (but `check`)."""

    def __init__(self, cat: Catalog, config: EngineConfig) -> None:
        self._cat = cat
        self._config = config

    def recover(self, names: list[str]) -> None:
        """Namespaces found in the disk tier at start: known, undescribed until registered again (those a
        hand-over already brought are skipped)."""
        for name in names:
            if name not in self._cat.by_name:
                self._cat.add_namespace(name, "", "", "", recovered=True)

    def adopt(self, described: dict[int, dict[str, object]]) -> set[int]:
        """A previous daemon's namespaces under their own ids (its journal names entries by id), on an empty
        table. An id whose description is missing or does not pass the registration rules becomes a namespace
        no RPC can name (`_lost_namespace_<id>`: an underscore is outside the name rules) and is returned: its
        entries are not adopted."""
        lost: set[int] = set()
        top = max(described) + 1 if described else 0
        for ns_id in range(top):
            d = described.get(ns_id)
            try:
                if d is None:
                    raise InvalidRequestError("no description")
                name, codec, tpb = d.get("name"), d.get("disk_codec"), d.get("tokens_per_block")
                labels = [d.get(k) for k in ("model", "layout_digest", "tenant")]
                if not isinstance(name, str) or name in self._cat.by_name or not all(isinstance(v, str) for v in labels):
                    raise InvalidRequestError("bad name or labels")
                check_namespace_name(name)
                for what, value in zip(("model", "layout_digest", "tenant"), labels):
                    check_label(what, str(value))
                if codec not in DISK_CODECS[1:] or not isinstance(tpb, int) or isinstance(tpb, bool):
                    raise InvalidRequestError("bad codec or tokens_per_block")
                check_tokens_per_block(tpb or None)
            except InvalidRequestError:
                self._cat.add_namespace(f"_lost_namespace_{ns_id}", "", "", "", recovered=True)
                lost.add(ns_id)
                continue
            ns = self._cat.add_namespace(name, str(labels[0]), str(labels[1]), str(labels[2]), str(codec),
                                         recovered=bool(d.get("recovered", False)))
            ns.tokens_per_block = int(tpb)
        return lost

    def check(self, name: str, model: str, layout_digest: str, tenant: str, disk_codec: str,
              tokens_per_block: int | None) -> str:
        """Validate a registration (no lock needed); returns the codec it gets ('' picks the default)."""
        check_namespace_name(name)
        check_tokens_per_block(tokens_per_block)
        for what, value in (("model", model), ("layout_digest", layout_digest), ("tenant", tenant)):
            check_label(what, value)
        if disk_codec not in DISK_CODECS:
            raise InvalidRequestError(f"disk_codec={disk_codec!r}: use one of {', '.join(DISK_CODECS[1:])} or ''")
        return disk_codec or self._config.disk_codec

    def register(self, name: str, model: str, layout_digest: str, tenant: str, codec: str, tpb: int,
                 on_new_tenant: Callable[[Namespace], None]) -> bool:
        """True when created; False when it existed with the same description (ConflictError otherwise).
        `on_new_tenant` runs when a recovered namespace gets another tenant under isolate_tenants (its RAM
        copies sit in the old tenant's memory file)."""
        ns = self._cat.by_name.get(name)
        if ns is None:
            ns = self._cat.add_namespace(name, model, layout_digest, tenant, codec)
            ns.tokens_per_block = tpb
            self._cat.namespace_changed(ns)
            return True
        if ns.recovered:  # came back from the disk tier after a restart: adopt the description
            if self._config.isolate_tenants and tenant != ns.tenant:
                on_new_tenant(ns)
            ns.model, ns.layout_digest, ns.tenant, ns.disk_codec = model, layout_digest, tenant, codec
            ns.tokens_per_block = tpb
            ns.recovered = False
            self._cat.namespace_changed(ns)
            return False
        if (ns.model, ns.layout_digest, ns.tenant) != (model, layout_digest, tenant):
            raise ConflictError(
                f"namespace {name!r} is registered as model={ns.model!r} layout={ns.layout_digest!r} "
                f"tenant={ns.tenant!r}: a different layout needs a different namespace name"
            )
        if tpb and tpb != ns.tokens_per_block:
            was = f"tokens_per_block={ns.tokens_per_block}" if ns.tokens_per_block else "no tokens_per_block"
            raise ConflictError(
                f"namespace {name!r} is registered with {was}, not {tpb}: a different block size needs a "
                "different namespace name (register it once, with its tokens_per_block, before any other tool)"
            )
        return False

    def get(self, name: str) -> Namespace:
        """The namespace; UnknownNamespaceError (or InvalidRequestError for a malformed name) otherwise."""
        ns = self._cat.by_name.get(name)
        if ns is None:
            check_namespace_name(name)
            raise UnknownNamespaceError(f"unknown namespace {name!r}: register it first (RegisterNamespace)")
        return ns

    def assign_recovered_tenants(self, owners: dict[str, str]) -> None:
        for ns in self._cat.namespaces:
            if ns.recovered and ns.name in owners:
                ns.tenant = owners[ns.name]
                self._cat.namespace_changed(ns)

    def owner(self, name: str) -> tuple[str, bool] | None:
        ns = self._cat.by_name.get(name)
        return None if ns is None else (ns.tenant, ns.recovered)
