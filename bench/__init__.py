"""Benchmarks: each measures the physical limit and the product in the same run (warm-up, medians), prints a
table and, as its last line, one JSON object. A development tool: docs/benchmarks.md has the figures.

    micro.py             `python -m bench.micro`: arena puts and gets, single blocks, streaming, control plane
    micro_cases.py       bench.micro's workloads: keys, pre-faulted buffers, the limit's and the client's cases
    micro_phases.py      bench.micro's view inside a client call: wall time per phase, CPU per process
    control_plane.py     bench.micro's control-plane section: fast path and gRPC against a raw unix socket
    uds_limit.py         the control path's limit: a raw unix-socket request/response between two processes
    copy_limit.py        the copy limit: kvstore's native copy of the same bytes at 1 and 2 threads
    engine_ops.py        the engine's hot operations in-process: what one control-plane call costs the CPU
    fast_profile.py      `python -m bench.fast_profile`: one fast-path call followed stage by stage
    gc_pauses.py         `python -m bench.gc_pauses`: loads over 3 daemons, collector settled / defaults / off
    disk.py              `python -m bench.disk`: the disk tier against raw O_DIRECT on the same directory
    disk_phases.py       where the disk tier's time goes: one instrumented write and read pass
    connector.py         `python -m bench.connector`: the connector's worker side against the copy limit
    connector_rig.py     its rig: a vLLM-shaped paged KV cache, scheduler and worker sides, the timed cases
    connector_phases.py  where the connector benchmark's time goes: one instrumented save and load
    connector_hybrid.py  `--model gemma3-like`: a hybrid (sliding-window) layout, window trimming on and off
    hybrid_rig.py        its rig: vLLM's hybrid block tables, one namespace per KV cache group
    remote.py            `python -m bench.remote`: the peer tier against loopback sockets between processes
    remote_limit.py      its limit: one loopback connection between two processes, two ways to drive it
    restart.py           `python -m bench.restart`: a loaded daemon restarted cold, disk-warm and by hand-over: outage, first hit, RAM kept
    restart_vllm.py      bench.restart's vLLM part: the load's TTFT through vLLM across each restart
    mooncake/            its comparison: Mooncake Store's remote get (venv setup, CUDA stub, namespace rig)
    cluster/             `python -m bench.cluster`: N daemons on etcd against one node, through membership churn
    gpu_check.py         `python -m bench.gpu_check`: the connector's CUDA path on an NVIDIA GPU
    gpu_checks.py        its transfer checks (DMA through the pinned arena, per-tenant pins, save + load)
    gpu_overwrite.py     its overwrite-during-save check (a save reads blocks as they were when issued)
    gpu_hybrid.py        its hybrid-model check (two KV cache groups aliasing one LBNHC allocation)
    demo.py              `make demo`: a short tour against a daemon of its own
    targets.py           the targets a benchmark's figures are held to, stated and checked once
    _common.py           timing with warm-up and medians, throughput, tables, progress
    replay/              `python -m bench.replay`: trace replay against an exact offline simulation
    serve/               `python -m bench.serve`: agent sessions through real vLLM servers
    serve_hooks.py       `python -m bench.serve_hooks`: the connector's hooks timed in-process on prompts that miss
    scheduler_keys.py    `python -m bench.scheduler_keys`: an agent turn's keys from scratch, through the key memo
    soak/                `python -m bench.soak`: the chaos soak
"""
