"""Helper of ``detect_attention`` and ``assume_unpadded`` (not a pass): turn an attention mask into the exact
:class:`MaskSpec` — a constant one by its value, one built from the token inputs by probing (see below).

A mask is evaluated at compile time (``graph_utils.evaluate_constant``) and read in one of three styles:

- ``"visible"``: SDPA's ``attn_mask`` (bool: True = may attend; float: added to the scores);
- ``"additive"``: added to the scores (the manual ``scores + mask``); must be float;
- ``"filled"``: ``scores.masked_fill(mask, very_negative)`` (bool: True = hidden).

A float mask is a *mask* when every entry is 0 or ``<= finfo(dtype).min / 2`` (HF's eager masks use
``finfo.min``, not ``-inf``): ``exp`` of such a score underflows to exactly 0, as with ``-inf``, as long as
every row keeps a visible entry (true of every spec below: the diagonal is visible).  Finite nonzero values
on the visible entries are a *bias*: accepted only as ALiBi (``slope_h * (j - i)`` plus a per-row constant,
which the softmax ignores), else refused.

The visibility must equal ``MaskSpec.visible(arange(S), arange(S))`` entry for entry (every broadcast
batch/head slice alike) for one of: full, causal, ``Causal & SlidingWindow(w, None)``, a band
``SlidingWindow(l, r)``.  Anything else (chunked/block-diagonal masks included: ``MaskSpec`` has no term
for them) is refused with ``attention.mask_dense``; never a nearby spec.
"""
from __future__ import annotations

import itertools
import math

import torch

from burstc.attention_ir import Alibi, Causal, Documents, KeyPadding, MaskSpec, SlidingWindow, \
    document_ids, padding_is_contiguous
from burstc.passes import graph_utils
from burstc.passes.graph_utils import (LengthScaling, NotConstant, TooLarge, ancestors, evaluate_constant,
                                       evaluation_order, in_place_writes, input_dependency, numeric_constants,
                                       placeholder_kind, prod, val)
from burstc.refusals import Refusal, register_codes

CODES = register_codes("attention", {
    "mask_runtime": "the mask depends on runtime values (inputs), not only on constants and buffers",
    "mask_not_tensor": "the mask is not a tensor",
    "mask_bias": "an additive mask with values other than 0 / -inf / <= finfo.min/2 that is not ALiBi: "
                 "a bias, not a mask",
    "mask_dense": "a dense mask that is not exactly full, causal, a sliding window or a band",
    "mask_dtype": "an additive mask whose dtype differs from the scores': SDPA can't take it as attn_mask",
    "mask_too_long": "the mask is too large to evaluate at the traced length and can't be evaluated at a "
                     "shorter one (its sizes or thresholds are not plain functions of the sequence length)",
    "mask_length_dependent": "evaluated at two shorter lengths, the mask is not the same spec: it depends on "
                             "the sequence length in a way burstc can't carry to the traced length",
})


ROW_CHUNK = 1024
"""Rows of an ``[S, S]`` visibility read at a time: whole-matrix offsets ``j - i`` in int64 took 7 GiB at S = 16K
(four ranks compiling at once ran a 24 GiB machine out of memory); a chunk of rows is 8 MiB of int64 per 1K keys."""


def spec_of_visibility(visible: torch.Tensor) -> MaskSpec | None:
    """``visible[..., Sq, Skv]`` (True = may attend) -> the exact static MaskSpec, or None."""
    visible = visible.to(torch.bool)
    if visible.dim() < 2:
        return None
    sq, skv = visible.shape[-2:]
    flat = visible.reshape(-1, sq, skv)
    if not bool((flat == flat[:1]).all()):
        return None  # batch / head slices differ: not one static spec
    v = flat[0]
    if bool(v.all()):
        return MaskSpec.full()
    if sq != skv or not bool(v.any()):
        return None
    right = left = None  # the farthest visible key ahead of its query (j - i), and behind it (i - j)
    for start in range(0, sq, ROW_CHUNK):
        rows_RK = v[start:start + ROW_CHUNK]
        seen_R = rows_RK.any(1)
        if not bool(seen_R.any()):
            continue
        row_R = torch.arange(start, start + rows_RK.shape[0])
        first_R = rows_RK.to(torch.int8).argmax(1)  # argmax gives the first maximal index: the first visible key
        last_R = skv - 1 - rows_RK.flip(1).to(torch.int8).argmax(1)
        chunk_right, chunk_left = int((last_R - row_R)[seen_R].max()), int((row_R - first_R)[seen_R].max())
        right = chunk_right if right is None else max(right, chunk_right)
        left = chunk_left if left is None else max(left, chunk_left)
    if right < 0 or left < 0:
        return None
    terms = []
    if right == 0:
        terms.append(Causal())
    left_bound = None if left >= sq - 1 else left
    right_bound = None if (right == 0 or right >= sq - 1) else right
    if left_bound is not None or right_bound is not None:
        terms.append(SlidingWindow(left_bound, right_bound))
    spec = MaskSpec(tuple(terms))
    pos = torch.arange(sq)
    return spec if all(bool((spec.visible(pos[start:start + ROW_CHUNK], pos) == v[start:start + ROW_CHUNK]).all())
                       for start in range(0, sq, ROW_CHUNK)) else None


def alibi_of(bias: torch.Tensor, visible: torch.Tensor, heads: int | None) -> Alibi | None:
    """``bias[..., H or 1, S, S]`` on the ``visible`` entries == ``slope_h * (j - i) + c_{h,i}`` -> Alibi."""
    if bias.dim() == 2:
        bias, visible = bias[None], visible[None]
    if bias.shape[-1] != bias.shape[-2]:
        return None
    s = bias.shape[-1]
    b = bias.to(torch.float64).reshape(-1, *bias.shape[-3:])
    if not bool((b == b[:1]).all()):
        return None  # differs over the batch
    b = b[0]
    vis = visible.reshape(-1, *visible.shape[-2:])[0]
    offset = (torch.arange(s).unsqueeze(0) - torch.arange(s).unsqueeze(1)).to(torch.float64)
    row = int(vis.sum(-1).argmax())                        # the row with the widest span fits the slope best
    cols = vis[row].nonzero().flatten()
    if cols.numel() < 2:
        return None
    lo, hi = int(cols.min()), int(cols.max())
    slopes = []
    for h in range(b.shape[0]):
        slope = float((b[h, row, hi] - b[h, row, lo]) / (hi - lo))
        residual = torch.where(vis, b[h] - slope * offset, torch.nan)
        row_const = residual.nanmean(-1, keepdim=True)     # softmax ignores a per-row constant
        scale = 1.0 + float(b[h][vis].abs().max())
        if not bool(((residual - row_const).abs()[vis] <= 1e-5 * scale).all()):
            return None
        slopes.append(slope)
    if not any(slopes):
        return None
    if len(slopes) == 1 and heads:
        slopes = slopes * heads                           # one bias broadcast over every head
    elif heads and len(slopes) != heads:
        return None
    return Alibi(tuple(slopes))


def _hidden_by_value(mask: torch.Tensor) -> torch.Tensor:
    """Entries of a float mask that hide their score: ``-inf`` or ``<= finfo(dtype).min / 2``."""
    return mask <= torch.finfo(mask.dtype).min / 2


def _bool_visibility(mask: torch.Tensor, style: str) -> torch.Tensor | None:
    """A bool mask read as SDPA's ``attn_mask`` (True = visible) or by ``masked_fill`` (True = hidden)."""
    if mask.dtype != torch.bool:
        return None
    return mask if style == "visible" else (~mask if style == "filled" else None)


def spec_of_value(mask, style: str, *, heads: int | None = None) -> tuple[MaskSpec | None, Refusal | None]:
    """The evaluated ``mask`` read in ``style`` -> (exact MaskSpec, None) or (None, refusal)."""
    if not isinstance(mask, torch.Tensor):
        return None, Refusal(CODES.mask_not_tensor, "mask is not a tensor")
    alibi = None
    if mask.is_floating_point() and style in ("visible", "additive"):
        visible = ~_hidden_by_value(mask)
        kept = mask[visible]
        if not bool(torch.isfinite(kept).all()):
            return None, Refusal(CODES.mask_bias, "additive mask with non-finite visible entries")
        if bool((kept != 0).any()):
            ok_range = bool((kept > torch.finfo(mask.dtype).min / 2).all())
            alibi = alibi_of(mask, visible, heads) if ok_range else None
            if alibi is None:
                return None, Refusal(CODES.mask_bias, "additive mask with values other than 0 and <= finfo.min/2, "
                                                      "not linear in j - i per head (a bias, not a mask)")
    elif (visible := _bool_visibility(mask, style)) is not None:
        pass
    else:
        return None, Refusal(CODES.mask_bias, f"a {mask.dtype} mask read as {style}: a bias, not a mask")
    spec = spec_of_visibility(visible)
    if spec is None:
        return None, Refusal(CODES.mask_dense, "dense mask that is not exactly full, causal, "
                                               "a sliding window or a band")
    return (spec & alibi if alibi is not None else spec), None


_WRITES = object()  # memo key of the graph's in-place writes


def _memoized(memo: dict | None, gm, key: tuple, mask_node, consumer, compute):
    """``compute()``, answered from ``memo`` (one dict per pass over one graph) when the same mask is read
    again: HF builds one mask that every layer reads.  Readers see the same value when the same in-place
    writes into the mask's ancestors come before them (``evaluate_constant`` replays exactly those)."""
    if memo is None:
        return compute()
    if _WRITES not in memo:
        memo[_WRITES] = in_place_writes(gm.graph)  # the pass inserts nodes, never in-place writes
    writes = memo[_WRITES]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # fresh: the pass inserts nodes as it goes
    needed = set(ancestors(mask_node))
    key = key + (frozenset(op for op, aliases in writes if aliases & needed and position[op] < position[consumer]),)
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def classify_mask(gm, mask_node, style: str, consumer, *, heads: int | None = None, memo: dict | None = None
                  ) -> tuple[MaskSpec | None, Refusal | None]:
    """The mask ``consumer`` reads -> (exact MaskSpec, None) or (None, refusal with its code)."""
    return _memoized(memo, gm, ("mask", mask_node, style, heads), mask_node, consumer,
                     lambda: _classify_mask(gm, mask_node, style, consumer, heads))


def _classify_mask(gm, mask_node, style, consumer, heads):
    dependency = input_dependency(gm, mask_node, at=consumer)
    if dependency is not None:
        runtime = classify_runtime_mask(gm, mask_node, style, consumer)
        if runtime is not None:
            return runtime, None
        try:
            evaluation_lengths(gm, mask_node, consumer)
        except TooLarge as why:
            return None, Refusal(CODES.mask_too_long, f"mask depends on runtime values and {why}")
        return None, Refusal(CODES.mask_runtime, f"mask depends on runtime values (depends on the "
                                                 f"{placeholder_kind(dependency)} `{dependency.name}`)")
    try:
        lengths = evaluation_lengths(gm, mask_node, consumer)
        verdicts = [spec_of_value(evaluate_constant(gm, mask_node, at=consumer, length=length), style, heads=heads)
                    for length in lengths]
    except TooLarge as why:
        return None, Refusal(CODES.mask_too_long, str(why))
    except NotConstant as why:
        return None, Refusal(CODES.mask_runtime, f"mask depends on runtime values ({why})")
    return _same_at_every_length(verdicts, lengths)


def _same_at_every_length(verdicts, lengths):
    """One (spec, refusal) per evaluated length -> the verdict, if they agree (specs are absolute: a window of
    4096 is one at every length; a window that grows with the probe length came from the length itself)."""
    (spec, refusal), rest = verdicts[0], verdicts[1:]
    if all(other[0] == spec and (other[1] is None) == (refusal is None) for other in rest):
        return spec, refusal
    shown = ", ".join(f"{v[0].kind if v[0] is not None else v[1].code} at length {length.probe}"
                      for v, length in zip(verdicts, lengths))
    return None, Refusal(CODES.mask_length_dependent, f"the mask differs with the probe length: {shown}")


# -- masks too long to evaluate: evaluated at two shorter lengths -------------------------------------------
#
# A [B, 1, S, S] mask at S = 64K is 4G entries.  Such a mask is evaluated as if traced at two short lengths
# (graph_utils.LengthScaling substitutes S in every size argument and checks every shape follows), both
# longer than twice any other number the mask is computed with (a window of 4096 is seen as a window at both,
# not as "longer than the sequence"); the two specs must agree.

_MIN_PROBE_LENGTH = 32
_PROBE_LENGTH_STEP = 5  # the second probe length: odd steps catch parity-dependent masks
# fill values of masks (finfo(dtype).min, -inf) are scores, not thresholds on positions
_FILL_LIMIT = torch.finfo(torch.float16).min / 2


def probe_lengths(constants, below: int) -> tuple[int, int]:
    """Two probe lengths shorter than ``below`` and longer than twice every number in ``constants`` (fill
    values like ``finfo.min`` aside); raises ``TooLarge`` if there are none."""
    thresholds = [abs(c) for c in constants if math.isfinite(c) and c > _FILL_LIMIT]
    shortest = max(_MIN_PROBE_LENGTH, 2 * math.ceil(max(thresholds, default=0)) + 16)
    if shortest + _PROBE_LENGTH_STEP >= below:
        raise TooLarge(f"the mask is too large to evaluate at its length and it computes with numbers up to "
                       f"{max(thresholds, default=0):g}: a shorter probe length must exceed twice that")
    return shortest, shortest + _PROBE_LENGTH_STEP


def evaluation_lengths(gm, mask_node, consumer, seq: int | None = None) -> tuple[LengthScaling | None, ...]:
    """``(None,)`` when the mask (as ``consumer`` reads it) can be evaluated at its traced length; else two
    :class:`LengthScaling` to shorter probe lengths.  Raises ``TooLarge`` when neither works."""
    order = evaluation_order(gm, mask_node, consumer)
    traced = [tuple(val(n).shape) for n in order if isinstance(val(n), torch.Tensor) and n.op != "placeholder"]
    limit = graph_utils.FULL_EVALUATION_LIMIT
    if max((prod(shape) for shape in traced), default=0) <= limit:
        return (None,)
    mask_shape = tuple(val(mask_node).shape)
    seq = seq if seq is not None else mask_shape[-1]
    if len(mask_shape) < 2 or mask_shape[-2:] != (seq, seq):
        raise TooLarge(f"the mask's shape {mask_shape} is too large to evaluate and not [..., S, S]")
    scaling = LengthScaling(seq, seq)
    probes = probe_lengths([c for c in numeric_constants(gm, order) if not scaling.is_length(c)],
                           seq - LengthScaling.SLACK)
    lengths = tuple(LengthScaling(seq, probe) for probe in probes)
    scaled = max(prod(lengths[-1].shape(shape)) for shape in traced)
    if scaled > limit:
        raise TooLarge(f"the mask is too large to evaluate even at length {lengths[-1].probe} ({scaled:,} elements)")
    return lengths


# -- masks built from the caller's token inputs: packed documents, padding ---------------------------------
#
# HF builds them at run time from ``position_ids`` (a document starts where the positions do not step by one)
# and from ``attention_mask`` (key padding); other models compare document ids they are given
# (``doc[b, i] == doc[b, j]``).  Such a mask is recognized by probing: the mask subgraph is evaluated on a set
# of inputs (one document, random packings with documents of length 1, unsorted ids, right/left padding,
# holes) and must equal, for every probe, ``static & Documents(positions or ids) & KeyPadding(padding)`` with
# the documents and validity burstc computes from the same inputs at run time.  Any mismatch: refused.

_PROBE_SEED = 20261205


def _probe_positions(batch: int, seq: int, gen: torch.Generator) -> list[torch.Tensor]:
    probes = [torch.arange(seq).expand(batch, seq).clone()]
    for max_len in (1, 3, max(2, seq // 3)):
        rows = []
        for _ in range(batch):
            lengths, left = [], seq
            while left:
                lengths.append(min(left, int(torch.randint(1, max_len + 1, (), generator=gen))))
                left -= lengths[-1]
            rows.append(torch.cat([torch.arange(n) for n in lengths]))
        probes.append(torch.stack(rows))
    return probes


def _probe_padding(batch: int, seq: int, gen: torch.Generator) -> list[torch.Tensor]:
    ones = torch.ones(batch, seq, dtype=torch.int64)
    right, left, holes = ones.clone(), ones.clone(), (torch.rand(batch, seq, generator=gen) < 0.7).to(torch.int64)
    both = ones.clone()  # one run of real tokens, padding on both sides
    for b in range(batch):
        n = int(torch.randint(1, seq, (), generator=gen))
        right[b, seq - n:] = 0
        left[b, :n] = 0
        both[b, :n // 2 + 1] = 0
        both[b, seq - n // 3 - 1:] = 0
    holes[:, 0] = 1
    return [ones, right, left, both, holes]


def classify_runtime_mask(gm, mask_node, style: str, consumer, *, memo: dict | None = None) -> MaskSpec | None:
    """A mask built from at most one positions input and one padding input (integer/bool ``[B, S]``
    placeholders) and constants -> ``static & Documents(...) & KeyPadding(...)`` when every probe agrees,
    else None."""
    return _memoized(memo, gm, ("runtime", mask_node, style), mask_node, consumer,
                     lambda: _classify_runtime_mask(gm, mask_node, style, consumer))


def _classify_runtime_mask(gm, mask_node, style, consumer):
    needed = ancestors(mask_node)
    inputs = [n for n in needed if n.op == "placeholder" and placeholder_kind(n) == "input"]
    if not inputs or len(inputs) > 2:
        return None
    if any(n.op == "placeholder" and placeholder_kind(n) not in ("input", "buffer") for n in needed):
        return None  # reads parameters: not a mask of the inputs alone
    shapes = {tuple(val(n).shape) if isinstance(val(n), torch.Tensor) else None for n in inputs}
    if len(shapes) != 1 or None in shapes or len(next(iter(shapes))) != 2:
        return None
    batch, seq = next(iter(shapes))
    if any(val(n).is_floating_point() or val(n).is_complex() for n in inputs):
        return None
    try:
        lengths = evaluation_lengths(gm, mask_node, consumer, seq)
    except TooLarge:
        return None
    specs = []
    for length in lengths:
        gen = torch.Generator().manual_seed(_PROBE_SEED)
        probe_seq = length.probe if length is not None else seq
        spec = None
        for roles in itertools.permutations(("positions", "ids", "padding"), len(inputs)):
            if {"positions", "ids"} <= set(roles):
                continue  # one documents term
            role_of = dict(zip(inputs, roles))
            spec = _verified(gm, mask_node, style, consumer, role_of, batch, probe_seq, gen, length)
            if spec is not None:
                break
        if spec is None or (specs and spec != specs[0]):
            return None
        specs.append(spec)
    return specs[0]


def hidden_fill(gm, mask_node, consumer, spec: MaskSpec) -> float | None:
    """The one value a float mask built from the inputs gives every score it hides (HF eager: ``finfo.min``;
    or ``-inf``), read on the padding probes (left padding hides whole rows) -> that value, or None when the
    hidden entries differ (a row hidden by two fills is not uniform) or can't be evaluated."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    padding, documents = spec.term(KeyPadding), spec.term(Documents)
    if padding is None or padding.source not in placeholders:
        return None
    pad_node = placeholders[padding.source]
    batch, seq = val(pad_node).shape
    try:
        length = evaluation_lengths(gm, mask_node, consumer, seq)[0]
    except TooLarge:
        return None
    probe_seq = length.probe if length is not None else seq
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    values = {}
    if documents is not None:
        doc_node = placeholders.get(documents.source)
        if doc_node is None:
            return None
        neutral = _DOCUMENT_ROLES["ids" if documents.ids else "positions"](batch, probe_seq, gen)[0]
        values[doc_node] = neutral.to(val(doc_node).dtype)
    fills = set()
    for pad in _probe_padding(batch, probe_seq, gen):
        try:
            value = evaluate_constant(gm, mask_node, at=consumer, inputs={**values, pad_node: pad.to(val(pad_node).dtype)},
                                      length=length)
        except Exception:  # noqa: BLE001 - a probe the subgraph can't take
            return None
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return None
        fills.update(value[_hidden_by_value(value)].unique().tolist())
    return fills.pop() if len(fills) == 1 else None


def _probe_document_ids(batch: int, seq: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Document ids as a model may take them (``[B, S]``): one document, sorted segments per row, unsorted
    small ids, one token per document."""
    segments = torch.cumsum((torch.rand(batch, seq, generator=gen) < 0.2).to(torch.int64), -1)
    return [torch.zeros(batch, seq, dtype=torch.int64), segments, torch.randint(0, 3, (batch, seq), generator=gen),
            torch.arange(seq).expand(batch, seq).clone()]


_DOCUMENT_ROLES = {"positions": _probe_positions, "ids": _probe_document_ids}


def _visibility_and_bias(value, style: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A mask value read in ``style`` -> (bool visibility, the float values on the visible entries or None)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and style in ("visible", "additive"):
        hidden = _hidden_by_value(value)
        return ~hidden, torch.where(hidden, torch.zeros((), dtype=value.dtype), value)
    return (_bool_visibility(value, style) if isinstance(value, torch.Tensor) else None), None


def _shifted_per_row(bias: torch.Tensor, neutral_bias: torch.Tensor, visible: torch.Tensor) -> bool:
    """``bias == neutral_bias + c`` on the ``visible`` entries of each row (the last dim: the keys), ``c`` a
    constant per row (per batch, head and query): an attention mask's bias is added to the scores before the
    softmax over that row, which ignores ``c``.  BLOOM's ALiBi counts real tokens: under left padding its bias is
    the unpadded one shifted by the row's first real position.  To fp32 rounding, as :func:`alibi_of`."""
    diff = bias.to(torch.float64) - neutral_bias.to(torch.float64)
    diff, visible = torch.broadcast_tensors(diff, visible)
    highest = torch.where(visible, diff, -math.inf).amax(-1)
    lowest = torch.where(visible, diff, math.inf).amin(-1)
    rows = visible.any(-1)
    scale = 1.0 + max(float(bias.abs().max()), float(neutral_bias.abs().max()))
    return bool(((highest - lowest)[rows] <= 1e-5 * scale).all())


def _verified(gm, mask_node, style, consumer, role_of, batch, seq, gen, length) -> MaskSpec | None:
    documents = next(((n, r) for n, r in role_of.items() if r in _DOCUMENT_ROLES), None)
    padding = next((n for n, r in role_of.items() if r == "padding"), None)
    doc_probes = _DOCUMENT_ROLES[documents[1]](batch, seq, gen) if documents is not None else [None]
    pad_probes = _probe_padding(batch, seq, gen) if padding is not None else [None]

    def evaluate(doc, pad):
        values = {}
        if documents is not None:
            values[documents[0]] = doc.to(val(documents[0]).dtype)
        if padding is not None:
            values[padding] = pad.to(val(padding).dtype)
        try:
            return _visibility_and_bias(evaluate_constant(gm, mask_node, at=consumer, inputs=values, length=length),
                                        style)
        except Exception:  # noqa: BLE001 - a probe the subgraph can't take: not recognized
            return None, None

    neutral, neutral_bias = evaluate(doc_probes[0], pad_probes[0])
    static = spec_of_visibility(neutral) if neutral is not None else None
    if static is None or static.score_mods:
        return None
    spec = static
    # a bias on the visible entries (MPT's ALiBi under a runtime mask): ALiBi, the same on every probe
    biased = neutral_bias is not None and bool((neutral_bias != 0).any())
    if biased:
        alibi = alibi_of(neutral_bias, neutral, neutral_bias.shape[-3] if neutral_bias.dim() >= 3 else None)
        if alibi is None:
            return None
        spec = spec & alibi
    if documents is not None:
        spec = spec & Documents(documents[0].name, ids=documents[1] == "ids")
    arange = torch.arange(seq)
    contiguous = False  # exact only for calls whose padding has no hole (BLOOM: its ALiBi counts real tokens)
    checked = []
    for doc, pad in itertools.product(doc_probes, pad_probes):
        got, got_bias = evaluate(doc, pad)
        if got is None or got.dim() < 3 or got.shape[-2:] != (seq, seq):
            return None
        if got_bias is not None and bool((got_bias != 0).any()) != biased:
            return None  # a bias on some probes only
        if biased and not _shifted_per_row(got_bias, neutral_bias, got):
            if pad is None or padding_is_contiguous(pad.ne(0)):
                return None  # the bias moves with the data: not one ALiBi
            contiguous = True
        checked.append((doc, pad, got))
    if padding is not None:
        spec = spec & KeyPadding(padding.name, contiguous=contiguous)
    for doc, pad, got in checked:
        docs = None if doc is None else document_ids(doc, batch, ids=documents[1] == "ids")
        valid = pad.ne(0) if pad is not None else None
        want = spec.visible(arange, arange, q_docs=docs, kv_docs=docs,
                            kv_valid=valid)
        want = want.reshape(want.shape[0] if want.dim() == 3 else 1, 1, seq, seq)
        got = got.reshape(-1, *got.shape[-3:]) if got.dim() >= 4 else got.reshape(-1, 1, seq, seq)
        if got.shape[0] not in (1, batch) or not bool((got == want.expand(batch, 1, seq, seq)).all()):
            return None
    return spec
