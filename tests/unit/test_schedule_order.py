"""torch's pipeline schedules played without devices (torchtitan/planning/schedule_order.py): the bubbles
of the played orders against the closed forms, and the planner weighing the zero-bubble schedules."""

import pytest

from torchtitan.distributed.pipeline import SPLIT_BACKWARD
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.planning.hardware import get_device
from torchtitan.planning.memory import ModelShape
from torchtitan.planning.planner import plan_layouts
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


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_gradient_moments_follow_the_played_order(schedule):
    """pp_moments: the largest activations alive among a rank's moments is the in-flight peak the estimator
    already used; every rank ends with all its gradients made; no moment is dominated by another."""
    from torchtitan.planning.memory import in_flight_microbatches, pp_moments

    for rank in range(4):
        moments = pp_moments(schedule, 8, 4, rank, 2, 0.45)
        peak = in_flight_microbatches(schedule, 8, 4, rank, 2, 0.45)
        assert max(m.in_flight for m in moments) == pytest.approx(peak)
        assert max(m.grad_share for m in moments) == pytest.approx(1.0)
        for a in moments:
            assert not any(b != a and b.in_flight >= a.in_flight and b.grad_share >= a.grad_share
                           and b.out_in_flight >= a.out_in_flight and b.sends_held >= a.sends_held for b in moments)
    assert pp_moments("1F1B", 8, 4, 0, 1) == ()


def test_the_last_stage_microbatches_alive_follow_the_placement_and_the_order():
    """RankWork.out_in_flight from the moments: only the rank holding the last stage has any (loop placement:
    the last rank; V placement: rank 0). LoopedBFS runs every forward first, so all 8 are alive at once;
    Interleaved1F1B's last stage runs forward-backward pairs, one at a time; split backward keeps a microbatch
    from its forward to its weight pass, which InterleavedZeroBubble defers (4 at once on its last rank) and the
    V schedules run at once for their last stage."""
    from torchtitan.planning.memory import pp_moments

    def most(schedule, rank):
        return max(m.out_in_flight for m in pp_moments(schedule, 8, 4, rank, 2, 0.45))

    assert [most("LoopedBFS", r) for r in range(4)] == [0, 0, 0, 8]
    assert [most("Interleaved1F1B", r) for r in range(4)] == [0, 0, 0, 1]
    assert [most("InterleavedZeroBubble", r) for r in range(4)] == [0, 0, 0, 4]
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert [most(schedule, r) for r in range(4)] == [1, 0, 0, 0]


def test_interleaved_first_rank_peaks_before_its_first_stage_has_gradients():
    """405B's published Interleaved1F1B (pp 8, 2 stages per rank, 8 microbatches): rank 0 runs all 16 forwards,
    then its later stage's 8 backwards (that stage's gradients made, all 16 forwards alive at the first), then
    its first stage's with 8 left alive. Unequal stages weigh the share by their parameters."""
    from torchtitan.planning.memory import pp_moments

    def activations_and_gradients(shares=None):
        """The moments no other exceeds in activations alive and gradients made (the sends held, a third
        coordinate, only grow: the largest of them comes with every gradient made)."""
        pairs = {(m.in_flight, m.grad_share) for m in pp_moments("Interleaved1F1B", 8, 8, 0, 2, stage_shares=shares)}
        return sorted(p for p in pairs if not any(o != p and o[0] >= p[0] and o[1] >= p[1] for o in pairs))

    assert activations_and_gradients() == [(4.0, 1.0), (8.0, 0.5)]
    assert activations_and_gradients((0.6, 0.4)) == [(4.0, 1.0), (8.0, 0.4)]
    # all 16 forwards sent their outputs by the peak of activations; the 8 input gradients of stage 8 follow
    at_peak = max(pp_moments("Interleaved1F1B", 8, 8, 0, 2), key=lambda m: (m.in_flight, m.sends_held))
    assert (at_peak.in_flight, at_peak.sends_held) == (8.0, 16)


def test_sends_are_held_until_the_step_ends():
    """torch's multi-stage runtime waits for its sends only when the step ends, and each send holds its tensor:
    by the end a rank holds one per forward of a stage whose next stage is on another rank and one per
    input-gradient (or full backward) pass of a stage whose previous one is. V placement passes between a rank's
    two adjacent stages without sending; the first stage sends no input gradient, the last no output."""
    from torchtitan.planning.memory import pp_moments

    def most(schedule, pp, rank):
        return max(m.sends_held for m in pp_moments(schedule, 8, pp, rank, 2, 0.45))

    # pp 2, V: rank 0 holds stages 0 and 3 (outputs of 0, input gradients of 3), rank 1 stages 1 and 2 (input
    # gradients of 1, outputs of 2; 1 -> 2 is local): 16 each.
    assert [most("ZBVZeroBubble", 2, r) for r in range(2)] == [16, 16]
    # pp 8, loop placement: rank 0 holds stages 0 and 8 (outputs of both, input gradients of 8): 24; the last
    # rank holds 7 and 15 (outputs of 7, input gradients of both): 24; a middle rank sends all four kinds: 32.
    assert [most("Interleaved1F1B", 8, r) for r in (0, 3, 7)] == [24, 32, 24]


def test_the_undominated_moments_are_exactly_those_no_other_exceeds():
    """The planner's fast filter (memory._undominated: a backward sweep over the walk's time-ordered (gradients
    made, sends held) states) against the definition, every moment compared with every other, on random walks
    whose states only grow, as a rank's do: same set, none missed (a missing moment could hide a rank's peak)."""
    import random

    from torchtitan.planning.memory import _undominated

    rng = random.Random(0)
    for _ in range(200):
        groups, made, sent = {}, frozenset(), 0
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.3:
                made = made | {rng.randint(0, 3)}
            sent += rng.randint(0, 2)
            points = groups.setdefault((made, sent), set())
            points.update((rng.randint(0, 6) + 0.5 * rng.randint(0, 2), rng.randint(0, 3))
                          for _ in range(rng.randint(1, 6)))
        every = {(a, m, o, s) for (m, s), points in groups.items() for a, o in points}
        by_definition = {x for x in every if not any(
            y != x and y[0] >= x[0] and y[1] >= x[1] and y[2] >= x[2] and y[3] >= x[3] for y in every)}
        assert set(_undominated(groups)) == by_definition
