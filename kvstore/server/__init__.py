"""The daemon, `kvstore-server`: its front ends and the parts around the engine.

    main.py            the composition root: builds every part from one ServerConfig, runs, shuts down in order
    parts.py           the parts it builds that need more than a constructor: disk tier, peer tier, budget, events
    config/            the one typed config: embedded defaults < TOML file < KVSTORE_* env < flags; it builds
                       the engine's, disk tier's and peer tier's configs and checks every rule once
    config_doc.py      writes docs/configuration.md from the config's fields (a test keeps the page current)
    service.py         the gRPC servicer: protobuf requests -> engine calls, engine errors -> gRPC statuses
    fast_server.py     the same-node socket: hands out arena files, answers the fast path's hot operations
    fast_acceptor.py   its listener: accepts, and stops accepting without closing (a hand-over's freeze)
    ops.py             the hot operations' semantics, once, for both front ends: tenant checks, engine call,
                       arena transfer windows
    arena_windows.py   arena transfers as the daemon sees them (Reserve -> Commit, lease -> Release), timed
    session_ops.py     the session book's RPCs: checks, tenancy, each session's chain explained
    routing_ops.py     what a router asks: Annotate (vLLM identities for the events), PrefixScore (per node)
    routing_wire.py    their protobuf messages <-> kvstore's values
    kv_events/         vLLM-format KV events over ZMQ (kv_events): what this node holds, per tier, as vLLM's
    info.py            facts clients need about this daemon: identity, host, arena layout
    auth.py            bearer-token interceptor in front of every RPC when `tokens_file` is set
    tenancy.py         a namespace belongs to the tenant that registered it; per-RPC ownership checks
    token_reload.py    the tokens file re-read on change and on SIGHUP
    tenant_usage.py    per-tenant usage next to the quotas, for Stats and the metrics
    metrics.py         Prometheus metrics and /healthz on a small HTTP port
    metric_collectors.py  the small collectors read at scrape time: transfers, peer tier, fast path, gauges
    metric_labels.py   namespace / tenant names as label values: names, keyed hashes, or none
    logs.py            structured logs: key=value text or one JSON object a line
    heap.py            the collector once serving: startup objects frozen, young threshold raised
    handover/          restarts that keep the RAM tier: the hand-over protocol, both sides, systemd's fd store
    handover_host.py   the running daemon's part in a hand-over: offer, prepare, freeze, resume, commit, decline
    gate.py            gRPC's front door during a hand-over: calls in flight finish, new ones retry at the successor
    restart_log.py     the log line of a restart that kept the RAM tier: adopted, dropped and why
    background.py      the background threads: the sweeper and the RAM journal's writer
    listeners.py       state directories and sockets checked before anything exists; exposure warnings
"""
