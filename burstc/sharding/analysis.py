"""The shard analysis: one walk over a Dynamo graph that gives every node a placement and collects
the rewrites the shard pass will make (the :class:`Plan`), or refuses the graph with a coded reason.

The per-op knowledge lives in :mod:`burstc.sharding.rules`; this module dispatches to it and checks
what no single op decides: submodule calls, values combined with the loss, the graph's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from burstc.passes.graph_utils import ancestors, is_function, mutated_values, op_name, placeholder_kind, val
from burstc.refusals import Refused
from burstc.sharding.codes import CODES
from burstc.sharding.dispatch_rules import DISPATCH_RULES
from burstc.sharding.placements import DISPATCH_PLACEMENTS, REPLICATE, MergedRows, Permuted, Placement, Shard, \
    factors, is_sharded
from burstc.sharding.rules import MERGED_RULES, REPLICATED_RULES, SHARDED_RULES


@dataclass
class Plan:
    placement: dict = field(default_factory=dict)        # node -> Placement
    shard_inputs: dict = field(default_factory=dict)     # node -> {input node: dim}
    new_args: dict = field(default_factory=dict)         # node -> (args, kwargs)
    attention: list = field(default_factory=list)        # SDPA nodes to become ring attention
    losses: list = field(default_factory=list)           # fused loss nodes and plain cross_entropy nodes
    merged_rows: dict = field(default_factory=dict)      # plain cross_entropy node -> batch rows merged in ([B, V, S] logits: None)
    outputs_to_gather: list = field(default_factory=list)
    # sums over every token (a load-balancing loss's counts and mean probabilities): this rank's part, summed over
    # the ranks right after (forward all-reduce, identity backward: each rank's tokens get their own gradient)
    sums_over_ranks: list = field(default_factory=list)
    # such a sum while the layout pads the sequence: node -> (argument index or name, its rows placement, fill): the
    # rewrite puts ``fill`` at the pads' rows of that argument first (0 for a sum, below the range for histc)
    pads_masked: dict = field(default_factory=dict)
    # a mean over every token: node -> the whole (unsharded) count of the values it averages; the rewrite makes it
    # a sum over the ranks (above) divided by that count
    means_over_ranks: dict = field(default_factory=dict)
    # sums over the ranks whose value flows into sharded values: their gradient arrives in parts, one per rank, and
    # the backward sums it over the ranks (the others' gradient is whole on every rank: identity backward)
    sums_with_partial_gradient: set = field(default_factory=set)


def find_sequence_length(gm: fx.GraphModule) -> int:
    """The S of the token-index inputs ([B, S] integer placeholders); they must agree.  A symbolic S (a
    graph compiled with dynamic shapes) comes back as the ``torch.SymInt``."""
    lengths = {}  # keyed by str: a SymInt does not hash
    for node in gm.graph.nodes:
        if node.op != "placeholder" or placeholder_kind(node) != "input":
            continue
        v = val(node)
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dim() >= 1:
            lengths.setdefault(str(v.shape[-1]), v.shape[-1])
    if not lengths:
        raise ValueError("no token-index input (an integer [B, S] tensor) found")
    if len(lengths) > 1:
        raise ValueError(f"token-index inputs disagree on the sequence length: {sorted(lengths)}")
    return next(iter(lengths.values()))


class Analyzer:
    """Places every node of ``gm`` for sequence length ``seq_len`` on ``world_size`` ranks (``padded_len``
    when S is padded to a multiple the layout needs); :meth:`run` returns the :class:`Plan` or raises
    :class:`~burstc.refusals.Refused`.  Needs no process group."""

    def __init__(self, gm, seq_len, world_size, config, padded_len=None):
        self.gm, self.S, self.P, self.config = gm, seq_len, world_size, config
        self.padded_len = padded_len or seq_len
        self.s = self.padded_len // world_size
        self.plan = Plan()
        self.output_problem: Refused | None = None  # an output the rewrite cannot return correctly
        self.loss_derived = set()
        self.mutated = mutated_values(gm.graph)
        self.current = None  # the node being analyzed (named if the analysis fails)
        self.attention_matches = {}  # SDPA node -> AttentionMatch (detect_attention's facts)
        self.skip_nodes = set()  # insides of manual attentions the rewrite replaces whole (dead afterwards)

    # -- what the rules ask ----------------------------------------------------------------------
    def place(self, a) -> Placement:
        return self.plan.placement.get(a, REPLICATE) if isinstance(a, fx.Node) else REPLICATE

    def shard_input(self, node, inp, dim):
        """Have the rewrite shard replicated ``inp`` along ``dim`` where ``node`` reads it; ``dim = (d, outer,
        inner)``: ``inp``'s dim d holds merged (batch, token, slot) rows (an HF mask flattened with the tokens)."""
        if inp in self.mutated:
            # shard_seq copies the value where it is made, before the write
            raise Refused(CODES.inplace_write,
                          f"`{inp.name}` is modified in place and would be sharded before the write", node)
        self.plan.shard_inputs.setdefault(node, {})[inp] = dim

    def seq_dims(self, v):
        return [i for i, n in enumerate(v.shape) if n == self.S] if isinstance(v, torch.Tensor) else []

    def position_like(self, node) -> bool:
        """An integer value that comes from the token inputs or from ``arange(S)``: positions, not
        some other index tensor that happens to have S elements along a dim."""
        for a in ancestors(node):
            if a.op == "placeholder" and placeholder_kind(a) == "input":
                return True
            if is_function(a, torch.arange) and isinstance(val(a), torch.Tensor) and val(a).numel() == self.S:
                return True
        return False

    def tensor_args(self, node):
        def tensor_like(v):
            return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
                isinstance(x, torch.Tensor) for x in v))
        return [a for a in node.all_input_nodes if tensor_like(val(a))]

    def local_shape(self, out_val, placement: Shard | MergedRows | Permuted):
        """``out_val``'s shape on one rank: the sequence dim holds ``s`` tokens (per merged batch row, times the
        slots per token)."""
        shape = list(out_val.shape)
        rows = placement.rows if isinstance(placement, Permuted) else placement
        outer, inner = factors(rows)
        shape[rows.dim] = outer * self.s * inner
        return shape

    # -- the walk --------------------------------------------------------------------------------
    def visit(self, node) -> Placement:
        """The first matching rule of the table for ``node``'s input placements decides."""
        placements = [self.place(a) for a in self.tensor_args(node)]
        if node in self.attention_matches:
            # an attention replaced whole (FlexAttention's output, a manual attention left as written): its
            # operands are the match's q/k/v, not the node's arguments (the skipped insides)
            table = SHARDED_RULES
        elif any(isinstance(p, DISPATCH_PLACEMENTS) for p in placements):
            table = DISPATCH_RULES
        elif any(isinstance(p, MergedRows) for p in placements):
            table = MERGED_RULES
        elif any(is_sharded(p) for p in placements):
            table = SHARDED_RULES
        else:
            table = REPLICATED_RULES
        for rule in table:
            if rule.matches(self, node):
                return rule(self, node)
        if table is REPLICATED_RULES:
            return REPLICATE
        if table is MERGED_RULES:
            raise Refused(CODES.merged_rows, f"`{op_name(node)}` on merged batch and sequence rows is not supported "
                                             "by the shard pass", node)
        raise Refused(CODES.unsupported_op, f"op `{op_name(node)}` on a sharded value is not supported by the "
                                            "shard pass", node)

    def run(self) -> Plan:
        for node in self.gm.graph.nodes:
            self.current = node
            if node in self.skip_nodes:
                continue
            if node.op == "placeholder" or node.op == "get_attr":
                self.plan.placement[node] = REPLICATE
            elif node.op in ("call_function", "call_method"):
                self.plan.placement[node] = self.visit(node)
                self.check_loss_terms(node)
            elif node.op == "call_module":
                if any(is_sharded(self.place(a)) for a in node.all_input_nodes):
                    raise Refused(CODES.unsupported_op, f"submodule call `{node.target}` on a sharded value", node)
                self.plan.placement[node] = REPLICATE
            elif node.op == "output":
                self.visit_output(node)
        for node in self.plan.sums_over_ranks:
            self.classify_sum_gradient(node)
        return self.plan

    def classify_sum_gradient(self, node):
        """How the gradient reaches a sum over the ranks.  Replicated when every path from it to the output runs
        through replicated values only (a load-balancing loss added to the loss): every rank has all of it, the
        all-reduce's backward is the identity.  Partial when every path passes a sharded value (``h +
        h.mean(1)``: each rank's tokens give their part): the backward sums it over the ranks too.  Both: refused
        (one all-reduce cannot do both)."""
        v = val(node)
        if not (isinstance(v, torch.Tensor) and v.requires_grad):
            return  # counts: no gradient to route
        replicated = partial = False
        seen, todo = set(), list(node.users)
        while todo:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                replicated = True
            elif is_sharded(self.place(user)):
                partial = True  # the rest of this path is the sharded values' (gradients arrive per rank)
            else:
                todo.extend(user.users)
        if replicated and partial:
            raise Refused(CODES.reduces_sequence,
                          f"the sum over the sequence `{node.name}` reaches the loss both through replicated and "
                          "through sharded values (its gradient would be part per rank and whole at once)", node)
        if partial:
            self.plan.sums_with_partial_gradient.add(node)

    def check_loss_terms(self, node):
        """A replicated value that needs gradients combined with the (all-reduced) loss, e.g. a
        regularizer ``loss + c * w.pow(2).sum()``: every rank would add its full gradient and the
        parameter-gradient all-reduce would count it P times.  Refuse."""
        if node in self.plan.losses or node in self.plan.sums_over_ranks:
            self.loss_derived.add(node)
            return
        if not any(a in self.loss_derived for a in node.all_input_nodes):
            return
        if is_sharded(self.place(node)):
            return  # a sum over the ranks added into the tokens: each rank's part again, gradients in parts too
        self.loss_derived.add(node)
        for a in node.all_input_nodes:
            v = val(a)
            if a not in self.loss_derived and not is_sharded(self.place(a)) and isinstance(v, torch.Tensor) \
                    and v.requires_grad:
                raise Refused(CODES.replicated_gradients,
                              f"`{a.name}` (replicated, needs gradients) is combined with the loss; its "
                              "gradient would be counted once per rank", node)

    def visit_output(self, node):
        for i, out in enumerate(node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]):
            if not isinstance(out, fx.Node):
                continue
            p = self.place(out)
            if isinstance(p, DISPATCH_PLACEMENTS):
                self.output_problem = Refused(CODES.unsupported_op, f"output `{out.name}` is in this rank's own "
                                                                    f"order or numbering ({p})", out)
            elif isinstance(p, (Shard, MergedRows)):
                self.plan.outputs_to_gather.append((i, out))
            elif isinstance(val(out), torch.Tensor) and val(out).requires_grad and not self._depends_on_loss(out):
                self.output_problem = Refused(CODES.replicated_gradients,
                                              f"output `{out.name}` is computed by replicated ops only from "
                                              "values that need gradients (they would be counted once per rank)",
                                              out)

    def _depends_on_loss(self, node):
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.plan.losses or n in self.plan.sums_over_ranks:
                return True
            stack.extend(n.all_input_nodes)
        return False
