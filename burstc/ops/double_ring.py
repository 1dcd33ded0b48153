"""The double ring: ring attention on a nodes x ranks-per-node mesh (:class:`~burstc.ops.ring_comm.TwoLevelRing`).

BurstEngine's topology-aware ring and LoongTrain's double ring: the slow inter-node links carry each
block once per node, and those transfers travel behind a whole node's worth of compute steps.

The P = N * G compute steps (N nodes, G ranks per node) run as N outer steps of G inner ones.  In outer
step ``j`` this rank (node ``n``, local index ``g``) holds its *lane block*: the travelling side of rank
``(n - j, g)``, which came straight from there over the inter-node link (its own at ``j = 0``).  Inner
step ``i`` attends to the travelling side of ``(n - j, g - i)``, sent by that block's holder on this
node, ``(n, g - i)``, over the intra-node link (the direct pattern of :mod:`burstc.ops.ring_loops`,
inside the node).  The next lane block is posted at the start of an outer step and waited for at its
end.  Per rank and call, the inter-node link carries N - 1 blocks (the direct pattern over the
flattened mesh: G * (N - 1); a flat ring whose hop crosses nodes: P - 1, every one waited for).

Mask-aware like the flat ring: a lane block carries the rows any rank of the receiving node needs
(the union of :func:`~burstc.block_geometry.travelling_rows` over the node), an intra-node transfer the
rows its receiver needs.

Backward: the travelling side's gradients computed at inner step ``i >= 1`` go back to the lane holder
at the next step (intra-node) and add into its lane's gradients; once a lane's are complete (after the
first step of the next outer step), they go home over the inter-node link at the second step of that
outer step.  The last lane's need two extra hops after the last compute step.  Bytes per step and per
link class are :func:`burstc.planner.predicted_double_ring_transfers` (tested per rank and step).
"""
from __future__ import annotations

from torch import Tensor

from burstc.attention_ir import MaskSpec
from burstc.block_geometry import DoubleRingRoutes
from burstc.ops.head_groups import GroupLoop
from burstc.ops.ring_comm import TwoLevelRing, wait
from burstc.ops.ring_loops import (_DQ, _DK, _DV, NO_TRANSFER, BackwardPlan, FirstTransfer, MaskData, _Accumulator,
                                   _add_returned_, _Arrivals, _rows_between, _wait, attend_backward, attend_forward,
                                   backward_sides, fp32_zeros_like, input_transfer, return_transfer)
from burstc.ops.ring_stats import CallRecorder


def double_ring_forward_loop(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ring: TwoLevelRing, layout: str,
                             mask: MaskSpec, scale: float, data: MaskData, recorder: CallRecorder) -> GroupLoop:
    """This rank's ``(out in q.dtype, lse_BHS fp32)`` rows of attention over the double ring, in the three parts
    of :data:`burstc.ops.head_groups.GroupLoop` (the first: posting the first lane's transfer)."""
    local_len = q_BHSD.shape[2]
    nodes, per_node = ring.nodes, ring.per_node
    home = [k_BHSD.contiguous(), v_BHSD.contiguous()]
    routes = DoubleRingRoutes(ring, _rows_between(False, layout, mask, local_len, ring, data, any_pair=True))
    lanes, arrivals = _Arrivals(home), _Arrivals(home)
    lane, acc = home, _Accumulator(q_BHSD, mask, data)

    def post_lane(j: int):
        """Post lane ``j + 1``'s transfer (during outer step ``j``): ``(requests, runs, arriving)``."""
        nxt = j + 1
        sends, recvs, lane_runs, lane_arriving = (
            input_transfer(nxt, routes.lane_out(nxt), routes.lane_in(nxt), home, lanes, nxt) if nxt < nodes else NO_TRANSFER)
        return ring.inter.post_between(sends, recvs, recorder, j * per_node), lane_runs, lane_arriving

    next_lane = post_lane(0)
    yield
    for j in range(nodes):
        lane_requests, lane_runs, lane_arriving = next_lane if j == 0 else post_lane(j)
        visiting = lane
        for i in range(per_node):
            step = j * per_node + i
            sends, recvs, runs, arriving = (
                input_transfer(i + 1, routes.intra_out(j, i + 1), routes.intra_in(j, i + 1), lane, arrivals, step + 1)
                if i + 1 < per_node else NO_TRANSFER)
            requests = ring.intra.post_between(sends, recvs, recorder, step)
            attend_forward(q_BHSD, visiting, ring.seq_rank(-j, -i), acc, ring, layout, mask, scale, data, recorder,
                           step)
            wait(requests)
            visiting = arrivals.unpack(step + 1, runs, arriving) if arriving is not None else None
        wait(lane_requests)
        lane = lanes.unpack(j + 1, lane_runs, lane_arriving) if lane_arriving is not None else None
    yield
    return acc.result(q_BHSD.dtype)


def _backward_routes(plan: BackwardPlan, ring: TwoLevelRing, layout: str, mask: MaskSpec, local_len: int,
                     data: MaskData) -> DoubleRingRoutes:
    return DoubleRingRoutes(ring, _rows_between(plan.queries_travel, layout, mask, local_len, ring, data, any_pair=True))


def _lane_first_transfer(routes: DoubleRingRoutes, ring: TwoLevelRing, like: list, recorder: CallRecorder
                         ) -> FirstTransfer:
    """Lane 1's transfer over the inter-node link (posted during outer step 0, counted at its step 0)."""
    return FirstTransfer(ring.inter, 1, routes.lane_out(1), routes.lane_in(1), _Arrivals(like), 1, 0, recorder)


def lane_first_transfer(plan: BackwardPlan, ring: TwoLevelRing, layout: str, mask: MaskSpec, local_len: int,
                        data: MaskData, like: list, recorder: CallRecorder) -> FirstTransfer:
    """A double-ring backward's first transfer, the first lane's (:func:`burstc.ops.ring_loops.first_backward_transfer`)."""
    return _lane_first_transfer(_backward_routes(plan, ring, layout, mask, local_len, data), ring, like, recorder)


def double_ring_backward_loop(plan: BackwardPlan, grad_out, q, k, v, out, lse, delta, ring: TwoLevelRing,
                              layout: str, mask: MaskSpec, scale: float, recorder: CallRecorder,
                              data: MaskData, first: FirstTransfer | None = None) -> GroupLoop:
    """:func:`burstc.ops.ring_loops._backward_loop` on the double ring (three parts, the first posting the first
    lane's transfer, or the rest of it where ``first`` was partly posted ahead of the call): ``(dq, dk, dv)`` in
    the inputs' dtypes."""
    nodes, per_node, size = ring.nodes, ring.per_node, ring.size
    local_len = q.shape[2]
    grads, home_travelling, home = backward_sides(plan, grad_out, q, k, v, lse, delta)
    own_grads = [grads[i] for i in plan.travelling_grads]
    routes = _backward_routes(plan, ring, layout, mask, local_len, data)
    if first is None:
        first = _lane_first_transfer(routes, ring, home_travelling, recorder)
    lanes, arrivals = first.arrivals, _Arrivals(home_travelling)
    lane = home_travelling
    lane_grads = {0: own_grads}  # lane index -> its travelling side's gradients accumulated on this rank
    previous = None  # (lane, inner step, partial gradients) of the last compute step

    def intra_return(prev):
        """The intra-node return of ``prev``'s partial to its lane holder (node-mate local - inner)."""
        if prev is None or prev[1] == 0:
            return [], [], ((), None)
        lane_of, inner, partial = prev
        return return_transfer(-inner, routes.intra_in(lane_of, inner), partial, routes.intra_out(lane_of, inner), own_grads)

    def inter_return(lane_of: int):
        """Lane ``lane_of``'s gradients home over the inter-node link; this rank's own rows' from node + ``lane_of``."""
        return return_transfer(-lane_of, routes.lane_in(lane_of), lane_grads.pop(lane_of), routes.lane_out(lane_of),
                        own_grads)

    def post_lane(j: int):
        """Post lane ``j + 1``'s transfer (during outer step ``j >= 1``): ``(requests, runs, arriving)``."""
        nxt = j + 1
        lane_sends, lane_recvs, lane_runs, lane_arriving = (
            input_transfer(nxt, routes.lane_out(nxt), routes.lane_in(nxt), home_travelling, lanes, nxt)
            if nxt < nodes else NO_TRANSFER)
        return ring.inter.post_between(lane_sends, lane_recvs, recorder, j * per_node), lane_runs, lane_arriving

    first.post_rest(home_travelling)
    next_lane = first, first.in_runs, first.arriving
    yield
    for j in range(nodes):
        nxt = j + 1
        lane_requests, lane_runs, lane_arriving = next_lane if j == 0 else post_lane(j)
        inter_requests = [lane_requests]
        inter_returned = ((), None)
        travelling = lane
        for i in range(per_node):
            step = j * per_node + i
            visitor = ring.seq_rank(-j, -i)
            q_owner, kv_owner = (visitor, ring.rank) if plan.queries_travel else (ring.rank, visitor)
            sends, recvs, runs, arriving = (
                input_transfer(i + 1, routes.intra_out(j, i + 1), routes.intra_in(j, i + 1), lane, arrivals, step + 1)
                if i + 1 < per_node else NO_TRANSFER)
            back_sends, back_recvs, returned = intra_return(previous)
            requests = ring.intra.post_between(sends + back_sends, recvs + back_recvs, recorder, step)
            if i == 1 and j >= 2:  # lane j - 1's gradients are complete since the last step's wait
                back_sends, back_recvs, inter_returned = inter_return(j - 1)
                inter_requests.append(ring.inter.post_between(back_sends, back_recvs, recorder, step))
            if i == 0:
                if j > 0:
                    lane_grads[j] = fp32_zeros_like(own_grads) if lane is not None else None
                partial = lane_grads[j]
            else:
                partial = fp32_zeros_like(own_grads) if travelling is not None else None
            attend_backward(plan, travelling, home, q_owner, kv_owner, out, grads, partial, ring, layout, mask,
                            scale, data, recorder, step)
            wait(requests)
            if previous is not None and previous[1] > 0:
                _add_returned_(returned, lane_grads[previous[0]])
            previous = (j, i, partial)
            travelling = arrivals.unpack(step + 1, runs, arriving) if arriving is not None else None
        for posted in inter_requests:
            _wait(posted)
        _add_returned_(inter_returned, own_grads)
        lane = lanes.unpack(nxt, lane_runs, lane_arriving) if lane_arriving is not None else None
    # the last intra-node return, then the last lanes' gradients home (lane N - 1, and lane N - 2 when its
    # regular slot, the second step of outer step N - 1, did not exist: G = 1 is never a double ring)
    back_sends, back_recvs, returned = intra_return(previous)
    wait(ring.intra.post_between(back_sends, back_recvs, recorder, size))
    _add_returned_(returned, lane_grads[previous[0]])
    back_sends, back_recvs, returned = inter_return(nodes - 1)  # a double ring has at least 2 nodes
    last_hop = ring.inter.post_between(back_sends, back_recvs, recorder, size + 1)
    yield
    wait(last_hop)
    _add_returned_(returned, own_grads)
    return grads[_DQ].to(q.dtype), grads[_DK].to(k.dtype), grads[_DV].to(v.dtype)
