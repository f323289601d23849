from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from buckets import BucketError, BucketTable, GraphKey, PromptTooLongError, parse_sizes, powers_of_two
from buckets.defaults import default_kv_lengths

sizes = st.lists(st.integers(1, 4096), min_size=1, max_size=8, unique=True).map(lambda xs: tuple(sorted(xs)))


@given(lengths=sizes, n=st.integers(1, 5000))
def test_length_for_is_smallest_bucket_at_least_n(lengths: tuple[int, ...], n: int) -> None:
    table = BucketTable(lengths=lengths)
    if n > lengths[-1]:
        with pytest.raises(PromptTooLongError) as err:
            table.length_for(n)
        assert err.value.limit == lengths[-1] and err.value.length == n
        return
    bucket = table.length_for(n)
    assert bucket in lengths and bucket >= n
    assert all(b < n for b in lengths if b < bucket)


@given(lengths=sizes)
def test_boundaries(lengths: tuple[int, ...]) -> None:
    table = BucketTable(lengths=lengths)
    for b in lengths:
        assert table.length_for(b) == b  # exactly at a boundary uses that bucket
        if b > 1 and b - 1 not in lengths:
            assert table.length_for(b - 1) == b


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lengths": ()}, "lengths must not be empty"),
        ({"lengths": (64, 32)}, "strictly increasing"),
        ({"lengths": (32, 32)}, "strictly increasing"),
        ({"lengths": (0, 32)}, "holds 0"),
        ({"lengths": (32,), "batch_sizes": (1, -2)}, "holds -2"),
        ({"lengths": (32,), "batch_sizes": (1, 2), "prefill_batch_sizes": (4,)}, "exceed the largest batch"),
        ({"lengths": (32, 64), "context_length": 48}, "context_length 48"),
    ],
)
def test_invalid_tables_name_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(BucketError, match=message):
        BucketTable(**kwargs)


def test_default_derives_from_context_limit() -> None:
    table = BucketTable.default(8192, max_length=2048)
    assert table.lengths == (64, 128, 256, 512, 1024, 2048)
    assert table.context_length == 2048
    assert BucketTable.default(100, min_length=32).lengths == (32, 64, 100)
    assert powers_of_two(32, 32) == (32,)


def test_graph_keys_fixed_order_and_count() -> None:
    table = BucketTable(lengths=(16, 32), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=64,
                        kv_lengths=(32, 64))
    keys = list(table.graph_keys())
    assert keys[:6] == [GraphKey("decode", b, kv) for b in (1, 2, 4) for kv in (32, 64)]
    assert keys[6:9] == [GraphKey("sample", rows, 0) for rows in (1, 2, 4)]  # one per row bucket of logits
    assert keys[9:] == [GraphKey("prefill", 1, 16), GraphKey("prefill", 2, 16),
                        GraphKey("prefill", 1, 32), GraphKey("prefill", 2, 32)]
    assert table.num_graphs == len(keys) == len(set(keys)) == 13
    assert keys[0].bucket == "b1_kv32" and keys[6].bucket == "b1" and keys[9].bucket == "b1_l16"


def test_kv_buckets_default_route_and_validate() -> None:
    assert default_kv_lengths(2048) == (256, 512, 1024, 2048)
    assert default_kv_lengths(3000) == (256, 512, 1024, 2048, 3000)
    assert default_kv_lengths(100) == (100,)
    table = BucketTable(lengths=(16, 32), context_length=64, kv_lengths=(16, 48, 64))
    # A step needs the longest row's position + 1 positions; a boundary uses that bucket.
    assert [table.kv_for(n) for n in (1, 16, 17, 48, 49, 64)] == [16, 16, 48, 48, 64, 64]
    for bad in (0, 65):
        with pytest.raises(BucketError, match="outside 1..64"):
            table.kv_for(bad)
    with pytest.raises(BucketError, match="must end at the context length 64"):
        BucketTable(lengths=(16, 32), context_length=64, kv_lengths=(16, 32))
    with pytest.raises(BucketError, match="kv_lengths"):
        BucketTable(lengths=(16, 32), context_length=64, kv_lengths=(64, 16))
    assert BucketTable(lengths=(16, 32), context_length=64).kv_lengths == (64,)
    assert BucketTable.from_dict(table.to_dict()) == table


def test_batch_routing_and_request_check() -> None:
    table = BucketTable(lengths=(16, 32), batch_sizes=(1, 2, 4), context_length=40)
    assert [table.batch_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError):
        table.batch_for(5)
    assert table.check_request(20, 20) == 32
    with pytest.raises(PromptTooLongError, match="prompt \\+ max_tokens"):
        table.check_request(20, 21)


def test_file_round_trip(tmp_path) -> None:
    table = BucketTable(lengths=(8, 24, 100), batch_sizes=(1, 3), prefill_batch_sizes=(1,), context_length=128)
    table.save(tmp_path / "b.json")
    assert BucketTable.load(tmp_path / "b.json") == table
    (tmp_path / "bad.json").write_text('{"lengths": [8], "colour": 1}')
    with pytest.raises(BucketError, match="unknown bucket fields"):
        BucketTable.load(tmp_path / "bad.json")


def test_parse_sizes() -> None:
    assert parse_sizes("64, 128,256") == (64, 128, 256)
    with pytest.raises(BucketError):
        parse_sizes("64,abc")


def test_chunked_prefill_routes_long_prompts_to_chunk_multiples() -> None:
    table = BucketTable.default(2048, chunk_length=256)
    assert table.lengths == (64, 128, 256) and table.chunked_prefill and table.chunk_length == 256
    assert [table.length_for(n) for n in (1, 256, 257, 512, 513, 2048)] == [64, 256, 512, 512, 768, 2048]
    assert table.request_lengths == (64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert table.chunk_kv_lengths == (512, 1024, 2048)  # a chunk after the first reaches past position 256
    chunk_keys = [k for k in table.graph_keys() if k.phase == "chunk"]
    assert chunk_keys == [GraphKey("chunk", 1, kv) for kv in (512, 1024, 2048)]
    assert chunk_keys[0].bucket == "kv512" and table.num_graphs == 4 * 4 + 3 + 4 + 3 == len(list(table.graph_keys()))
    with pytest.raises(PromptTooLongError, match="2049 tokens, more than the limit of 2048"):
        table.length_for(2049)
    with pytest.raises(BucketError, match="multiple of the chunk"):
        BucketTable(lengths=(64, 96), context_length=200, chunked_prefill=True)
    assert BucketTable.from_dict(table.to_dict()) == table
    unchunked = BucketTable.default(2048)
    assert unchunked.chunk_length == 0 and unchunked.request_lengths == unchunked.lengths
    assert BucketTable.default(256, chunk_length=256).chunked_prefill is False  # nothing to chunk


def test_max_step_tokens_caps_what_a_mixed_step_carries_while_rows_decode() -> None:
    mixed = dict(lengths=(32, 64, 128, 256), batch_sizes=(1, 16), context_length=2048, chunked_prefill=True,
                 mixed_tokens=(32, 64, 128, 256, 512, 1024))
    assert BucketTable(**mixed).mixed_budget == 256  # 0: the chunk length
    capped = BucketTable(**mixed, max_step_tokens=128)
    assert (capped.mixed_budget, capped.solo_budget) == (128, 1024)  # steps without decoding rows: unchanged
    assert BucketTable(**mixed, max_step_tokens=100).mixed_budget == 64  # the largest token bucket up to it
    assert BucketTable.from_dict(capped.to_dict()) == capped and capped.to_dict()["max_step_tokens"] == 128
    assert BucketTable(**mixed, max_step_tokens=8).mixed_budget == 32  # at least the smallest token bucket
    with pytest.raises(BucketError, match="must exceed the largest batch bucket 32"):
        BucketTable(**{**mixed, "batch_sizes": (1, 32)}, max_step_tokens=32)  # no room beside 32 decoding rows
    for bad in (-1, 1.5, True):
        with pytest.raises(BucketError, match="max_step_tokens must be an integer >= 0"):
            BucketTable(**mixed, max_step_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(BucketError, match="max_step_tokens must be an integer"):
        BucketTable.from_dict({**capped.to_dict(), "max_step_tokens": "128"})

