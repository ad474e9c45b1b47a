"""vLLM-format KV events from the daemon: what it holds, per tier, as vLLM's own KV events on a ZMQ socket.

Off by default; `kv_events = true` turns it on (pip install kvstore[events] for pyzmq and msgpack). A router
that indexes vLLM's events (llm-d's precise prefix-cache scorer, Dynamo's KV router) reads the store's blocks as
it reads a vLLM's: BlockStored when a block lands in a tier (medium "CPU" for RAM, "STORAGE" for disk),
BlockRemoved when it leaves one, AllBlocksCleared when a cleared namespace was the last on its topic, named by
vLLM's block hashes where the vLLM connector sent them with the put (Annotate), else by kvstore's key, flagged.

    config.py        KvEventsConfig: endpoints, topic template, buffers (the daemon's kv_events_* settings)
    vllm_events.py   vLLM's three events as plain values; the media and the ownership flag
    encoding.py      those events as vLLM 0.33's msgpack (and a decoder of both encodings vLLM has used)
    residency.py     the engine's events turned into vLLM's: which block is in which medium, per topic
    origin_book.py   vLLM identities sent ahead of their puts, until the publisher takes them
    publisher.py     the thread and its ZMQ sockets: publish, replay, drop and count, recover from lost events
    counters.py      the publisher's counters and their help (/metrics)

This package imports nothing at load time: publisher.py needs pyzmq and msgpack, only with kv_events on.
"""
