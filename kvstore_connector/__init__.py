"""The vLLM KV connector: `--kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both", ...}'`
(installing kvstore registers it with vLLM: no module path). The repository's folder and the import name used to
be `connector`; that name is a deprecated alias now (deprecation.py).

    vllm_connector.py  KVStoreConnector (vLLM's KVConnectorBase_V1): a thin facade, one line per method
    plugin.py          vLLM's plugin entry point: registers KVStoreConnector with vLLM's connector factory
    deprecation.py     the old import name `connector` (module path connector.vllm_connector): names, warning
    legacy.py          the import hook that serves the old name where no package of that name exists
    config.py          the typed config, parsed once from `kv_connector_extra_config` (unknown keys are errors)
    scheduler.py       the scheduler side: metadata only (lookups, save jobs, stats)
    origins.py         the vLLM identity of a save's keys (vLLM's block hashes, tokens), for the daemon's KV events
    plan.py            what the scheduler side tells the worker side each step: small picklable values
    worker.py          the worker side: moves bytes between vLLM's paged KV cache and the arena
    saves.py           the worker side's saves: gather into spare slots (then Store) or reserved ones (then Commit)
    layout.py          where one vLLM block's bytes live: contiguous pieces per block, any layout
    copier.py          byte movers between the arena and the KV cache, chosen by where the cache lives
    cuda_copy.py       GPU <-> arena: the arena as pinned, device-mapped memory, one gather/scatter kernel
    pinning.py         which parts of an arena mapping are pinned for the GPU, kept true as slabs move
    keys.py            stable block keys: a chained xxh3-128 over token ids, the same in every process
    key_memo.py        keys of prefixes vLLM hashed already, by its block hash: a new turn hashes only new tokens
    namespace.py       namespaces: blocks are exchanged only between identical KV layouts
    background.py      a bounded queue drained by one idle-ending thread: store work off vLLM's threads
    groups.py          KV cache groups (hybrid models): what a hit needs from sliding-window groups, what they save
    hints.py           agent hints: read from a request, aimed at a session's keys, sent off vLLM's thread
    link.py            a fail-soft handle on the daemon for code running inside vLLM (one address rule, a warning
                       and a counter when it cannot be reached, retries)
    vllm_logs.py       the connector's and the client's log lines in vLLM's log, at vLLM's level
    stats.py           counters for vLLM's stats logging and for tests: hit tokens, bytes, failures
    prom.py            those counters on vLLM's Prometheus /metrics: stable names, labels from closed vocabularies
    misses.py          why a request missed: one cause per request, the daemon's asked off vLLM's thread
    probe.py           the scheduler's lookup of a prefix across every shard (stages, TP ranks, groups) at once
    load_policy.py     which hits load in the step that schedules them (load_mode, sync_fetch_bytes)
    claims.py          claims: a miss claims the keys it computes; a load of keys another server computes waits
    request_attrs.py   what the scheduler side reads from a vLLM Request besides its tokens (by attribute name)
    tails.py           partial last blocks: stored when a request finishes, offered to a request that continues them
    scheduler_tails.py the scheduler side's tails: the lookup after a prompt's hit, the save of a request's last one
    request_state.py   what the scheduler side keeps per request, and what it reads of a scheduled one
    counter_names.py   the counter vocabularies several modules name: miss causes, hint outcomes
"""
