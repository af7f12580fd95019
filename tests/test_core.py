"""The pure core without a server: the sampling key and what derives from it (the job key,
the cursor's fields, the mismatch messages). The sampler, cursor and planning have their own
unit and property tests (test_sampler.py, test_cursor.py, test_properties.py)."""
from __future__ import annotations

import dataclasses

import pytest

from feeder.core import sampling_key as key
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor
from feeder.core.planning import StreamPlan

SPEC = StreamSpec(job="j", rank=1, world_size=4, seq_len=16, micro_batch=2, seed=7, num_epochs=2)


def _cursor(**kw) -> Cursor:
    base = dict(job="j", fingerprint="fp", seed=7, shuffle=True, drop_last=False, seq_len=16, world_size=4, rank=1,
                epoch=0, base=0, pos=2, step=1)
    return Cursor(**{**base, **kw})


def test_the_cursor_records_every_field_of_the_key():
    fields = {f.name for f in dataclasses.fields(Cursor)}
    assert set(key.CURSOR) <= fields
    assert set(key.SAMPLES) <= set(key.JOB) and set(key.SAMPLES) <= set(key.CURSOR)


def test_the_job_key_is_the_spec_s_values_of_job_fields():
    assert key.job_key(SPEC) == tuple(getattr(SPEC, n) for n in key.JOB)
    other = dataclasses.replace(SPEC, micro_batch=3)
    e = key.job_mismatch("j", key.job_key(SPEC), key.job_key(other))
    assert "micro_batch=2" in str(e) and "micro_batch=3" in str(e)


@pytest.mark.parametrize("field,value", [("seed", 8), ("shuffle", False), ("drop_last", True), ("seq_len", 32),
                                         ("world_size", 2), ("rank", 0), ("job", "k"), ("fingerprint", "other")])
def test_every_key_field_of_a_cursor_is_checked_on_resume(field, value):
    e = key.cursor_mismatch(_cursor(**{field: value}), SPEC, "fp")
    assert e is not None and f"{value!r}" in str(e)
    assert e.elsewhere == (field == "fingerprint")   # another replica may have the job's data
    with pytest.raises(type(e)):
        StreamPlan(SPEC, n_tokens=10_000, fingerprint="fp", cursor=_cursor(**{field: value}))
    assert key.cursor_mismatch(_cursor(), SPEC, "fp") is None


def test_reshard_leaves_the_dealing_out_of_the_check():
    spec = dataclasses.replace(SPEC, reshard=True, world_size=2, rank=0)
    assert key.cursor_mismatch(_cursor(), spec, "fp") is None
    assert "reshard" in str(key.cursor_mismatch(_cursor(), dataclasses.replace(spec, reshard=False), "fp"))
    # a plan that cannot reshard names its own fields and gets no hint
    e = key.cursor_mismatch(_cursor(rank=3), SPEC, "fp", fields=("job", "rank"))
    assert "rank differs" in str(e) and "reshard" not in str(e)
