"""The trend under the nearest shapes' vote (``registry/nearest.py``): its features, its fit, when it applies, and that
the model stays deterministic and local. CPU only, synthetic data (made-up cost rules, never shipped); the evaluation on
the shipped H200 data is documented in ``bench/results/selection_data_loo/2026-12-01-cpu/``, not asserted here."""

from __future__ import annotations

import math
import random

import pytest

from fp8_backends import selection_data
from fp8_backends.registry import nearest

TILED = ("tiled", "", ())
CUBLAS = ("cublas", "", ())
RANK = {CUBLAS: (0,), TILED: (1,)}.get


def shape(n: int, k: int, m: int, tiled: float | None, cublas: float = 1.0, labels: tuple[str, ...] = ()):
    """A measured shape with the two candidates' µs (``tiled=None``: not measured there)."""
    us = {CUBLAS: cublas} if tiled is None else {TILED: tiled, CUBLAS: cublas}
    fastest = min(us.values())
    return nearest.MeasuredShape(n, k, m, f"{n}x{k}", labels, fastest, {c: v / fastest for c, v in us.items()}, {})


def pick(model: nearest.NearestModel, n: int, k: int, m: int):
    pred = model.predict(n, k, m)
    return nearest.choose(pred.scores, RANK, nearest.TIE_MARGIN)[0]


def fill(n: int, m: int, tm: int, tn: int, sms: int = 132) -> float:
    tiles = -(-m // tm) * -(-n // tn)
    return tiles / (-(-tiles // sms) * sms)


def wave_bound(m: int = 1024, ns=range(1536, 16385, 512), ks=(3584, 4096, 4608)):
    """The tiled kernel's time grows as the last wave of its 128x256 tiles empties (cuBLAS: 1.0)."""
    return [shape(n, k, m, 0.9 + 0.6 * (1.0 - fill(n, m, 128, 256)), labels=(f"m{n}/tp1/x",)) for n in ns for k in ks]


def test_trend_features_follow_the_kernels_tile_grids():
    f = nearest.trend_features(4096, 3696, 1024)
    assert f[:4] == (12.0, math.log2(3696), 4 / 8, 8 / 8)  # twos(3696) = 4; twos(4096) capped at 8
    assert f[4:] == pytest.approx((128 / 132, 256 / 264))  # 8 x 16 tiles of 128x256, 8 x 32 of 128x128
    assert nearest.trend_features(9216, 4096, 4)[4:] == pytest.approx((144 / 264,))  # N / 64 tiles at M <= 16
    assert nearest.trend_features(9216, 4096, 64)[4:] == pytest.approx((144 / 264,))
    assert nearest.trend_features(4096, 4096, 256)[4:] == pytest.approx((128 / 132,))  # 4 x 32 tiles of 64x128
    assert len(nearest.trend_features(4096, 4096, 32)) == 6  # Triton 32x64 and CUTLASS 16x64: two grids
    assert nearest.trend_features(9216, 4096, 64, sms=144)[4:] == pytest.approx((1.0,))
    assert nearest.DEFAULT_TREND.tiles(100000) == ((128, 256), (128, 128))
    for bad in ({"ridge": 0.0}, {"align_cap": 0}, {"shapes_per_coefficient": 0}, {"kernel_tiles": ((16, ()),)},
                {"kernel_tiles": ((None, ()),)}, {"kernel_tiles": ((None, ((0, 64),)),)}):
        with pytest.raises(ValueError):
            nearest.Trend(**bad)


def test_solve():
    a = [[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]]
    x = [0.3, -1.2, 2.5]
    b = [sum(r[j] * x[j] for j in range(3)) for r in a]
    assert nearest._solve(a, b) == pytest.approx(x)


def test_the_trend_carries_what_holds_across_shapes_to_a_shape_whose_neighbours_miss_it():
    """At M = 1024 the tiled kernel's 128x256 grid leaves most SMs idle in the last wave at N = 4224 (136 tiles),
    but its nearest measured shape is N = 4096 (128 tiles, a full wave: the tiled kernel wins there). The vote
    alone follows it; the trend, fitted over every N, predicts the loss. At N = 8448 (264 tiles, two full waves)
    between 8192 (fast) and 8704 (slow), the other way round."""
    data = wave_bound()
    vote = nearest.NearestModel(data, trend=None)
    model = nearest.NearestModel(data)
    assert vote.predict(4224, 4096, 1024).neighbours[0].shape.shape == "4096x4096"
    assert (pick(vote, 4224, 4096, 1024), pick(model, 4224, 4096, 1024)) == (TILED, CUBLAS)
    assert dict(model.predict(4224, 4096, 1024).scores)[TILED] > 1.1  # the rule says 0.9 + 0.6 x 0.485 = 1.19
    assert (pick(vote, 8448, 4096, 1024), pick(model, 8448, 4096, 1024)) == (CUBLAS, TILED)
    # at a full wave, and at the measured shapes themselves, both models agree with the data
    for n in (4096, 8192):
        assert pick(model, n, 4096, 1024) == pick(vote, n, 4096, 1024) == TILED, n
    assert pick(model, 4608, 4096, 1024) == CUBLAS


def test_small_data_gets_no_trend():
    """Fewer shapes than shapes_per_coefficient x coefficients: the vote alone, to the last bit."""
    data = wave_bound(ns=range(2048, 6145, 1024), ks=(4096, 8192))  # 10 shapes; 7 coefficients x 2 needed
    model, vote = nearest.NearestModel(data), nearest.NearestModel(data, trend=None)
    assert all(v is None for v in model._trends[1024].coef.values())
    rng = random.Random(0)
    for _ in range(50):
        n, k = rng.randrange(512, 20000), rng.randrange(512, 20000)
        assert model.predict(n, k, 1024) == vote.predict(n, k, 1024)


def test_a_candidate_measured_at_too_few_shapes_gets_no_trend_and_missing_counts_as_slow():
    data = wave_bound()
    data = [s if s.n <= 3072 else shape(s.n, s.k, s.m, None) for s in data]  # tiled only measured up to N = 3072
    model = nearest.NearestModel(data)
    coef = model._trends[1024].coef
    assert coef[CUBLAS] is not None and coef[TILED] is None  # 12 shapes measure it: < 2 x 7 coefficients
    assert {ck for ck, _ in model.predict(12288, 4096, 1024).scores} == {CUBLAS}  # no neighbour measured it
    pred = model.predict(3328, 4096, 1024)  # between 3072 (measured) and 3584 (not): a missing one counts 2x
    assert {ck for ck, _ in pred.scores} == {CUBLAS, TILED} and pred.scores[0][0] == CUBLAS
    assert dict(pred.scores)[TILED] > 1.2


def test_deterministic_order_independent_and_never_below_one():
    data = wave_bound()
    model = nearest.NearestModel(data)
    shuffled = nearest.NearestModel(random.Random(7).sample(data, len(data)))
    rng = random.Random(3)
    for _ in range(200):
        n, k = rng.randrange(16, 1 << 20), rng.randrange(16, 1 << 20)
        pred = model.predict(n, k, 1024)
        assert pred == model.predict(n, k, 1024) == shuffled.predict(n, k, 1024)
        assert pred.scores[0][1] >= 1.0 and all(math.isfinite(s) for _, s in pred.scores)
        assert sum(nb.weight for nb in pred.neighbours) == pytest.approx(1.0)


def test_no_extrapolation_in_size():
    """log2 N and log2 K beyond the measured range count as the range's edge: the trend at N = 2^22 is the trend
    at the largest measured N."""
    model = nearest.NearestModel(wave_bound())
    fitted = model._trends[1024]
    far, edge = (nearest.trend_features(n, 4096, 1024) for n in (1 << 22, 16384))
    assert fitted.clamp(far)[:2] == fitted.clamp(edge)[:2] == (14.0, 12.0)
    for ck in (TILED, CUBLAS):
        assert fitted.value(ck, fitted.clamp(far)) == pytest.approx(
            fitted.value(ck, fitted.clamp((14.0, 12.0, *far[2:]))))


def test_leave_out_holds_the_group_out_of_the_trend_too():
    """Each group is predicted by a model built without it (the trend is refitted), not by the full model."""
    data = wave_bound()
    model = nearest.NearestModel(data)
    group_of = selection_data._group_of("model")
    rows = nearest.leave_out(model, group_of, RANK, nearest.TIE_MARGIN)
    assert len(rows) == len(data)
    for r in rows[::7]:
        alone = nearest.NearestModel([s for s in data if group_of(s) != r.group])
        want = nearest.choose(alone.predict(r.shape.n, r.shape.k, r.shape.m).scores, RANK, nearest.TIE_MARGIN)
        assert (r.picked, r.predicted) == want
    # the vote alone holds out the same way as before (neighbours only)
    vote = nearest.NearestModel(data, trend=None)
    for r in nearest.leave_out(vote, group_of, RANK, nearest.TIE_MARGIN)[::9]:
        pred = vote.predict(r.shape.n, r.shape.k, r.shape.m, exclude=lambda s, g=r.group: group_of(s) == g)
        assert (r.picked, r.predicted) == nearest.choose(pred.scores, RANK, nearest.TIE_MARGIN)
