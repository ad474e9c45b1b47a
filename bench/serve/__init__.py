"""`python -m bench.serve`: agent sessions through real vLLM OpenAI servers, with and without kvstore.

The end-to-end benchmark: what a user of a KV offload store buys is faster agent turns (TTFT) and more
sessions per node (throughput). Component ratios (arena vs memcpy, disk vs O_DIRECT) cannot show that; this
runs the same agent sessions, in the same order, over HTTP with streaming, against each configuration.

Modules, one concern each:

    __main__.py      `python -m bench.serve` (run.py's CLI)
    run.py           the composition root and the CLI: sizes, workload, servers, configurations in order, report
    configs.py       the configurations compared, and the servers each one needs
    rounds.py        repeated rounds: the order reversed each round, ratios paired within a round
    model.py         the dummy-weight model directory (nothing is downloaded)
    procs.py         child processes with logs, health waits that fail fast, and a guaranteed stop
    servers.py       the command lines of vLLM's OpenAI server, kvstore-server and LMCache's server
    lmcache.py       LMCache 0.5.6's multiprocess server in its own venv: the peer to beat
    peer.py          configuration (d): two vLLM servers, each with a kvstore-server, joined over real etcd
    router.py        configuration (r): the same two, each call sent to the node with the best prefix score
    workload.py      agent sessions from bench.replay.agentx, as token ids
    http_client.py   one streamed completion: TTFT, generated tokens, cached prompt tokens
    driver.py        sessions in flight: think times, turns one after another, forks
    measure.py       one configuration measured: prefix cache reset, counters around both passes
    scrape.py        counters from Prometheus text, differenced around a run
    costs.py         the connector's cost where nothing hits, measured directly: hook time, daemon CPU
    report.py        the table, the plots, the greedy-output check and the JSON line
"""
