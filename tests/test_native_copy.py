"""Exact-content tests for the native batched copy (kvstore._native.copy_batch / copy_addrs)."""

from __future__ import annotations

import array
import platform

import numpy as np
import pytest

from kvstore import _native
from kvstore._native import _copy, copy_addrs, copy_batch

U64_MAX = 2**64 - 1
MiB = 1 << 20


@pytest.fixture(autouse=True)
def small_thread_shares() -> object:
    """Threads start at 512 KiB per thread here (12 MiB in production) and take 128 KiB chunks (1 MiB), so these
    small copies really run on several threads and exercise the split of the byte stream into chunks."""
    old = _copy._set_min_share(512 * 1024)
    yield
    _copy._set_min_share(old)


def _rand_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def _random_triples(
    rng: np.random.Generator, count: int, src_size: int, max_len: int = 256 * 1024
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Disjoint dst ranges (laid out in shuffled order with random gaps), arbitrary src ranges."""
    lengths = rng.integers(1, max_len + 1, size=count, dtype=np.uint64)
    lengths = np.minimum(lengths, np.uint64(src_size))
    order = rng.permutation(count)
    dst_offsets = np.zeros(count, dtype=np.uint64)
    pos = 0
    for i in order:
        pos += int(rng.integers(0, 64))
        dst_offsets[i] = pos
        pos += int(lengths[i])
    dst_size = pos + int(rng.integers(0, 64))
    src_offsets = np.array(
        [rng.integers(0, src_size - int(n) + 1) for n in lengths], dtype=np.uint64
    )
    return dst_offsets, src_offsets, lengths, dst_size


def _reference(dst: np.ndarray, src: np.ndarray, doff, soff, lens) -> np.ndarray:
    out = dst.copy()
    for d, s, n in zip(doff.tolist(), soff.tolist(), lens.tolist()):
        out[d : d + n] = src[s : s + n]
    return out


@pytest.mark.parametrize("stream", [-1, 0, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_triples_match_reference_for_all_thread_counts(seed: int, stream: int) -> None:
    rng = np.random.default_rng(seed)
    src = _rand_bytes(rng, 8 * MiB)
    doff, soff, lens, dst_size = _random_triples(rng, 300, src.size)
    initial = _rand_bytes(rng, dst_size)
    expected = _reference(initial, src, doff, soff, lens)
    total = int(lens.sum())
    assert total > 4 * MiB  # big enough that threads=2 and threads=4 really spawn threads
    for threads in (1, 2, 4):
        dst = initial.copy()
        assert copy_batch(dst, src, doff, soff, lens, threads=threads, stream=stream) == total
        assert np.array_equal(dst, expected), f"threads={threads} stream={stream}"


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_copies_are_exact_at_every_alignment_and_tail(threads: int) -> None:
    """Non-temporal stores write the 32-byte aligned middle of each piece; the unaligned head and the tail under
    128 bytes go through memcpy. Every (dst misalignment, length) pair below crosses those edges, in pieces of at
    least the 4 KiB the streamed path needs, and the bytes around each piece stay untouched."""
    rng = np.random.default_rng(5)
    src = _rand_bytes(rng, 2 * MiB)
    cases = [(mis, n) for mis in (0, 1, 15, 16, 31, 33, 63) for n in (4096, 4097, 4096 + 127, 8191, 65536 + 5)]
    doff, soff, lens, pos = [], [], [], 64
    for mis, n in cases:
        pos += (-pos) % 64 + mis
        doff.append(pos), soff.append(int(rng.integers(0, src.size - n))), lens.append(n)
        pos += n + 64
    initial = _rand_bytes(rng, pos + 64)
    d, so, ln = (np.array(x, dtype=np.uint64) for x in (doff, soff, lens))
    expected = _reference(initial, src, d, so, ln)
    dst = initial.copy()
    assert copy_batch(dst, src, d, so, ln, threads=threads, stream=1) == int(ln.sum())
    assert np.array_equal(dst, expected)


def test_overlapping_ranges_are_never_streamed() -> None:
    """Streaming stores are memcpy semantics; a piece whose src and dst overlap keeps memmove's result."""
    buf = np.arange(64 * 1024, dtype=np.uint8)
    expected = buf.copy()
    expected[100: 100 + 32768] = buf[0: 32768]
    assert copy_batch(buf, buf, [100], [0], [32768], stream=1) == 32768
    assert np.array_equal(buf, expected)


def test_bytearray_dst_and_bytes_src() -> None:
    rng = np.random.default_rng(7)
    src_np = _rand_bytes(rng, 1 * MiB)
    doff, soff, lens, dst_size = _random_triples(rng, 200, src_np.size, max_len=4096)
    dst = bytearray(dst_size)
    expected = _reference(np.zeros(dst_size, np.uint8), src_np, doff, soff, lens)
    assert copy_batch(dst, src_np.tobytes(), doff, soff, lens) == int(lens.sum())
    assert bytes(dst) == expected.tobytes()


def test_many_tiny_triples_split_across_threads() -> None:
    # 40k x 64 B = 2.5 MiB: shares start mid-stream, exercising the byte-range split over many triples,
    # including zero-length triples that must be skipped.
    rng = np.random.default_rng(3)
    n = 40_000
    src = _rand_bytes(rng, n * 64)
    lens = np.full(n, 64, dtype=np.uint64)
    lens[::97] = 0
    lens[5::101] = 37
    soff = np.arange(n, dtype=np.uint64) * 64
    doff = rng.permutation(n).astype(np.uint64) * 64
    expected = _reference(np.zeros(n * 64, np.uint8), src, doff, soff, lens)
    for threads in (1, 2, 3, 4, 64):
        dst = np.zeros(n * 64, np.uint8)
        assert copy_batch(dst, src, doff, soff, lens, threads=threads) == int(lens.sum())
        assert np.array_equal(dst, expected), f"threads={threads}"


def test_chunks_that_start_on_empty_ranges_and_cut_ranges_are_exact() -> None:
    # threads take the stream in chunks of a quarter of min_share (128 KiB here): empty ranges sit exactly on
    # chunk starts (the chunk belongs to the next non-empty range), and ranges of 3 chunks + 1 byte are cut
    # mid-range by every chunk
    chunk = 128 * 1024
    lens = np.array([chunk, 0, 0, chunk - 1, 1, 0, 3 * chunk + 1, 0, chunk - 1, 0, 5 * chunk, 0], dtype=np.uint64)
    total = int(lens.sum())
    rng = np.random.default_rng(21)
    src = _rand_bytes(rng, total)
    soff = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
    doff = np.concatenate([[0], np.cumsum(lens[::-1])[:-1]]).astype(np.uint64)[::-1].copy()  # reversed layout
    expected = _reference(np.zeros(total, np.uint8), src, doff, soff, lens)
    for threads in (2, 3, 8):
        dst = np.zeros(total, np.uint8)
        assert copy_batch(dst, src, doff, soff, lens, threads=threads) == total
        assert np.array_equal(dst, expected), f"threads={threads}"


def test_single_64mib_copy_two_threads() -> None:
    src = np.random.default_rng(11).integers(0, 2**63, size=8 * MiB, dtype=np.uint64).view(np.uint8)
    dst = np.zeros(64 * MiB, np.uint8)
    assert copy_batch(dst, src, [0], [0], [64 * MiB], threads=2) == 64 * MiB
    assert np.array_equal(dst, src)


def test_odd_sized_copy_many_threads() -> None:
    rng = np.random.default_rng(12)
    size = 5 * MiB + 12345
    src = _rand_bytes(rng, size + 100)
    dst = np.zeros(size + 10, np.uint8)
    assert copy_batch(dst, src, [7], [93], [size], threads=7) == size
    assert np.array_equal(dst[7 : 7 + size], src[93 : 93 + size])
    assert not dst[:7].any() and not dst[7 + size :].any()


def test_same_buffer_non_overlapping_ranges() -> None:
    rng = np.random.default_rng(5)
    buf = _rand_bytes(rng, 4 * MiB)
    before = buf.copy()
    half = 2 * MiB
    # move the first half into the second half in 4 swapped chunks, big enough to use threads
    q = half // 4
    doff = [half + 3 * q, half + 2 * q, half + q, half]
    soff = [0, q, 2 * q, 3 * q]
    assert copy_batch(buf, buf, doff, soff, [q] * 4, threads=2) == half
    assert np.array_equal(buf[:half], before[:half])
    for d, s in zip(doff, soff):
        assert np.array_equal(buf[d : d + q], before[s : s + q])


def test_non_byte_dtype_buffers_use_byte_offsets() -> None:
    src = np.arange(1024, dtype=np.float32)
    dst = np.zeros(1024, dtype=np.float32)
    assert copy_batch(dst, src, [0, 400], [400, 0], [16, 8]) == 24
    assert dst[:4].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert dst[100:102].tolist() == [0.0, 1.0]
    assert np.count_nonzero(dst) == 5  # 100..103 and 1.0


def test_zero_triples_returns_zero() -> None:
    dst = bytearray(b"abc")
    assert copy_batch(dst, b"xyz", [], [], []) == 0
    assert copy_batch(dst, b"xyz", np.empty(0, np.uint64), (), []) == 0
    assert copy_addrs([], [], []) == 0
    assert dst == b"abc"


def test_zero_length_triples_at_end_of_buffer() -> None:
    dst = bytearray(b"abc")
    assert copy_batch(dst, b"xyz", [3, 0], [3, 1], [0, 2]) == 2
    assert dst == b"yzc"


def test_accepts_lists_tuples_and_other_integer_arrays() -> None:
    dst = bytearray(8)
    assert copy_batch(dst, b"01234567", (4, 0), np.array([0, 4], np.int32), [4, 4]) == 8
    assert dst == b"45670123"
    # the raw C function takes any 1-D uint64 buffer, e.g. array('Q')
    dst2 = bytearray(8)
    q = array.array("Q", [2])
    assert _copy.copy_batch(dst2, b"abcdefgh", q, array.array("Q", [0]), array.array("Q", [3])) == 3
    assert dst2 == b"\0\0abc\0\0\0"


@pytest.mark.parametrize("threads", [-5, 0, 1, 65, 10_000])
def test_threads_is_clamped(threads: int) -> None:
    src = _rand_bytes(np.random.default_rng(1), 3 * MiB)
    dst = np.zeros_like(src)
    assert copy_batch(dst, src, [0], [0], [src.size], threads=threads) == src.size
    assert np.array_equal(dst, src)


# ----------------------------------------------------------------------------------------------
# Validation: every error is raised before anything is copied.


def _fresh() -> tuple[bytearray, bytes]:
    return bytearray(b"\xaa" * 4096), bytes(range(256)) * 16


def _assert_rejected(exc: type[BaseException], match: str, dst: bytearray, *args, **kw) -> None:
    before = bytes(dst)
    with pytest.raises(exc, match=match):
        copy_batch(dst, *args, **kw)
    assert bytes(dst) == before


def test_mismatched_lengths() -> None:
    dst, src = _fresh()
    _assert_rejected(ValueError, r"equal length, got 2, 3 and 2", dst, src, [0, 8], [0, 8, 16], [8, 8])
    _assert_rejected(ValueError, r"got 2, 2 and 1", dst, src, [0, 8], [0, 8], [8])
    with pytest.raises(ValueError, match=r"got 1, 2 and 1"):
        copy_addrs([1], [1, 2], [0])


def test_dst_out_of_bounds_names_index_and_numbers() -> None:
    dst, src = _fresh()
    doff = list(range(0, 100 * 8, 8)) + [4090]
    lens = [8] * 100 + [7]
    soff = [0] * 101
    # the bad triple is last: the 100 good ones before it must not have been copied
    _assert_rejected(
        ValueError, r"triple 100 out of bounds: dst_offset 4090 \+ length 7 = 4097 > dst size 4096",
        dst, src, doff, soff, lens, threads=4,
    )


def test_src_out_of_bounds_names_index_and_numbers() -> None:
    dst, src = _fresh()
    _assert_rejected(
        ValueError, r"triple 2 out of bounds: src_offset 4000 \+ length 97 = 4097 > src size 4096",
        dst, src, [0, 8, 16], [0, 0, 4000], [8, 8, 97],
    )


def test_huge_length_is_out_of_bounds() -> None:
    dst, src = _fresh()
    _assert_rejected(ValueError, r"triple 0 out of bounds: dst_offset 0 \+ length 18446744073709551615",
                     dst, src, [0], [0], [U64_MAX])


@pytest.mark.parametrize(
    "doff, soff, n",
    [(U64_MAX, 0, 1), (0, U64_MAX - 3, 8), (2**63, 2**63, 2**63), (U64_MAX - 10, 0, 11)],
)
def test_offset_plus_length_overflow(doff: int, soff: int, n: int) -> None:
    dst, src = _fresh()
    _assert_rejected(ValueError, rf"triple 1: offset \+ length overflows uint64 \(dst_offset {doff}, "
                     rf"src_offset {soff}, length {n}\)", dst, src, [0, doff], [0, soff], [16, n])


def _readonly_array() -> np.ndarray:
    a = np.zeros(64, np.uint8)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    "make_dst",
    [
        lambda: b"\0" * 64,
        lambda: memoryview(bytearray(64)).toreadonly(),
        _readonly_array,
    ],
    ids=["bytes", "readonly-memoryview", "readonly-ndarray"],
)
def test_read_only_dst(make_dst) -> None:
    dst = make_dst()
    before = bytes(dst)
    with pytest.raises(TypeError, match=r"dst must be a writable buffer"):
        copy_batch(dst, b"x" * 64, [0], [0], [8])
    assert bytes(dst) == before


def test_non_buffer_and_non_contiguous_buffers_rejected() -> None:
    with pytest.raises(TypeError):
        copy_batch("not a buffer", b"x" * 8, [0], [0], [1])
    with pytest.raises(TypeError):
        copy_batch(bytearray(8), 12345, [0], [0], [1])
    dst = np.zeros(64, np.uint8)
    with pytest.raises((ValueError, BufferError)):
        copy_batch(dst[::2], b"x" * 64, [0], [0], [1])
    assert not dst.any()


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float64, np.int8])
def test_wrong_index_dtype_rejected_by_c(dtype) -> None:
    dst, src = _fresh()
    good = np.zeros(1, np.uint64)
    bad = np.zeros(1, dtype)
    for args, name in [((bad, good, good), "dst_offsets"), ((good, bad, good), "src_offsets"),
                       ((good, good, bad), "lengths")]:
        with pytest.raises(TypeError, match=rf"{name} must be a 1-D array of uint64"):
            _copy.copy_batch(dst, src, *args)
        with pytest.raises(TypeError, match=r"must be a 1-D array of uint64"):
            _copy.copy_addrs(*args)
    assert dst == bytearray(b"\xaa" * 4096)


def test_index_array_shape_and_contiguity_rejected_by_c() -> None:
    dst, src = _fresh()
    two_d = np.zeros((2, 2), np.uint64)
    with pytest.raises(TypeError, match=r"ndim 2"):
        _copy.copy_batch(dst, src, two_d, two_d, two_d)
    strided = np.zeros(8, np.uint64)[::2]
    with pytest.raises(TypeError, match=r"C-contiguous uint64"):
        _copy.copy_batch(dst, src, strided, strided, strided)
    with pytest.raises(TypeError):
        _copy.copy_batch(dst, src, [0], [0], [1])  # lists are the wrapper's job
    assert dst == bytearray(b"\xaa" * 4096)


def test_wrapper_rejects_negative_python_ints() -> None:
    dst, src = _fresh()
    with pytest.raises((OverflowError, ValueError)):
        copy_batch(dst, src, [-1], [0], [1])
    assert dst == bytearray(b"\xaa" * 4096)


# ----------------------------------------------------------------------------------------------
# copy_addrs


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_addrs_gathers_layers_into_arena(threads: int, stream: int) -> None:
    rng = np.random.default_rng(21)
    layers = [_rand_bytes(rng, 64 * 1024) for _ in range(32)]  # 32 per-layer tensors, 2 MiB total
    arena = np.zeros(4 * MiB, np.uint8)
    slot = MiB  # gather into arena[slot : slot + 2 MiB], layer i at slot + i*64KiB
    dst_addrs = [arena.ctypes.data + slot + i * 65536 for i in range(32)]
    src_addrs = np.array([a.ctypes.data for a in layers], dtype=np.uint64)
    lens = [65536] * 32
    assert copy_addrs(dst_addrs, src_addrs, lens, threads=threads, stream=stream) == 2 * MiB
    assert np.array_equal(arena[slot : slot + 2 * MiB], np.concatenate(layers))
    assert not arena[:slot].any() and not arena[slot + 2 * MiB :].any()
    # and scatter back out of the arena
    outs = [np.zeros(65536, np.uint8) for _ in range(32)]
    n = copy_addrs([o.ctypes.data for o in outs], dst_addrs, lens, threads=threads, stream=stream)
    assert n == 2 * MiB
    for o, a in zip(outs, layers):
        assert np.array_equal(o, a)


def test_copy_addrs_null_and_wraparound_rejected() -> None:
    a = np.arange(16, dtype=np.uint8)
    b = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match=r"triple 1: null address \(dst_addr 0x0"):
        copy_addrs([b.ctypes.data, 0], [a.ctypes.data, a.ctypes.data], [4, 4])
    with pytest.raises(ValueError, match=r"triple 0: null address"):
        copy_addrs([b.ctypes.data], [0], [4])
    with pytest.raises(ValueError, match=r"triple 1: address \+ length wraps around"):
        copy_addrs([b.ctypes.data, U64_MAX - 3], [a.ctypes.data, a.ctypes.data], [4, 8])
    assert not b.any()  # the valid first triple was not copied either
    # null is allowed for zero-length pieces (e.g. empty tensors report data_ptr() == 0)
    assert copy_addrs([0, b.ctypes.data], [0, a.ctypes.data], [0, 16]) == 16
    assert np.array_equal(b, a)


def test_public_api() -> None:
    assert set(_native.__all__) >= {"copy_batch", "copy_addrs"}
    assert "GIL" in (_copy.copy_batch.__doc__ or "")
    assert "UNCHECKED" in (_copy.copy_addrs.__doc__ or "")
    assert "GIL" in (_copy.__doc__ or "")


# ----------------------------------------------------------------------------------------- copy_buffers


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_buffers_moves_each_object_to_and_from_its_address(threads: int) -> None:
    rng = np.random.default_rng(7)
    arena = np.zeros(4 * MiB, np.uint8)
    base = arena.ctypes.data
    values: list[object] = [_rand_bytes(rng, 700 * 1024), _rand_bytes(rng, 4096).tobytes(),
                            bytearray(_rand_bytes(rng, 100)), memoryview(_rand_bytes(rng, 3 * 512)),
                            _rand_bytes(rng, 64 * 1024).view(np.uint16).reshape(256, 128)]  # 2-D, 2-byte items
    sizes = [memoryview(v).nbytes for v in values]  # type: ignore[arg-type]
    offsets = [0, MiB, MiB + 8192, 2 * MiB, 3 * MiB]
    assert _native.copy_buffers([base + o for o in offsets], sizes, values, threads=threads) == sum(sizes)
    for v, o, n in zip(values, offsets, sizes):
        assert arena[o:o + n].tobytes() == bytes(memoryview(v).cast("B"))  # type: ignore[arg-type]
    assert arena[700 * 1024:MiB].sum() == 0  # nothing past a block
    outs = [np.full(n + 10, 0xEE, np.uint8) for n in sizes]  # larger than the blocks: the rest untouched
    assert _native.copy_buffers([base + o for o in offsets], sizes, outs, into_buffers=True, threads=threads) == sum(sizes)
    for v, out, n in zip(values, outs, sizes):
        assert out[:n].tobytes() == bytes(memoryview(v).cast("B")) and out[n:].tolist() == [0xEE] * 10  # type: ignore[arg-type]


def test_copy_buffers_checks_every_buffer_before_any_byte_moves() -> None:
    arena = np.zeros(MiB, np.uint8)
    base = arena.ctypes.data
    good = [np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)]
    addrs, sizes = [base, base + 4096, base + 8192], [4096] * 3
    cases: list[tuple[object, bool, str]] = [
        (b"r" * 4096, True, "buffer 2 (bytes) is read-only: pass a bytearray"),
        (np.zeros((64, 128), np.uint8)[:, :64], False, "buffer 2 (numpy.ndarray) is not a C-contiguous buffer"),
        (123, False, "buffer 2 (int) is not a C-contiguous buffer"),
        (np.zeros(4095, np.uint8), True, "buffer 2 holds 4095 bytes but the block has 4096"),
        (np.zeros(4097, np.uint8), False, "buffer 2 holds 4097 bytes, not the 4096 of its block"),
    ]
    for bad, into, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _native.copy_buffers(addrs, sizes, [*good, bad], into_buffers=into)
        assert not arena.any() and good[0][0] == 1  # neither direction moved a byte
    with pytest.raises(ValueError, match="3 addrs, 2 lengths and 3 buffers"):
        _native.copy_buffers(addrs, sizes[:2], [*good, good[0]])
    with pytest.raises(TypeError, match="buffers must be a list"):
        _native.copy_buffers(addrs, sizes, tuple(good))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block 0: null address"):
        _native.copy_buffers([0], [4096], good[:1])
    assert _native.copy_buffers(addrs[:2], sizes[:2], good, check_only=True) == 8192
    assert not arena.any()


# ----------------------------------------------------------------------------------------- first_outside


def test_first_outside_finds_the_first_range_not_in_one_slab() -> None:
    # region [100, 500), slabs of 100 bytes from 100: [100, 200), [200, 300), ...
    offs = np.array([100, 150, 299, 250, 400], np.uint64)
    sizes = np.array([100, 50, 1, 100, 100], np.uint64)
    assert _native.first_outside(offs, sizes, 100, 500, 100) == 3  # 250 + 100 crosses into the next slab
    assert _native.first_outside(offs[[0, 1, 2, 4]], sizes[[0, 1, 2, 4]], 100, 500, 100) == -1
    assert _native.first_outside([99], [1], 100, 500, 100) == 0      # before the region
    assert _native.first_outside([400], [101], 100, 500, 100) == 0   # past its end
    assert _native.first_outside([500], [0], 100, 500, 100) == -1    # an empty range at the end is inside
    assert _native.first_outside([U64_MAX], [2], 100, 500, 100) == 0  # would wrap around 64 bits
    assert _native.first_outside([], [], 100, 500, 100) == -1


def test_first_outside_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="3 offsets but 2 sizes"):
        _native.first_outside([1, 2, 3], [1, 2], 0, 10, 1)
    with pytest.raises(ValueError, match="need slab > 0 and lo <= hi"):
        _native.first_outside([1], [1], 0, 10, 0)
    with pytest.raises(ValueError, match="need slab > 0 and lo <= hi"):
        _native.first_outside([1], [1], 11, 10, 1)
    with pytest.raises(TypeError, match="must be a 1-D array of uint64"):
        _copy.first_outside(np.array([1], np.int64), np.array([1], np.uint64), 0, 10, 1)
    with pytest.raises(OverflowError):
        _native.first_outside([-1], [1], 0, 10, 1)


def test_evict_lines_leaves_the_bytes_and_counts_them() -> None:
    a = np.arange(3 * 4096 + 7, dtype=np.uint8)
    before = a.copy()
    got = _native.evict_lines([a.ctypes.data + 3], [a.nbytes - 3])  # unaligned start: its whole line goes
    assert got == (a.nbytes - 3 if platform.machine() == "x86_64" else 0)  # elsewhere nothing is done
    assert np.array_equal(a, before)
    with pytest.raises(ValueError, match="2 addresses but 1 lengths"):
        _native.evict_lines([1, 2], [1])
    with pytest.raises(ValueError, match="range 0: null address"):
        _native.evict_lines([0], [64])
