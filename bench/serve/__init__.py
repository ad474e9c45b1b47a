"""`python -m bench.serve`: agent sessions through real vLLM OpenAI servers, with and without kvstore.

The end-to-end benchmark: what a user of a KV offload store buys is faster agent turns (TTFT) and more
sessions per node (throughput). Component ratios (arena vs memcpy, disk vs O_DIRECT) cannot show that; this
runs the same agent sessions, in the same order, over HTTP with streaming, against each configuration.

Modules, one concern each: model (the dummy-weight model directory), procs (child processes with logs, health
waits and a guaranteed stop), servers (the vLLM, kvstore and LMCache command lines), workload (agent sessions
from bench.replay.agentx, as token ids), http_client (one streamed completion: TTFT, tokens, cached tokens),
driver (sessions in flight, think times, forks), scrape (Prometheus text), configs (what each configuration
starts), report (table, plots, the JSON line), run (the composition root and the CLI).
"""
