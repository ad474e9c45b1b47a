"""The connector's old import name and what to write instead: the names and the warning, apart from the import
hook that serves them (legacy.py), so that the connector's facade can name them without importing the hook.

Until the plugin entry point (plugin.py) a vLLM config named the connector by its module path,
``"kv_connector_module_path": "connector.vllm_connector"``, and the wheel installed the package under that generic
top-level name. It installs as `kvstore_connector` now; the old path keeps working (legacy.py, and the checkout's
connector/ folder), with this warning.
"""

from __future__ import annotations

import warnings

__all__ = ["OLD_PACKAGE", "OLD_MODULE", "NEW_MODULE", "DEPRECATION", "names_old_path", "warn"]

OLD_PACKAGE = "connector"
OLD_MODULE = "connector.vllm_connector"
NEW_MODULE = "kvstore_connector.vllm_connector"
DEPRECATION = (f"kv_connector_module_path {OLD_MODULE!r} is deprecated and will be removed: installing kvstore "
               "registers KVStoreConnector with vLLM, so drop kv_connector_module_path from --kv-transfer-config "
               f"(or write {NEW_MODULE!r})")


def names_old_path(module_path: object) -> bool:
    """Whether a kv_connector_module_path is one of the old names."""
    return module_path in (OLD_PACKAGE, OLD_MODULE)


def warn() -> None:
    """The DeprecationWarning an import of the old name raises (Python hides it by default outside __main__;
    KVStoreConnector also logs DEPRECATION where vLLM logs, when its config names an old path)."""
    warnings.warn(DEPRECATION, DeprecationWarning, stacklevel=3)
