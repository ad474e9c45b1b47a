"""Deprecated: the vLLM connector's old import name, kept so that configs naming it still work in a checkout.

The connector is `kvstore_connector` (installed under that name; vLLM finds it through the plugin entry point
with no module path). This folder is not shipped in the wheel (there kvstore_connector/legacy.py answers the old
name); importing it warns (kvstore_connector/deprecation.py says why and what to write instead).

    vllm_connector.py  KVStoreConnector, the class of kvstore_connector.vllm_connector itself
"""

from kvstore_connector import deprecation

deprecation.warn()
