"""Remote data path: blocks travel inside the streaming Put/Get RPCs, for clients that cannot map the arena.

Each block crosses the wire with an xxh3_64 checksum: the daemon verifies puts, the client verifies gets
(a mismatch raises IntegrityError rather than returning bytes that might be wrong).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.rpc import Rpc
from kvstore.errors import IntegrityError, InvalidRequestError
from kvstore.hostinfo import byte_view

__all__ = ["put", "get", "get_into", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20


def _chunks(namespace: str, keys: Sequence[bytes], values: Sequence[object]) -> Iterator[pb.PutChunk]:
    for key, value in zip(keys, values):
        view = memoryview(value).cast("B")  # type: ignore[arg-type]  # any buffer; 3.11 has no Buffer type
        yield pb.PutChunk(header=pb.BlockHeader(namespace=namespace, key=key, size=view.nbytes,
                                                checksum=xxhash.xxh3_64_intdigest(view)))
        for start in range(0, view.nbytes, CHUNK_BYTES):
            yield pb.PutChunk(data=view[start: start + CHUNK_BYTES].tobytes())


def put(rpc: Rpc, namespace: str, keys: Sequence[bytes], values: Sequence[object]) -> tuple[int, int]:
    """(stored, already_present)."""
    r = rpc.stream("Put", _chunks(namespace, keys, values), lambda resp: resp)
    return r.stored, r.already_present


def _blocks(rpc: Rpc, namespace: str, keys: Sequence[bytes]) -> Iterator[tuple[pb.BlockHeader, bool, list[bytes]]]:
    def consume(stream: Iterator[pb.GetChunk]) -> list[tuple[pb.BlockHeader, bool, list[bytes]]]:
        out: list[tuple[pb.BlockHeader, bool, list[bytes]]] = []
        for chunk in stream:
            if chunk.WhichOneof("part") == "header":
                out.append((chunk.header, chunk.found, []))
            else:
                out[-1][2].append(chunk.data)
        return out

    for header, found, parts in rpc.stream("Get", pb.KeysRequest(namespace=namespace, keys=keys), consume):
        if found:
            data = b"".join(parts)
            if len(data) != header.size or (header.checksum and xxhash.xxh3_64_intdigest(data) != header.checksum):
                raise IntegrityError(f"block {header.key.hex()} arrived damaged (size or checksum mismatch)")
        yield header, found, parts


def get(rpc: Rpc, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
    return [b"".join(parts) if found else None for _, found, parts in _blocks(rpc, namespace, keys)]


def get_into(rpc: Rpc, namespace: str, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
    out: list[int | None] = []
    for (header, found, parts), buf in zip(_blocks(rpc, namespace, keys), buffers):
        if not found:
            out.append(None)
            continue
        dst = byte_view(buf)
        if dst.nbytes < header.size:
            raise InvalidRequestError(f"buffer holds {dst.nbytes} bytes but block {header.key.hex()} has {header.size}")
        pos = 0
        for part in parts:
            dst[pos: pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
            pos += len(part)
        out.append(header.size)
    return out
