"""Issue 33, point 3: the planning-time work (shared layouts, the descent's and DP's shortcuts,
the priced levels' box arithmetic) leaves the plans as they were. The figures below are the
bench's smoke cluster rows (bench/optimizer.py --tiny: a 2-layer LLaMA of seq 256, d_model
512, 8 heads x 64, d_ff 1376, 8 devices a node) as planned at commit b88ccf0, before that
work: bytes moved, bytes per link level and estimated seconds of auto / data / model."""

from __future__ import annotations

import pytest

import tensorql as tq
from tensorql.models import llama

SHAPE = dict(layers=2, seq=256, d_model=512, heads=8, head_dim=64, d_ff=1376)

RECORDED = {  # (devices, strategy): (intra bytes, inter bytes, estimated seconds)
    (8, "auto"): (32219136, 0, 1.6413971626666667e-05),
    (8, "data"): (32219136, 0, 1.6413971626666667e-05),
    (8, "model"): (36872192, 0, 1.8352744960000002e-05),
    (64, "auto"): (131059776, 51864064, 3.9779466453333336e-05),
    (64, "data"): (131059776, 51864064, 3.9779466453333336e-05),
    (64, "model"): (99937536, 195381248, 0.00012810567978666665),
    (256, "auto"): (122314624, 141523968, 2.412148328e-05),
    (256, "data"): (122314624, 141523968, 2.412148328e-05),
    (256, "model"): (138595664, 828120704, 0.00013143225661333332),
}


@pytest.fixture(scope="module")
def model():
    db = tq.connect()
    yield llama(db, **SHAPE, prefix="cluster_plans_")
    db.close()


@pytest.mark.parametrize("devices", [8, 64, 256])
def test_cluster_plans_are_as_recorded(model, devices):
    cache: dict = {}
    for strategy in ("auto", "data", "model"):
        plan = tq.optimize(model.output, devices=devices, strategy=strategy, cache=cache,
                           topology=f"{devices // 8}x8")
        intra, inter, seconds = RECORDED[(devices, strategy)]
        est = plan.estimate
        assert (est.bytes_at("intra"), est.bytes_at("inter")) == (intra, inter), strategy
        assert plan.cost.bytes_moved == intra + inter
        assert est.total_s == pytest.approx(seconds, rel=1e-12), strategy
