"""Sequence-parallel lowering: each rank runs the model on its S/P tokens.

The graph's inputs are the full batch, the same on every rank.  Token-index tensors (ids, labels,
positions) stay **replicated** (R): they are small, and ops that mix positions on them (HF's
pad-and-shift of the labels, ``arange``) stay exact.  A value is **sharded** (``Shard(d)``: this
rank's tokens, in the chosen layout, along dim d) from the first op that turns indices into
activations:

- ``embedding(ids)`` and ``ids.float()`` shard their index input first (``burstc::shard_seq``);
- a position-wise op that meets a sharded operand and a replicated one whose aligned dim has the
  full length S (RoPE tables, ``freqs_cis[:S]``) shards the replicated one there.

Position-wise ops (pointwise, linear, norms over the hidden dims, reshapes that keep the sequence
dim whole, transposes, splits, cats along other dims, RoPE) then run on local tokens; shape
constants that name S are rewritten to S/P.  Causal SDPA becomes ``burstc::ring_attention_forward``
with the planner's backward plan.  The fused LM-head loss takes this rank's targets and the
**global** count of non-ignored tokens (computed on the replicated labels, so no extra
communication), and its partial loss is summed over the mesh by an all-reduce whose backward is
the identity.  Parameter gradients are summed over the mesh in the backward (``reduce_grads``).

Anything the pass does not understand along the sequence axis (an op that mixes positions, a
slice of the sequence, an attention mask, a sharded value it cannot place) makes it refuse the
whole graph with the reason, and the graph runs unsharded: never a wrong result.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

import burstc.ops.ring_attention  # noqa: F401  (registers burstc::ring_attention_forward/backward)
from burstc.layout import required_multiple
from burstc.ops.linear_cross_entropy import linear_cross_entropy
from burstc.passes import module_path
from burstc.ops.sequence import gather_seq, grad_all_reduce, loss_all_reduce, shard_seq
from burstc.passes.detect_attention import SDPA, sdpa_kwargs
from burstc.passes.graph_utils import const_number, eliminate_dead_code, fake_mode_of, is_function, is_method, \
    is_mutating, mutated_values, normalized_kwargs, op_name, placeholder_kind, prod, val

KIND = "shard"
R = None  # replicated placement

_POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.neg,
    operator.pow, operator.and_, operator.or_, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.invert, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.tanh, torch.sigmoid,
    torch.rsqrt, torch.sqrt, torch.sin, torch.cos, torch.where, torch.pow, torch.abs, torch.clamp, torch.erf,
    torch.square, torch.reciprocal, torch.maximum, torch.minimum, torch.relu,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus, F.leaky_relu, F.mish, F.elu,
    torch.expm1, torch.log1p, torch.polar, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.erfc,
    torch.atan, torch.atan2, torch.log2, torch.exp2, torch.sinh, torch.cosh, torch.logical_not, torch.logical_and,
    torch.logical_or, torch.isnan, torch.isinf, torch.nan_to_num, torch.lerp, torch.addcmul, torch.addcdiv,
    torch.clip, torch.fmod, torch.remainder, torch.true_divide,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.selu, F.celu, F.logsigmoid, F.softsign, F.relu6,
}
_POINTWISE_METHODS = {
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach", "sin", "cos",
    "exp", "log", "pow", "neg", "sigmoid", "tanh", "rsqrt", "sqrt", "masked_fill", "add", "mul", "sub", "div",
    "abs", "clamp", "relu", "square", "reciprocal", "__mul__", "__add__", "__sub__", "__truediv__", "float_power",
    "expm1", "log1p", "sign", "floor", "ceil", "round", "trunc", "erf", "clip", "lerp", "addcmul", "nan_to_num",
    "logical_not", "isnan", "where", "minimum", "maximum", "__neg__", "__rsub__", "__radd__", "__rmul__",
    "__rtruediv__",
}
_UNARY_FIRST_ARG_METHODS = {"to", "type", "type_as"}  # other args are dtype/device sources
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "norm", "logsumexp", "prod"}
_NO_TENSOR_SIDE_EFFECT = {"_log_api_usage_once"}


class _Refuse(Exception):
    def __init__(self, node: fx.Node, reason: str):
        super().__init__(reason)
        self.node = node


@dataclass(frozen=True)
class Merged:
    """Placement of a dim that flattens (batch dims..., sequence) row-major, the sequence innermost (e.g.
    HF's ``logits.view(-1, V)`` or GPT-2's ``x.view(-1, H)`` at batch > 1): ``outer`` batch rows of this
    rank's tokens each, i.e. local extent ``outer * s`` in (batch, local token) order."""
    dim: int
    outer: int


@dataclass
class _Plan:
    placement: dict = field(default_factory=dict)        # node -> dim | None | list (tuples)
    shard_inputs: dict = field(default_factory=dict)     # node -> {input node: dim}
    new_args: dict = field(default_factory=dict)         # node -> (args, kwargs)
    attention: list = field(default_factory=list)        # SDPA nodes to become ring attention
    losses: list = field(default_factory=list)           # fused loss nodes and plain cross_entropy nodes
    merged_rows: dict = field(default_factory=dict)      # plain cross_entropy node -> batch rows merged in
    outputs_to_gather: list = field(default_factory=list)


def _norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else d


def find_sequence_length(gm: fx.GraphModule) -> int:
    """The S of the token-index inputs ([B, S] integer placeholders); they must agree."""
    lengths = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder" or placeholder_kind(node) != "input":
            continue
        v = val(node)
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dim() >= 1:
            lengths.add(v.shape[-1])
    if not lengths:
        raise ValueError("no token-index input (an integer [B, S] tensor) found")
    if len(lengths) > 1:
        raise ValueError(f"token-index inputs disagree on the sequence length: {sorted(lengths)}")
    return lengths.pop()


class _Analyzer:
    def __init__(self, gm, seq_len, world_size, config, padded_len=None):
        self.gm, self.S, self.P, self.config = gm, seq_len, world_size, config
        self.padded_len = padded_len or seq_len
        self.s = self.padded_len // world_size
        self.plan = _Plan()
        self.output_problem = None
        self.loss_derived = set()
        self.mutated = mutated_values(gm.graph)
        self.current = None  # the node being analyzed (named if the analysis fails)

    # -- helpers -------------------------------------------------------------------------------
    def place(self, a):
        return self.plan.placement.get(a, R) if isinstance(a, fx.Node) else R

    def refuse(self, node, reason):
        raise _Refuse(node, reason)

    def shard_input(self, node, inp, dim):
        if inp in self.mutated:
            # shard_seq copies the value where it is made, before the write
            self.refuse(node, f"`{inp.name}` is modified in place and would be sharded before the write")
        self.plan.shard_inputs.setdefault(node, {})[inp] = dim

    def seq_dims(self, v):
        return [i for i, n in enumerate(v.shape) if n == self.S] if isinstance(v, torch.Tensor) else []

    def position_like(self, node) -> bool:
        """An integer value that comes from the token inputs or from ``arange(S)``: positions, not
        some other index tensor that happens to have S elements along a dim."""
        from burstc.passes.graph_utils import ancestors

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

    # -- op rules --------------------------------------------------------------------------------
    def pointwise(self, node, operands):
        n = val(node).dim()
        placements = set()
        for a in operands:
            p, shift = self.place(a), n - val(a).dim()
            if p is not R:
                placements.add(Merged(p.dim + shift, p.outer) if isinstance(p, Merged) else p + shift)
        if not placements:
            return R
        if len(placements) > 1:
            self.refuse(node, "operands sharded along different dims")
        out = placements.pop()
        out_dim = out.dim if isinstance(out, Merged) else out
        for a in operands:
            if self.place(a) is not R:
                continue
            k = val(a).dim()
            aligned = out_dim - (n - k)
            if 0 <= aligned < k and val(a).shape[aligned] == self.S and not isinstance(out, Merged):
                self.shard_input(node, a, aligned)
            elif 0 <= aligned < k and val(a).shape[aligned] != 1:
                self.refuse(node, f"replicated operand `{a.name}` does not line up with the sequence")
        return out

    def positionwise(self, node, x, placement):
        """Dropout, linear and norms, which act on each token alone: ``placement`` (sharded along an int dim
        or as merged rows) passes through when the op leaves the sequence dim alone; None if not one of them."""
        args, kwargs = node.args, node.kwargs
        seq_dim = placement.dim if isinstance(placement, Merged) else placement
        if is_function(node, F.dropout):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                self.refuse(node, "dropout > 0 in training (random masks can't match one device)")
            return placement
        if is_function(node, F.linear, torch._C._nn.linear):
            if seq_dim == val(x).dim() - 1:
                self.refuse(node, "linear over the sequence dim")
            return placement
        if node.op == "call_function" and getattr(node.target, "__name__", "") in ("layer_norm", "rms_norm"):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            n_norm = len(shape) if isinstance(shape, (list, tuple)) else 1
            if seq_dim >= val(x).dim() - n_norm:
                self.refuse(node, "normalization over the sequence dim")
            return placement
        return None

    def reshape_dim(self, node, x, out_val):
        d = self.place(x)
        in_shape, out_shape = list(val(x).shape), list(out_val.shape)
        prefix = prod(in_shape[:d])
        for j in range(len(out_shape)):
            if out_shape[j] == self.S and prod(out_shape[:j]) == prefix:
                return j
        # batch dims merged into the sequence dim, the sequence innermost: [B, S, H] -> [B * S, H]
        for k in range(d):
            outer = prod(in_shape[k:d])
            for j in range(len(out_shape)):
                if outer > 1 and out_shape[j] == outer * self.S and prod(out_shape[:j]) == prod(in_shape[:k]):
                    return Merged(j, outer)
        self.refuse(node, f"`{op_name(node)}` merges or splits the sequence dim ({in_shape} -> {out_shape})")

    def reshape_merged(self, node, x, out_val, m: Merged):
        """A reshape of a merged value: back to separate (batch..., sequence) dims, or still merged."""
        in_shape, out_shape = list(val(x).shape), list(out_val.shape)
        prefix = prod(in_shape[:m.dim])
        for j in range(len(out_shape)):
            if out_shape[j] == self.S and prod(out_shape[:j]) == prefix * m.outer and any(
                    prod(out_shape[:k]) == prefix and prod(out_shape[k:j]) == m.outer for k in range(j + 1)):
                return j
            if out_shape[j] == m.outer * self.S and prod(out_shape[:j]) == prefix:
                return Merged(j, m.outer)
        self.refuse(node, f"`{op_name(node)}` reshapes merged batch and sequence dims ({in_shape} -> {out_shape})")

    def local_shape(self, out_val, dim):
        shape = list(out_val.shape)
        if isinstance(dim, Merged):
            shape[dim.dim] = dim.outer * self.s
        else:
            shape[dim] = self.s
        return shape

    def index_dims(self, node, x, index):
        """Map the sequence dim through ``x[index]``; returns the output dim."""
        d = self.place(x)
        items = list(index) if isinstance(index, tuple) else [index]
        ndim = val(x).dim()
        if any(isinstance(i, fx.Node) for i in items):
            self.refuse(node, "tensor indexing of a sharded value")
        n_consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
        expanded = []
        for i in items:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (ndim - n_consuming))
            else:
                expanded.append(i)
        expanded.extend([slice(None)] * (ndim - sum(1 for i in expanded if i is not None)))
        in_dim, out_dim, new_items, result = 0, 0, [], None
        for i in expanded:
            if i is None:
                out_dim += 1
                new_items.append(None)
                continue
            if in_dim == d:
                full = isinstance(i, slice) and i.step in (None, 1) and (i.start in (None, 0)) \
                    and (i.stop is None or i.stop >= self.S)
                if not full:
                    self.refuse(node, "slices or indexes the sequence dim")
                result = out_dim
                new_items.append(slice(None))
            else:
                new_items.append(i)
            if not isinstance(i, int):
                out_dim += 1
            in_dim += 1
        return result, tuple(new_items) if isinstance(index, tuple) else new_items[0]

    def visit(self, node):
        v = val(node)
        ins = self.tensor_args(node)
        sharded_ins = [a for a in ins if self.place(a) is not R]
        target, args, kwargs = node.target, node.args, node.kwargs

        if node.op == "call_function" and getattr(target, "__name__", "") in _NO_TENSOR_SIDE_EFFECT:
            return R
        if any(isinstance(self.place(a), Merged) for a in ins):
            return self.visit_merged(node, ins)
        if sharded_ins and is_mutating(node):
            written = args[0] if args else None
            if not isinstance(written, fx.Node) or self.place(written) is R:
                # the write would land in a sharded copy while later readers see the replicated original
                self.refuse(node, f"in-place `{op_name(node)}` writes sharded values into a replicated tensor")
        # the fused LM-head loss
        if is_function(node, linear_cross_entropy):
            return self.visit_loss(node)
        if is_function(node, F.cross_entropy) and sharded_ins:
            return self.visit_cross_entropy(node)
        if is_function(node, SDPA):
            return self.visit_attention(node) if sharded_ins else R
        # index -> activation: embedding and float conversion of replicated indices
        if is_function(node, F.embedding, torch.embedding):
            ids = args[0] if target is F.embedding else args[1]
            if self.place(ids) is R:
                dims = self.seq_dims(val(ids))
                if not dims:
                    return R
                self.shard_input(node, ids, dims[-1])
                return dims[-1]
            return self.place(ids)
        if not sharded_ins:
            if (is_method(node, "float", "to", "type_as", "half", "bfloat16") and ins
                    and isinstance(v, torch.Tensor) and v.is_floating_point()
                    and not val(args[0]).is_floating_point() and len(self.seq_dims(val(args[0]))) == 1
                    and self.position_like(args[0])):
                dim = self.seq_dims(val(args[0]))[0]
                self.shard_input(node, args[0], dim)
                return dim
            return R

        # ops with a sharded input
        x = args[0] if args else None
        d = self.place(x)
        if is_function(node, operator.getitem) and isinstance(d, list):
            return d[args[1]]
        if any(isinstance(self.place(a), list) for a in ins):
            self.refuse(node, f"`{op_name(node)}` takes a tuple of sharded values")
        if is_function(node, operator.getitem):
            out_dim, new_index = self.index_dims(node, x, args[1])
            if new_index != args[1]:
                self.plan.new_args[node] = ((x, new_index), dict(kwargs))
            return out_dim
        if (node.op == "call_function" and target in _POINTWISE_FUNCTIONS) or \
                (node.op == "call_method" and target in _POINTWISE_METHODS):
            if node.op == "call_method" and target in _UNARY_FIRST_ARG_METHODS:
                return d
            return self.pointwise(node, ins)
        if is_function(node, torch.ones_like, torch.zeros_like, torch.full_like, torch.empty_like):
            return d  # a fresh tensor shaped like this rank's tokens
        if is_function(node, torch.min, torch.max) or is_method(node, "min", "max"):
            return self.visit_min_max(node, x, d)
        out = self.positionwise(node, x, d)
        if out is not None:
            return out
        if is_function(node, torch.softmax, F.softmax, torch.log_softmax, F.log_softmax) or \
                is_method(node, "softmax", "log_softmax"):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim is None or _norm_dim(dim, val(x).dim()) == d:
                self.refuse(node, "softmax over the sequence dim")
            return d
        if is_method(node, *_REDUCTIONS) or (node.op == "call_function"
                                              and getattr(target, "__name__", "") in _REDUCTIONS):
            dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if dims is None:
                self.refuse(node, f"`{op_name(node)}` reduces over all dims, including the sequence")
            dims = [_norm_dim(i, val(x).dim()) for i in (dims if isinstance(dims, (list, tuple)) else [dims])]
            if d in dims:
                self.refuse(node, f"`{op_name(node)}` reduces over the sequence dim")
            return d if keepdim else d - sum(1 for i in dims if i < d)
        if is_function(node, operator.matmul, torch.matmul, torch.bmm):
            return self.visit_matmul(node)
        if is_method(node, "transpose") or is_function(node, torch.transpose):
            a, b = (_norm_dim(i, val(x).dim()) for i in args[1:3])
            return b if d == a else a if d == b else d
        if is_method(node, "permute") or is_function(node, torch.permute):
            dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            return [_norm_dim(i, val(x).dim()) for i in dims].index(d)
        if is_method(node, "t"):
            return 1 - d
        if is_method(node, "unsqueeze") or is_function(node, torch.unsqueeze):
            k = _norm_dim(args[1], v.dim())
            return d + 1 if k <= d else d
        if is_method(node, "squeeze") or is_function(node, torch.squeeze):
            return self.reshape_dim(node, x, v)
        if is_method(node, "view") and any(isinstance(a, torch.dtype) for a in args[1:]):
            if v.shape != val(x).shape:
                self.refuse(node, "dtype view that changes the shape of a sharded value")
            return d
        if is_method(node, "view", "reshape", "flatten", "unflatten") or \
                is_function(node, torch.reshape, torch.flatten):
            if any(isinstance(a, fx.Node) for a in args[1:]):
                self.refuse(node, "dynamic reshape of a sharded value")
            out_dim = self.reshape_dim(node, x, v)
            if is_method(node, "view", "reshape") or is_function(node, torch.reshape):
                self.plan.new_args[node] = ((x, tuple(self.local_shape(v, out_dim))), {})
            return out_dim
        if is_function(node, torch.addmm):  # GPT-2's Conv1D: addmm(bias, x_2d, weight)
            if self.place(args[1]) != 0 or self.place(args[2]) is not R or self.place(args[0]) is not R:
                self.refuse(node, "addmm with the sequence outside the rows of its first matrix")
            return 0
        if is_method(node, "repeat_interleave") or is_function(node, torch.repeat_interleave):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
            if dim is None or _norm_dim(dim, val(x).dim()) == d or isinstance(args[1] if len(args) > 1 else None,
                                                                                fx.Node):
                self.refuse(node, "repeat_interleave along (or flattening) the sequence dim")
            return d
        if is_method(node, "broadcast_to") or is_function(node, torch.broadcast_to):
            out_dim = d + v.dim() - val(x).dim()
            self.plan.new_args[node] = ((x, tuple(self.local_shape(v, out_dim))), {})
            return out_dim
        if is_method(node, "expand", "repeat"):
            out_dim = d + v.dim() - val(x).dim()
            if is_method(node, "repeat"):
                reps = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
                if reps[out_dim] != 1:
                    self.refuse(node, "repeat along the sequence dim")
            else:
                self.plan.new_args[node] = ((x, tuple(self.local_shape(v, out_dim))), {})
            return out_dim
        if is_function(node, torch.view_as_complex):
            return d
        if is_function(node, torch.view_as_real):
            return d
        if is_method(node, "split", "chunk", "unbind", "tensor_split") or \
                is_function(node, torch.split, torch.chunk, torch.unbind):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if is_method(node, "unbind") or is_function(node, torch.unbind):
                dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            dim = _norm_dim(dim, val(x).dim())
            if dim == d:
                self.refuse(node, f"`{op_name(node)}` along the sequence dim")
            out_d = d - 1 if (is_method(node, "unbind") or is_function(node, torch.unbind)) and dim < d else d
            return [out_d] * len(v)
        if is_function(node, torch.cat, torch.stack):
            return self.visit_cat(node)
        self.refuse(node, f"op `{op_name(node)}` on a sharded value is not supported by the shard pass")

    def visit_cat(self, node):
        tensors = list(node.args[0])
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        v = val(node)
        nonempty = [t for t in tensors if val(t).numel() > 0]
        placed = [self.place(t) for t in nonempty]
        dims = {p for p in placed if p is not R}
        if len(dims) != 1:
            self.refuse(node, "cat of values sharded along different dims")
        d = dims.pop()
        if node.target is torch.cat and _norm_dim(dim, v.dim()) == d:
            if len(nonempty) == 1:
                return d  # cat with empty tensors only (HF's cache init): pass-through
            self.refuse(node, "cat along the sequence dim")
        out_d = d + (1 if node.target is torch.stack and _norm_dim(dim, v.dim()) <= d else 0)
        for t in nonempty:
            if self.place(t) is R:
                if val(t).shape[d] == self.S:
                    self.shard_input(node, t, d)
                else:
                    self.refuse(node, f"replicated `{t.name}` in a cat with sharded values")
        return out_d

    def visit_matmul(self, node):
        a, b = node.args[:2]
        va, vb, v = val(a), val(b), val(node)
        pa, pb = self.place(a), self.place(b)
        n = v.dim()
        if pa is not R and pa == va.dim() - 1:
            self.refuse(node, "matmul contracts over the sequence dim (attention not recognized?)")
        if pb is not R and vb.dim() >= 2 and pb == vb.dim() - 2:
            self.refuse(node, "matmul contracts over the sequence dim (attention not recognized?)")
        if pa is not R and pb is not R:
            out_a = n - va.dim() + pa
            out_b = n - vb.dim() + pb
            if out_a != out_b or pa >= va.dim() - 2:
                self.refuse(node, "matmul of two sharded values along different dims (attention scores?)")
            return out_a
        if pa is not R:
            out = n - va.dim() + pa
            if pa < va.dim() - 2 and vb.dim() > 2:
                aligned = out - (n - vb.dim())
                if 0 <= aligned < vb.dim() - 2 and vb.shape[aligned] == self.S:
                    self.shard_input(node, b, aligned)
            return out
        out = n - 1 if pb == vb.dim() - 1 else n - vb.dim() + pb
        if pb < vb.dim() - 2 and va.dim() > 2:
            aligned = out - (n - va.dim())
            if 0 <= aligned < va.dim() - 2 and va.shape[aligned] == self.S:
                self.shard_input(node, a, aligned)
        return out

    def visit_attention(self, node):
        kw = sdpa_kwargs(node)
        q, k, v = kw["query"], kw["key"], kw["value"]
        if kw["attn_mask"] is not None:
            reason = node.meta.get("burstc_refuse", "an attention mask")
            self.refuse(node, f"attention with {reason} (masks are not supported by the ring op yet)")
        if kw["dropout_p"]:
            self.refuse(node, "attention dropout > 0")
        for t in (q, k, v):
            if self.place(t) is R:
                self.refuse(node, f"attention operand `{t.name}` is not sharded")
            if self.place(t) != val(t).dim() - 2 or val(t).dim() != 4:
                self.refuse(node, "attention operands are not [B, H, S, D] with the sequence in dim 2")
        self.plan.attention.append(node)
        return 2

    def visit_loss(self, node):
        hidden, weight, target = node.args[:3]
        if self.place(hidden) is R:
            return R
        if self.place(target) is not R:
            self.refuse(node, "loss targets are already sharded")
        d = self.place(hidden)
        if d == val(hidden).dim() - 1:
            self.refuse(node, "hidden states sharded along the hidden dim")
        if tuple(val(target).shape) != tuple(val(hidden).shape[:-1]):
            self.refuse(node, "loss targets do not have the hidden states' token shape")
        self.plan.losses.append(node)
        return R  # the all-reduce inserted after it makes the loss replicated

    def visit_merged(self, node, ins):
        """The few ops that run on merged (batch, sequence) rows: position-wise ones, and reshapes back."""
        v, args, target = val(node), node.args, node.target
        x = args[0] if args else None
        m = self.place(x)
        if is_function(node, F.cross_entropy):
            return self.visit_cross_entropy(node)
        if is_function(node, torch.addmm):  # GPT-2's Conv1D: addmm(bias, x.view(-1, H), weight)
            rows = self.place(args[1])
            if not isinstance(rows, Merged) or rows.dim != 0 or self.place(args[0]) is not R \
                    or self.place(args[2]) is not R:
                self.refuse(node, "addmm with merged batch and sequence rows outside its first matrix's rows")
            return rows
        if not isinstance(m, Merged):
            self.refuse(node, f"`{op_name(node)}` with merged batch and sequence rows in a later operand")
        if (node.op == "call_function" and target in _POINTWISE_FUNCTIONS) or \
                (node.op == "call_method" and target in _POINTWISE_METHODS):
            if node.op == "call_method" and target in _UNARY_FIRST_ARG_METHODS:
                return m
            return self.pointwise(node, ins)
        out = self.positionwise(node, x, m)
        if out is not None:
            return out
        if is_method(node, "view", "reshape") or is_function(node, torch.reshape):
            if any(isinstance(a, fx.Node) for a in args[1:]):
                self.refuse(node, "dynamic reshape of a sharded value")
            out_dim = self.reshape_merged(node, x, v, m)
            self.plan.new_args[node] = ((x, tuple(self.local_shape(v, out_dim))), {})
            return out_dim
        self.refuse(node, f"`{op_name(node)}` on merged batch and sequence rows is not supported by the shard pass")

    def visit_min_max(self, node, x, d):
        """``min/max(a, b)``: pointwise; ``min/max(x, dim)``: (values, indices) reduced over ``dim``."""
        args, kwargs = node.args, node.kwargs
        other = kwargs.get("other", args[1] if len(args) > 1 else None)
        if isinstance(other, fx.Node) and isinstance(val(other), torch.Tensor):
            return self.pointwise(node, self.tensor_args(node))
        dim = kwargs.get("dim", other)
        if not isinstance(dim, int):
            self.refuse(node, f"`{op_name(node)}` reduces over all dims, including the sequence")
        dim = _norm_dim(dim, val(x).dim())
        if dim == d:
            self.refuse(node, f"`{op_name(node)}` reduces over the sequence dim")
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        out = d if keepdim or dim > d else d - 1
        return [out, out]

    def visit_cross_entropy(self, node):
        """``F.cross_entropy`` on sharded logits that the LM-head fusion left alone (e.g. logits scaled
        between the head and the loss, or the fusion switched off): per-token losses on the local rows,
        gathered, then the requested reduction on the full, replicated vector (see :func:`_apply`)."""
        kw = normalized_kwargs(node)
        if kw is None:
            self.refuse(node, "could not normalize the cross_entropy call on sharded logits")
        logits, target = kw["input"], kw["target"]
        if kw.get("weight") is not None:
            self.refuse(node, "cross_entropy with class weights on sharded logits")
        if kw.get("size_average") is not None or kw.get("reduce") is not None:
            self.refuse(node, "cross_entropy with the legacy size_average/reduce arguments")
        if kw.get("reduction", "mean") not in ("mean", "sum", "none"):
            self.refuse(node, f"cross_entropy reduction {kw.get('reduction')!r}")
        if not isinstance(kw.get("ignore_index", -100), int):
            self.refuse(node, "cross_entropy ignore_index is not a constant")
        logits_val, target_val = val(logits), val(target)
        placement = self.place(logits)
        rows = placement.outer if isinstance(placement, Merged) and placement.dim == 0 else 1 if placement == 0 else None
        if logits_val.dim() != 2 or rows is None:
            self.refuse(node, "cross_entropy on sharded logits that are not [tokens, classes] with the "
                              "tokens sharded")
        if self.place(target) is not R:
            self.refuse(node, "cross_entropy targets are already sharded")
        if target_val.dim() != 1 or target_val.shape[0] != rows * self.S or target_val.dtype.is_floating_point:
            self.refuse(node, "cross_entropy targets are not class indices, one per token of the batch")
        self.plan.merged_rows[node] = rows
        self.plan.losses.append(node)
        return R  # the per-token losses are gathered: the loss is replicated

    def run(self):
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder" or node.op == "get_attr":
                self.plan.placement[node] = R
            elif node.op in ("call_function", "call_method"):
                self.plan.placement[node] = self.visit(node)
                self.check_loss_terms(node)
            elif node.op == "call_module":
                if any(self.place(a) is not R for a in node.all_input_nodes):
                    self.refuse(node, f"submodule call `{node.target}` on a sharded value")
                self.plan.placement[node] = R
            elif node.op == "output":
                self.visit_output(node)
        return self.plan

    def check_loss_terms(self, node):
        """A replicated value that needs gradients combined with the (all-reduced) loss, e.g. a
        regularizer ``loss + c * w.pow(2).sum()``: every rank would add its full gradient and the
        parameter-gradient all-reduce would count it P times.  Refuse."""
        if node in self.plan.losses:
            self.loss_derived.add(node)
            return
        if not any(a in self.loss_derived for a in node.all_input_nodes):
            return
        self.loss_derived.add(node)
        for a in node.all_input_nodes:
            v = val(a)
            if a not in self.loss_derived and self.place(a) is R and isinstance(v, torch.Tensor) and v.requires_grad:
                self.refuse(node, f"`{a.name}` (replicated, needs gradients) is combined with the loss; its "
                                  "gradient would be counted once per rank")

    def visit_output(self, node):
        for i, out in enumerate(node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]):
            if not isinstance(out, fx.Node):
                continue
            p = self.place(out)
            if isinstance(p, Merged):
                self.output_problem = (out, f"output `{out.name}` has merged batch and sequence rows "
                                            "(not gathered yet)")
            elif isinstance(p, int):
                self.plan.outputs_to_gather.append((i, out))
            elif isinstance(val(out), torch.Tensor) and val(out).requires_grad and not self._depends_on_loss(out):
                self.output_problem = (out, f"output `{out.name}` is computed by replicated ops only from "
                                            "values that need gradients (they would be counted once per rank)")

    def _depends_on_loss(self, node):
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.plan.losses:
                return True
            stack.extend(n.all_input_nodes)
        return False


def _group_name(context) -> str:
    mesh = context.mesh
    return mesh.get_group().group_name


def _apply(gm, plan: _Plan, analyzer: _Analyzer, config, context, group_name):
    graph = gm.graph
    layout = config.layout
    shard_cache = {}

    padded_len = analyzer.padded_len

    def sharded(inp, dim, pad_value=0.0):
        key = (inp, dim, pad_value)
        if key not in shard_cache:
            with graph.inserting_after(inp):
                shard_cache[key] = graph.call_function(torch.ops.burstc.shard_seq.default,
                                                       (inp, dim, group_name, layout, padded_len, pad_value))
        return shard_cache[key]

    for node, args_kwargs in plan.new_args.items():
        node.args, node.kwargs = args_kwargs
    for node, inputs in plan.shard_inputs.items():
        mapping = {inp: sharded(inp, dim) for inp, dim in inputs.items()}
        node.args = fx.node.map_arg(node.args, lambda a: mapping.get(a, a))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: mapping.get(a, a))

    from burstc.planner import plan_attention

    for node in plan.attention:
        kw = sdpa_kwargs(node)
        q, k, v = kw["query"], kw["key"], kw["value"]
        B, Hq, _, D = val(q).shape
        Hkv = val(k).shape[1]
        scale = kw["scale"] if kw["scale"] is not None else D ** -0.5
        choice = plan_attention(B, analyzer.padded_len, analyzer.P, Hq, Hkv, D, val(q).dtype)
        plan_name = choice.plan if config.attention_plan == "auto" else config.attention_plan
        per_step = choice.predicted_bytes if plan_name == choice.plan else choice.alternative_bytes
        with graph.inserting_before(node):
            ring = graph.call_function(torch.ops.burstc.ring_attention_forward.default,
                                       (q, k, v, [group_name], layout,
                                        (burstc.attention_ir.MaskSpec.causal() if kw["is_causal"]
                                         else burstc.attention_ir.MaskSpec.full()).encode(),
                                        float(scale), plan_name))
            out = graph.call_function(operator.getitem, (ring, 0))
        out.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        context.rewrite("attention", out, {
            "plan": plan_name, "layout": layout, "causal": bool(kw["is_causal"]), "world_size": analyzer.P,
            "heads": f"{Hq}q/{Hkv}kv", "head_dim": D, "local_tokens": analyzer.s,
            "mask": node.meta.get("burstc_mask", "is_causal" if kw["is_causal"] else "none"),
            "kv_heads_on_wire": Hkv, "gqa_note": node.meta.get("burstc_gqa"),
            "predicted_bytes": dict(per_step),
            "planner_choice": choice.plan,
        }, module=module_path(node))

    for node in plan.losses:
        if is_function(node, F.cross_entropy):
            _shard_cross_entropy(graph, node, group_name, layout, padded_len, analyzer.S, plan.merged_rows[node],
                                 analyzer.s)
            continue
        hidden, weight, target = node.args[:3]
        d = analyzer.place(hidden)
        ignore_index = node.kwargs.get("ignore_index", -100)
        with graph.inserting_before(node):
            # the fused-loss pass gave the targets the hidden states' token shape: split them alike
            # padded positions (if any) get ignore_index: they add nothing to the loss or the count
            target_local = graph.call_function(torch.ops.burstc.shard_seq.default,
                                               (target, d, group_name, layout, padded_len, float(ignore_index)))
            normalizer = None
            if node.kwargs.get("reduction", "mean") == "mean":
                valid = graph.call_function(operator.ne, (target, ignore_index))
                count = graph.call_method("sum", (valid,))
                normalizer = graph.call_method("to", (count, torch.float32))
        kwargs = dict(node.kwargs)
        if normalizer is not None:
            kwargs["normalizer"] = normalizer
        node.args = (hidden, weight, target_local) + tuple(node.args[3:])
        node.kwargs = kwargs
        with graph.inserting_after(node):
            if node.kwargs.get("reduction", "mean") == "none":
                # per-token losses (the targets' shape): gathered like a sharded output, exactly-once gradients
                total = graph.call_function(torch.ops.burstc.gather_seq.default,
                                            (node, d, group_name, layout, analyzer.S))
            else:
                total = graph.call_function(loss_all_reduce, (node, group_name))
        node.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total)

    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    gathered = []
    for index, out in plan.outputs_to_gather:
        with graph.inserting_before(output_node):
            full = graph.call_function(torch.ops.burstc.gather_seq.default,
                                       (out, analyzer.place(out), group_name, layout, analyzer.S))
        output_node.args = (tuple(full if (i == index) else o for i, o in enumerate(output_node.args[0])),)
        gathered.append(out.name)

    if config.reduce_grads:
        for node in list(graph.nodes):
            if node.op == "placeholder" and placeholder_kind(node) == "parameter" and val(node) is not None \
                    and val(node).requires_grad and node.users:
                with graph.inserting_after(node):
                    synced = graph.call_function(grad_all_reduce, (node, group_name))
                node.replace_all_uses_with(synced, delete_user_cb=lambda u: u is not synced)
    return gathered


def _shard_cross_entropy(graph: fx.Graph, node: fx.Node, group_name: str, layout: str, padded_len: int,
                         seq_len: int, rows: int, local_len: int) -> None:
    """``cross_entropy(logits_local, targets)`` -> per-token losses of the local rows (this rank's targets,
    padded ones ignored), all-gathered into the full ``[S]`` vector, then reduced as the call asked.

    Exact: the per-token losses are those of one device; the gather's backward hands each rank the
    gradient of its own rows, and the parameter-gradient all-reduce sums the ranks' contributions.
    The mean divides by the count of non-ignored targets, as ``F.cross_entropy`` does (all ignored:
    0 / 0 = nan, like eager).  The gathered vector is S floats: negligible next to the logits.
    """
    kw = normalized_kwargs(node)
    target = kw["target"]
    ignore_index = kw.get("ignore_index", -100)
    reduction = kw.get("reduction", "mean")
    with graph.inserting_before(node):
        # [rows * S] targets -> [rows, S] -> this rank's [rows, s] -> [rows * s], the logits' local row order
        target_rows = graph.call_method("view", (target, (rows, seq_len)))
        target_local = graph.call_function(torch.ops.burstc.shard_seq.default,
                                           (target_rows, 1, group_name, layout, padded_len, float(ignore_index)))
        target_local = graph.call_method("reshape", (target_local, (-1,)))
        per_token_local = graph.call_function(F.cross_entropy, (kw["input"], target_local), {
            "ignore_index": ignore_index, "reduction": "none",
            "label_smoothing": kw.get("label_smoothing", 0.0)})
        per_token_rows = graph.call_method("view", (per_token_local, (rows, local_len)))
        per_token = graph.call_function(torch.ops.burstc.gather_seq.default,
                                        (per_token_rows, 1, group_name, layout, seq_len))
        per_token = graph.call_method("reshape", (per_token, (-1,)))
        if reduction == "none":
            loss = per_token
        else:
            loss = graph.call_method("sum", (per_token,))
            if reduction == "mean":
                count = graph.call_method("sum", (graph.call_function(operator.ne, (target, ignore_index)),))
                loss = graph.call_function(operator.truediv, (loss, count))
    node.replace_all_uses_with(loss)
    graph.erase_node(node)


def _refresh_meta(gm: fx.GraphModule):
    """Recompute every node's example value after the rewrite (local shapes), from the inputs'."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = fake_mode_of(gm)
    inputs = [val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    gm.recompile()
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def shard(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    if context.world_size <= 1:
        context.note = "single device: nothing to shard"
        return gm
    try:
        seq_len = find_sequence_length(gm)
    except ValueError as why:
        context.skip(KIND, "graph", f"{why}; the graph runs unsharded", module="")
        return gm
    multiple = required_multiple(context.world_size, config.layout)
    padded_len = -(-seq_len // multiple) * multiple
    analyzer = _Analyzer(gm, seq_len, context.world_size, config, padded_len)
    try:
        plan = analyzer.run()
    except _Refuse as refusal:
        context.skip(KIND, refusal.node, f"{refusal}; the whole graph runs unsharded (replicated on every rank)")
        return gm
    except Exception as error:  # noqa: BLE001 - the analysis only reads the graph: refusing is always safe
        node = analyzer.current or "graph"
        context.skip(KIND, node, f"the shard pass failed to analyze `{getattr(node, 'name', node)}` "
                                 f"({type(error).__name__}: {error}); the whole graph runs unsharded "
                                 "(replicated on every rank) - please report this")
        return gm
    if padded_len != seq_len and not all(sdpa_kwargs(n)["is_causal"] for n in plan.attention):
        # padding at the end is exact only when no real token can see a pad: causal attention
        raise ValueError(
            f"burstc: sequence length {seq_len} is not a multiple of {multiple}, which layout "
            f"{config.layout!r} needs on {context.world_size} ranks, and padding is exact only for causal "
            f"attention; pad the batch to a multiple of {multiple}")
    if not plan.attention and not plan.losses:
        context.skip(KIND, "graph", "no attention or loss over the sequence found; the graph runs unsharded",
                     module="")
        return gm
    if analyzer.output_problem is not None:
        node, reason = analyzer.output_problem
        context.skip(KIND, node, f"{reason}; the whole graph runs unsharded (replicated on every rank)")
        return gm
    group_name = _group_name(context)
    gathered = _apply(gm, plan, analyzer, config, context, group_name)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    _refresh_meta(gm)
    context.rewrite(KIND, "graph", {
        "seq_len": seq_len, "world_size": context.world_size, "layout": config.layout,
        "padded_to": padded_len if padded_len != seq_len else None,
        "local_tokens": padded_len // context.world_size, "attention_ops": len(plan.attention),
        "losses": len(plan.losses), "reduce_grads": config.reduce_grads,
        "gathered_outputs": gathered or None,
    }, module="")
    return gm
