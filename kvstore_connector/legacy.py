"""The connector's old import name, `connector`, served by an import hook where no package of that name exists.

In an installed wheel (which claims no generic top-level name) vLLM imports a configured module path before it
looks at its registry, so a config that still names ``connector.vllm_connector`` needs that module: plugin.py adds
`LegacyPathFinder` last in sys.meta_path, and it answers `connector` and `connector.vllm_connector` only when
nothing else on the path provides them (a package of that name elsewhere wins; in a checkout the repository's
connector/ folder is that alias). The module holds the one `KVStoreConnector` class (no second copy of the
package is imported) and its import warns (deprecation.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from kvstore_connector.deprecation import DEPRECATION, OLD_MODULE, OLD_PACKAGE, warn

__all__ = ["LegacyPathFinder", "install"]


class _LegacyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a plain module, filled by exec_module

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = f"Deprecated alias of kvstore_connector (kvstore_connector/legacy.py): {DEPRECATION}"
        if module.__name__ == OLD_MODULE:
            warn()
            from kvstore_connector import vllm_connector

            module.KVStoreConnector = vllm_connector.KVStoreConnector  # type: ignore[attr-defined]
            module.__all__ = ["KVStoreConnector"]  # type: ignore[attr-defined]


class LegacyPathFinder(importlib.abc.MetaPathFinder):
    """Answers the two old names only; every other import goes to the finders before it."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (OLD_PACKAGE, OLD_MODULE):
            return None
        return importlib.util.spec_from_loader(fullname, _LegacyLoader(), is_package=fullname == OLD_PACKAGE)


def install() -> None:
    """Add the finder last in sys.meta_path, once per process."""
    if not any(isinstance(f, LegacyPathFinder) for f in sys.meta_path):
        sys.meta_path.append(LegacyPathFinder())
