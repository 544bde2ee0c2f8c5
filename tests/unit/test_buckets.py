"""The weight-sync wire format: pack/unpack round trips, bucket limits, lazy consumption; the
broadcast's JSON header round trip, and every way a header can be wrong refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from colocate_rl.weight_sync.broadcast import decode_header, encode_header
from colocate_rl.weight_sync.buckets import pack, unpack
from colocate_rl.weight_sync.json_wire import WireError
from colocate_rl.weight_sync.verify import tensor_checksum

MB = 2**20


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(4, 8, generator=g)),
        ("scalar", torch.randn((), generator=g)),
        ("half", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("big", torch.randn(300, 300, generator=g)),  # 360 KB: larger than the 0.25 MB bucket below
        ("b", torch.randn(7, generator=g)),
        ("ints", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("empty", torch.zeros(0, 4)),
        ("half2", torch.randn(2, 2, 2, generator=g).to(torch.bfloat16)),
    ]


def test_round_trip_mixed_dtypes_and_shapes():
    src = _named()
    buckets = list(pack(iter(src), bucket_mb=0.25))
    got = {}
    for b in buckets:
        assert b.flat.dim() == 1 and b.flat.is_contiguous()
        assert {m.dtype for m in b.metas} == {b.flat.dtype}, "a bucket holds one dtype"
        for name, view in unpack(b):
            assert name not in got
            got[name] = view
    assert set(got) == {n for n, _ in src}
    for name, t in src:
        assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name
    assert got["scalar"].dim() == 0


def test_bucket_limit_and_oversized_tensor():
    src = _named()
    limit = 0.25 * MB
    buckets = list(pack(iter(src), bucket_mb=0.25))
    big = [b for b in buckets if any(m.name == "big" for m in b.metas)]
    assert len(big) == 1 and [m.name for m in big[0].metas] == ["big"], "an oversized tensor gets a bucket of its own"
    for b in buckets:
        if b is not big[0]:
            assert b.nbytes <= limit
    # Offsets tile the flat buffer exactly.
    for b in buckets:
        ends = [m.offset + m.numel for m in b.metas]
        assert [m.offset for m in b.metas] == [0] + ends[:-1] and ends[-1] == b.flat.numel()


def test_many_small_tensors_fill_several_buckets():
    src = [(f"t{i}", torch.full((256,), float(i))) for i in range(64)]  # 1 KiB each, 64 KiB total
    buckets = list(pack(iter(src), bucket_mb=16 / 1024))  # 16 KiB buckets
    assert len(buckets) == 4 and all(len(b.metas) == 16 for b in buckets)
    assert [n for b in buckets for n, _ in unpack(b)] == [n for n, _ in src], "one dtype keeps input order"


def test_empty_iterator_yields_nothing():
    assert list(pack(iter([]), bucket_mb=1)) == []


def test_consumes_lazily():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield f"t{i}", torch.zeros(64 * 1024 // 4)  # 64 KiB each

    it = pack(gen(), bucket_mb=128 / 1024)  # two tensors per bucket
    first = next(it)
    assert [m.name for m in first.metas] == ["t0", "t1"]
    assert len(pulled) <= 3, f"pack pulled {len(pulled)} tensors to build the first bucket"


def test_views_share_bucket_memory_and_alloc_hook():
    calls = []

    def alloc(numel, dtype, device):
        calls.append((numel, dtype))
        return torch.empty(numel, dtype=dtype, device=device)

    (b,) = list(pack(iter([("x", torch.ones(3)), ("y", torch.ones(2))]), bucket_mb=1, alloc=alloc))
    assert calls == [(5, torch.float32)]
    (_, x), (_, y) = unpack(b)
    b.flat.fill_(7)
    assert x.eq(7).all() and y.eq(7).all()


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_mb"):
        list(pack(iter([("x", torch.ones(1))]), bucket_mb=0))


def test_checksum_sees_permutations():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    assert tensor_checksum(t) != tensor_checksum(t.flip(0)), "swapped rows keep the plain sum"
    assert tensor_checksum(t.to(torch.bfloat16)) == tensor_checksum(t)  # small ints are exact in bf16


def test_vocab_shard_checksums_add_up_to_the_whole_tensor():
    from colocate_rl.weight_sync.verify import combine_worker_checksums

    t = torch.randn(10, 3, dtype=torch.float64)
    shards = [t[:6], t[6:]]  # a vocabulary split over two tensor-parallel workers
    per_worker = [{"embed.weight": (tensor_checksum(s, offset=start * 3), True), "norm.weight": (7.0, False)}
                  for s, start in zip(shards, (0, 6))]
    combined = combine_worker_checksums(per_worker)
    assert combined["embed.weight"] == pytest.approx(tensor_checksum(t), rel=1e-12)
    assert combined["norm.weight"] == 7.0  # replicated: taken once, not summed
    swapped = [per_worker[1], per_worker[0]]
    assert combine_worker_checksums([{"e": (tensor_checksum(s), True)} for s in shards])["e"] != \
        pytest.approx(tensor_checksum(t), rel=1e-9), "shards taken without their offsets must not pass"
    assert combine_worker_checksums(swapped)["embed.weight"] == pytest.approx(tensor_checksum(t), rel=1e-12)


def test_header_round_trip():
    for bucket in pack(iter(_named()), bucket_mb=0.25):
        assert decode_header(encode_header(bucket.metas), bucket.nbytes) == bucket.metas


HEADER = {"dtype": "bfloat16", "tensors": [["a", [2, 3], 0, 6], ["b", [], 6, 1]]}  # a payload of 7 bf16: 14 bytes


@pytest.mark.parametrize("header,payload,why", [
    (HEADER, 14, None),
    (b"\x80\x04K\x01.", 14, "not JSON"),  # a pickle
    (b"\xff\xfe", 14, "not JSON"),  # not UTF-8
    ([], 14, "not an object of 'dtype' and 'tensors'"),
    ({**HEADER, "extra": 1}, 14, "not an object of 'dtype' and 'tensors'"),
    ({**HEADER, "dtype": "Tensor"}, 14, "'Tensor' is not a torch dtype"),
    ({**HEADER, "dtype": "__class__"}, 14, "is not a torch dtype"),
    ({**HEADER, "dtype": ["bfloat16"]}, 14, "is not a torch dtype"),
    (HEADER, 13, "is not whole bfloat16 elements"),
    ({**HEADER, "tensors": []}, 14, "not a non-empty list"),
    ({**HEADER, "tensors": {"a": 1}}, 14, "not a non-empty list"),
    ({**HEADER, "tensors": [["a", [2, 3], 0]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [["a", [2, 3], 0, 6.0]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [["a", [2, True], 0, 2]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [["a", [2, 3], -1, 6]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [["", [6], 0, 6]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [[7, [6], 0, 6]]}, 14, "header tensor 0: not [name"),
    ({**HEADER, "tensors": [["a", [2, 3], 0, 5]]}, 14, "does not fit a payload of 7"),
    ({**HEADER, "tensors": [["a", [2, 3], 2, 6]]}, 14, "does not fit a payload of 7"),
])
def test_a_header_is_parsed_and_checked(header, payload, why):
    data = header if isinstance(header, bytes) else json.dumps(header).encode()
    if why is None:
        metas = decode_header(data, payload)
        assert [(m.name, m.shape, m.dtype, m.offset, m.numel) for m in metas] == \
            [("a", (2, 3), torch.bfloat16, 0, 6), ("b", (), torch.bfloat16, 6, 1)]
        return
    with pytest.raises(WireError) as e:
        decode_header(data, payload)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
