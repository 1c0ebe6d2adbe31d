"""Logit processors and the sampler: against a naive float64 reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from specrt.runtime.sampling import SamplingParams, probs_from_logits, sample

ALPHA = 2e-8  # per goodness-of-fit assertion; budget in test_verify_stats.py


def reference_probs(z: np.ndarray, prm: SamplingParams) -> np.ndarray:
    """Naive definition, written differently from the implementation on purpose."""
    z = np.asarray(z, dtype=np.float32)
    out = np.zeros(z.shape)
    for i, row in enumerate(z):
        if prm.greedy:
            out[i, int(np.argmax(row))] = 1.0
            continue
        # scaled logits and their exp at the sampler's float32 precision: two logits closer than float32
        # resolves after exp (e.g. 1e-9 and 0 at T = 0.3) are a tie for both, not a strict order here only
        row = (row - row.max()) / np.float32(prm.temperature)
        if prm.top_k:
            # keep x iff fewer than k tokens are strictly larger (ties kept)
            keep = np.array([(row > v).sum() < prm.top_k for v in row])
            row = np.where(keep, row, -np.inf)
        pr = np.exp(row).astype(np.float64)
        pr /= pr.sum()
        if prm.top_p < 1.0:
            # keep x iff the mass strictly above p(x) is < top_p (ties kept)
            keep = np.array([pr[pr > v].sum() < prm.top_p for v in pr])
            pr = np.where(keep, pr, 0.0)
            pr /= pr.sum()
        out[i] = pr
    return out


# ---------------------------------------------------------------- params

@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=-1.0), "temperature=0.0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(top_k=-1), "top_k=0"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p=1.0"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=-3), "seed=None"),
    (dict(seed=1.5), "seed"),
])
def test_params_validation_names_the_fix(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy
    a = SamplingParams(temperature=1.0, seed=7).generator().random(4)
    b = SamplingParams(temperature=1.0, seed=7).generator().random(4)
    assert np.array_equal(a, b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0


# ---------------------------------------------------------------- processors

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=100),   # k >= V: off
]


@pytest.mark.parametrize("prm", PARAMS, ids=str)
def test_matches_reference(prm):
    z = np.random.default_rng(0).normal(0, 2, size=(6, 11)).astype(np.float32)
    z[1, 3] = z[1, 7] = z[1].max() + 1          # a tie at the top
    z[2, :4] = -np.inf                            # masked tokens
    got = probs_from_logits(z, prm)
    assert got.dtype == np.float32 and got.shape == z.shape
    np.testing.assert_allclose(got, reference_probs(z, prm), atol=2e-6)


def test_ties_at_the_topk_and_topp_boundary_are_kept():
    z = np.log(np.array([[4, 2, 2, 1, 1]], dtype=np.float32))
    pk = probs_from_logits(z, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, :3] > 0).all() and (pk[0, 3:] == 0).all()
    # mass above 2/10 is 0.4 < 0.5, so both tokens with p=0.2 belong to the nucleus
    pp = probs_from_logits(z, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(pp[0], [0.5, 0.25, 0.25, 0, 0], atol=1e-7)


def test_out_buffer_is_used_and_may_alias_logits():
    z = np.random.default_rng(1).normal(size=(3, 50)).astype(np.float32)
    prm = SamplingParams(temperature=0.7)
    ref = probs_from_logits(z, prm)
    out = np.empty_like(z)
    assert probs_from_logits(z, prm, out=out) is out
    np.testing.assert_array_equal(out, ref)
    zz = z.copy()
    assert probs_from_logits(zz, prm, out=zz) is zz
    np.testing.assert_array_equal(zz, ref)
    with pytest.raises(ValueError, match="out must be float32"):
        probs_from_logits(z, prm, out=np.empty((3, 50), np.float64))


def test_one_dim_and_greedy_ties():
    z = np.array([0.0, 3.0, 3.0, 1.0], np.float32)
    g = probs_from_logits(z, SamplingParams())
    assert g.shape == (4,) and g.tolist() == [0, 1, 0, 0]


def test_tiny_temperature_does_not_make_nan():
    z = np.array([[1.0, 2.0, 2.0 - 1e-3, -np.inf]], np.float32)
    pr = probs_from_logits(z, SamplingParams(temperature=1e-30))
    assert np.isfinite(pr).all() and pr[0, 1] == 1.0


@pytest.mark.parametrize("bad, needle", [
    (np.nan, "NaN"), (np.inf, r"\+inf"),
])
def test_nan_inf_logits_raise(bad, needle):
    z = np.zeros((3, 8), np.float32)
    z[2, 5] = bad
    for prm in (SamplingParams(), SamplingParams(temperature=1.0)):
        with pytest.raises(ValueError, match=f"row 2 contains {needle}"):
            probs_from_logits(z, prm)


def test_all_masked_row_raises():
    z = np.zeros((2, 8), np.float32)
    z[1] = -np.inf
    with pytest.raises(ValueError, match="all -inf"):
        probs_from_logits(z, SamplingParams(temperature=1.0))


@settings(max_examples=60, deadline=None)
@given(
    z=hnp.arrays(np.float32, (3, 7), elements=st.floats(-60, 60, width=32)),
    t=st.sampled_from([0.0, 0.3, 1.0, 2.5]), k=st.integers(0, 8),
    tp=st.sampled_from([0.1, 0.5, 0.95, 1.0]),
)
def test_processors_properties(z, t, k, tp):
    prm = SamplingParams(temperature=t, top_k=k, top_p=tp)
    pr = probs_from_logits(z, prm)
    assert (pr >= 0).all()
    np.testing.assert_allclose(pr.sum(axis=1), 1.0, atol=1e-5)
    # the most likely token always survives every filter
    assert (pr[np.arange(3), z.argmax(axis=1)] == pr.max(axis=1)).all()
    np.testing.assert_allclose(pr, reference_probs(z, prm), atol=1e-5)


# ---------------------------------------------------------------- sampler

def test_sample_matches_distribution_across_blocks():
    # Mass spread over indices in several 1024-blocks, incl. the ragged last one.
    V = 3000
    idx = np.array([0, 5, 1023, 1024, 1500, 2047, 2048, 2990, 2999])
    w = np.arange(1, idx.size + 1, dtype=np.float64)
    row = np.zeros(V, np.float32)
    row[idx] = w / w.sum()
    rng = np.random.default_rng(123)
    draws = np.array([sample(row, rng) for _ in range(20000)])
    assert np.isin(draws, idx).all()                 # never a zero-probability token
    obs = np.array([(draws == i).sum() for i in idx])
    assert stats.chisquare(obs, 20000 * w / w.sum()).pvalue > ALPHA


def test_sample_unnormalised_and_exclude():
    row = np.array([0.0, 3.0, 1.0, 0.0, 4.0], np.float32)  # sums to 8
    rng = np.random.default_rng(5)
    draws = np.array([sample(row, rng, exclude=[4]) for _ in range(8000)])
    assert set(np.unique(draws)) == {1, 2}
    assert stats.binomtest(int((draws == 1).sum()), draws.size, 0.75).pvalue > ALPHA
    assert sample(row, rng, exclude=[1, 2]) == 4
    with pytest.raises(ValueError, match="no mass"):
        sample(row, rng, exclude=[1, 2, 4])
    with pytest.raises(ValueError, match="no mass"):
        sample(np.zeros(4, np.float32), rng)


def test_sample_rejects_nan_and_is_seeded():
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.5, np.nan], np.float32), np.random.default_rng(0))
    row = np.random.default_rng(0).dirichlet(np.ones(5000)).astype(np.float32)
    a = [sample(row, np.random.default_rng(9)) for _ in range(3)]
    assert len(set(a)) == 1
    assert sample(np.ones(1, np.float32), np.random.default_rng(0)) == 0
