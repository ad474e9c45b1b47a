"""vLLM's plugin entry: installing kvstore registers KVStoreConnector with vLLM's connector factory.

pyproject.toml declares ``[project.entry-points."vllm.general_plugins"] kvstore =
"kvstore_connector.plugin:register"``. vLLM calls every general plugin in each process it starts (the API server,
the engine core that builds the scheduler's connector, every worker) before it builds a connector, so::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}'

needs no kv_connector_module_path. `register` is cheap (vLLM's factory, no torch, no kvstore client: the
connector's module is imported when vLLM builds the connector) and may run more than once in a process.
It also keeps configs that name the old module path working (legacy.py). `VLLM_PLUGINS` (vLLM's own variable)
can leave it out like any plugin.
"""

from __future__ import annotations

import logging

from kvstore_connector import legacy
from kvstore_connector.deprecation import NEW_MODULE

__all__ = ["CONNECTOR_NAME", "register"]

CONNECTOR_NAME = "KVStoreConnector"

log = logging.getLogger(__name__)


def register() -> None:
    """Register KVStoreConnector (kvstore_connector.vllm_connector) with vLLM's KVConnectorFactory, once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, NEW_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered already: vLLM loads plugins again in a process that imported this one
        log.debug("%s is registered with vLLM already", CONNECTOR_NAME)
    legacy.install()
