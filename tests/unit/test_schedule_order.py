"""torch's pipeline schedules played without devices (torchtitan/planning/schedule_order.py): the bubbles
of the played orders against the closed forms, and the planner weighing the zero-bubble schedules."""

import pytest

from torchtitan.models.llama3 import llama3_flavors
from torchtitan.planning.hardware import get_device
from torchtitan.planning.memory import ModelShape
from torchtitan.planning.planner import SPLIT_BACKWARD, plan_layouts
from torchtitan.planning.schedule_order import bubble_fraction, schedule_order


@pytest.mark.parametrize("m,pp,v", [(8, 2, 2), (16, 4, 2), (32, 8, 2), (32, 8, 4), (24, 4, 3)])
def test_interleaved_and_looped_orders_have_the_textbook_bubble(m, pp, v):
    """Played with a backward twice a forward, Interleaved1F1B's and LoopedBFS's orders idle (pp - 1) / (v m)
    of the busiest rank's compute: the closed form the planner uses for Interleaved1F1B."""
    for schedule in ("Interleaved1F1B", "LoopedBFS"):
        assert bubble_fraction(schedule, m, pp, v, 1.0, 1.0, 1.0) == pytest.approx((pp - 1) / (v * m))


def test_split_backward_fills_a_third_of_the_bubble_with_weight_passes():
    """Forward, input-gradient and weight-gradient passes of equal length: the zero-bubble orders idle a third
    of Interleaved1F1B's (the weight passes fill the rest); a full backward (3 units) leaves them nothing."""
    interleaved = bubble_fraction("Interleaved1F1B", 16, 4, 2, 1.0, 1.0, 1.0)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        assert bubble_fraction(schedule, 16, 4, 2, 1.0, 1.0, 1.0) == pytest.approx(interleaved / 3)
    assert all(a.computation_type.name != "BACKWARD_WEIGHT" for a in schedule_order("Interleaved1F1B", 16, 4, 2)[0])


def test_the_planner_weighs_zero_bubble_schedules_where_they_can_run():
    """8B on 16 H200 with a pipeline: without AC the zero-bubble schedules win; with op AC they cannot run and
    with full AC their memory is not modelled, so no ranked layout pairs them."""
    shape = ModelShape.from_args(llama3_flavors["8B"])
    ranked = plan_layouts(shape, get_device("H200-141GB"), 16, 8192, 32, model_parallel=frozenset({"pp"})).ranked
    assert ranked[0].layout.schedule in SPLIT_BACKWARD and ranked[0].layout.ac == "none"
    assert all(c.layout.ac == "none" for c in ranked if c.layout.schedule in SPLIT_BACKWARD)
    assert any(c.layout.ac != "none" for c in ranked)  # the other schedules keep every AC mode
