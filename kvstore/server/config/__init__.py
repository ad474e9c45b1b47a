"""The daemon's one typed config, read from embedded defaults < a TOML file < KVSTORE_* env < flags.

One concern per module:

    units.py     sizes ('512MiB') and per-tenant quota lists, as written in the config
    settings.py  ServerConfig: the flat keys (each with its section and help), derived values, and the
                 component configs it builds (EngineConfig, DiskConfig, PeerConfig)
    rules.py     the daemon's own rules (listeners, RPC limits, logs) and those that tie two parts together
    security.py  TLS, tokens, tenant quotas, etcd security, metrics labels
    checks.py    validate(cfg): every rule above once, in order (imports point down: checks -> rules,
                 security -> settings)
    loader.py    TOML / environment / flags -> a validated ServerConfig; the --help parser

Every rule is checked in one place: the component's config (EngineConfig, DiskConfig, PeerConfig), the
factory that builds from a name (policy, admission), or rules.py / security.py for what spans parts. A bad
value stops the daemon with a message that names the setting, the value and what would be accepted.
docs/configuration.md is generated from the fields' help: `python -m kvstore.server.config_doc`.
"""

from kvstore.server.config.checks import validate
from kvstore.server.config.loader import build_arg_parser, load_config
from kvstore.server.config.settings import SECTIONS, ServerConfig
from kvstore.server.config.units import parse_quotas, parse_size

__all__ = ["ServerConfig", "SECTIONS", "load_config", "validate", "parse_size", "parse_quotas", "build_arg_parser"]
