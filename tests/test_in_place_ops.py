"""In-place ops in unmodified models: Dynamo records ``x.scatter_(...)``, ``x[i] = v``, ``x.mul_(c)`` with
their results unused (later readers name ``x``). No pass may drop such a write or read ``x`` from before
it: the result must equal eager, with the rewrite refused (and the reason reported) where needed."""
import pytest
import torch

import burstc
from burstc.passes.graph_utils import eliminate_dead_code, in_place_writes, is_mutating
from burstc.testing import assert_equivalent, zoo
from burstc.testing.graphs import dynamo_graph

pytestmark = pytest.mark.multirank


def _rewrites(results):
    return [k for k, _ in results[0]["rewrites"]]


@pytest.mark.parametrize("world_size", [1, 2])
def test_unused_scatter_result_is_kept(workers, world_size):
    # FX's own dead-code elimination drops `gate.scatter_(...)`: the fused loss then saw an all-zero gate
    results = assert_equivalent(zoo.InPlaceScatter, zoo.single_sequence_inputs, zoo.call_with_loss,
                                world_size=world_size, group=workers.get(world_size), backend="aot_eager",
                                expect_sharded=False)
    assert "lm_head_loss" in _rewrites(results)


def _refused_in_place(workers, model_fn, world_size, kind):
    """Equal to eager, with exactly one ``kind`` refusal: the in-place write (``kind.in_place_write`` /
    ``shard.inplace_write``)."""
    results = assert_equivalent(model_fn, zoo.single_sequence_inputs, zoo.call_with_loss, world_size=world_size,
                                group=workers.get(world_size), backend="aot_eager", expect_sharded=False)
    assert kind not in _rewrites(results)
    codes = [c for c in results[0]["skip_codes"] if c.startswith(kind + ".")]
    assert codes in ([f"{kind}.in_place_write"], [f"{kind}.inplace_write"]), results[0]["skipped"]


def test_logits_modified_in_place_are_not_fused(workers):
    _refused_in_place(workers, zoo.InPlaceLogits, 1, "lm_head_loss")


def test_mask_modified_in_place_is_not_folded_as_causal(workers):
    # the tril mask is edited in place: folding it from its ancestors would call it causal
    results = assert_equivalent(zoo.InPlaceMask, zoo.single_sequence_inputs, zoo.call_with_loss,
                                world_size=2, group=workers.get(2), backend="aot_eager", expect_sharded=False)
    assert "shard" not in _rewrites(results) and "attention" not in _rewrites(results)
    assert "shard.attention_mask" in results[0]["skip_codes"], results[0]["skipped"]


def test_positions_modified_in_place_are_not_sharded_stale(workers):
    _refused_in_place(workers, zoo.InPlacePositions, 2, "shard")


_dynamo_graph = dynamo_graph


def test_in_place_ops_are_recognized():
    def f(x, i):
        y = x.clone()
        y.scatter_(0, i, 1.0)
        z = torch.zeros_like(x)
        z[0] = 2.0
        w = y.view(-1)
        w.mul_(2.0)
        torch.relu_(z)
        return x + y.sum() + z.sum()

    gm = _dynamo_graph(f, torch.randn(4), torch.tensor([1]))
    described = [n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
                 for n in gm.graph.nodes if is_mutating(n)]
    assert described == ["scatter_", "setitem", "mul_", "relu_"], described
    writes = {op.target if op.op == "call_method" else op.target.__name__: aliases
              for op, aliases in in_place_writes(gm.graph)}
    clone = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "clone")
    assert clone in writes["mul_"]  # a write through a view reaches its base
    eliminate_dead_code(gm.graph)
    assert sum(is_mutating(n) for n in gm.graph.nodes) == 4  # none dropped
    gm.graph.eliminate_dead_code()  # FX's own drops the unused ones: the bug this guards against
    assert sum(is_mutating(n) for n in gm.graph.nodes) < 4


def test_writes_into_values_nothing_reads_are_dead_code():
    def f(x):
        scratch = x.clone()   # written in place, then never read: dead with its writes
        scratch.add_(1.0)
        scratch[0] = 3.0
        kept = x.clone()      # written in place and read: kept
        kept.mul_(2.0)
        return x + kept

    gm = _dynamo_graph(f, torch.randn(4))
    eliminate_dead_code(gm.graph)
    gm.recompile()
    remaining = [n.target for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    assert remaining.count("clone") == 1 and "mul_" in remaining and "add_" not in remaining, remaining
    x = torch.randn(4)
    torch.testing.assert_close(gm(x)[0], f(x))
