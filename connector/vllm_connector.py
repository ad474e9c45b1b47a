"""Deprecated module path of KVStoreConnector: the class of kvstore_connector.vllm_connector itself (one class, not
a copy), for configs that still name ``"kv_connector_module_path": "connector.vllm_connector"``."""

from kvstore_connector.vllm_connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
