"""The compact per-rank vectors of metrics schema 2 (config/vectors.py) and the record model that
writes and reads them (config/records.py)."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import zstandard

from mscale.config.records import MetricsRecord, metrics_version_for
from mscale.config.vectors import (
    CODECS, COMPACT_MIN_RANKS, DTYPES, MAX_RANKS, decode_vector, encode_vector,
)
from mscale.errors import MscaleError

TIMES = np.array([1.234567, 0.5, 0.0, 1e-6, 3600.0, 2.0 ** -20])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_and_codec_round_trips(dtype, codec):
    scale = {"<i4": 1e-4, "<i8": 1e-6}.get(dtype, 1.0)  # int32 µs would end at 2,147 s
    out = decode_vector(json.loads(json.dumps(encode_vector(TIMES, dtype, scale, codec))))
    tol = {"<f4": 1e-7 * 3600, "<f8": 0.0}.get(dtype, scale / 2 * 1.001)
    np.testing.assert_allclose(out, TIMES, rtol=0, atol=tol)


def test_what_mscale_writes_keeps_microseconds_and_nan():
    values = [1.0000014, np.nan, np.inf, -2e-6, 1e30]
    enc = encode_vector(values)
    assert enc["dtype"] == "<i8" and enc["scale"] == 1e-6 and enc["codec"] == "shuffle+zstd"
    out = decode_vector(enc)
    assert out[0] == pytest.approx(1.000001, abs=1e-12)
    assert out[3] == pytest.approx(-2e-6, abs=1e-12)
    assert np.isnan(out[[1, 2, 4]]).all()


def test_the_simplest_form_another_trainer_writes():
    """Only ``data`` and ``dtype``: plain little-endian float32, no codec, no scale."""
    data = base64.b64encode(np.array([0.25, 1.5], "<f4").tobytes()).decode()
    assert decode_vector({"dtype": "<f4", "data": data}).tolist() == [0.25, 1.5]
    assert decode_vector({"data": data}).tolist() == [0.25, 1.5]  # <f4 is the default dtype


def test_compact_is_several_times_smaller_than_json_text():
    rng = np.random.default_rng(0)
    times = 1.0 + rng.normal(0, 0.01, 4096)  # a synchronous job's step times: close together
    assert len(json.dumps(encode_vector(times))) * 6 < len(json.dumps(times.tolist()))


@pytest.mark.parametrize("obj, says", [
    ({"dtype": "<f4"}, "needs 'data'"),
    ({"data": "", "shape": [2]}, "needs 'data'"),
    ([1.0], "needs 'data'"),
    ({"dtype": ">f4", "data": ""}, "unknown dtype"),
    ({"codec": "lz4", "data": ""}, "unknown dtype"),
    ({"scale": "1e-6", "data": ""}, "scale must be a number"),
    ({"data": "not base64!"}, "not base64"),
    ({"dtype": "<f8", "data": base64.b64encode(b"12345").decode()}, "not a whole <f8 vector"),
    ({"codec": "zstd", "data": base64.b64encode(b"nonsense").decode()}, "not a zstd frame"),
])
def test_malformed_vectors_are_named_errors(obj, says):
    with pytest.raises(MscaleError) as e:
        decode_vector(obj, field="comm_wait")
    assert says in e.value.message and e.value.field == "comm_wait"


def test_a_zstd_frame_too_big_or_of_unknown_size_is_refused_before_inflating():
    bomb = zstandard.ZstdCompressor().compress(bytes(4 * MAX_RANKS + 4))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(16))
    for raw in (bomb, unsized):
        with pytest.raises(MscaleError, match="zstd frame declares"):
            decode_vector({"codec": "zstd", "data": base64.b64encode(raw).decode()})


def test_a_vector_of_the_wrong_length_is_refused():
    with pytest.raises(MscaleError, match="has 6 ranks, the job has 8"):
        decode_vector(encode_vector(TIMES), world=8)


def _record(world: int, version: int) -> MetricsRecord:
    v = [0.5 + r * 1e-3 for r in range(world)]
    return MetricsRecord(schema_version=version, step=3, loss=math.nan, grad_norm=1.0,
                         clip_threshold=2.0, lr=1e-4, tokens=10, tokens_per_s=5.0, step_time=v,
                         compute_time=v, comm_wait=v, data_time=v)


def test_small_worlds_stay_version_1_and_large_ones_are_compact():
    assert metrics_version_for(COMPACT_MIN_RANKS - 1) == 1
    assert metrics_version_for(COMPACT_MIN_RANKS) == 2
    small = json.loads(_record(8, 1).model_dump_json(exclude_none=True))
    assert small["schema_version"] == 1 and isinstance(small["step_time"], list)
    big = json.loads(_record(8, 2).model_dump_json(exclude_none=True))
    assert big["schema_version"] == 2 and big["step_time"]["codec"] == "shuffle+zstd"
    assert "bubble_time" not in big


def test_the_record_model_reads_both_versions_as_lists():
    for version in (1, 2):
        back = MetricsRecord.model_validate_json(_record(8, version).model_dump_json())
        np.testing.assert_allclose(back.step_time, [0.5 + r * 1e-3 for r in range(8)], atol=1e-9)
        assert math.isnan(back.loss)  # JSON wrote the NaN loss as null


def test_the_record_model_refuses_a_record_from_the_future():
    data = json.loads(_record(2, 2).model_dump_json())
    with pytest.raises(ValueError, match="newer than this mscale"):
        MetricsRecord.model_validate({**data, "schema_version": 3})
