"""The attention IR: what one attention computes, independent of how the graph spelled it.

Detection (``passes/detect_attention.py``) produces one :class:`AttentionMatch` per attention; the shard
pass, the planner, the block geometry (``burstc/block_geometry.py``) and the ring op read it.  The
mask is a :class:`MaskSpec`: an AND of mask terms plus score modifications, so that every kind a model
uses is one value that can be compared, printed, planned for and handed to a custom op.

Positions are **global** token positions: query ``i`` may attend key ``j`` when every term allows it.

Terms (each is a frozen dataclass; a spec holds at most one of each kind, in canonical order):

- :class:`Causal` — ``j <= i``;
- :class:`SlidingWindow` ``(left, right)`` — ``i - left <= j <= i + right`` (``None`` = unbounded);
- :class:`Documents` — ``doc[i] == doc[j]`` with document ids taken from a runtime source (restarting
  position ids, or a document-id tensor); the ids are data, never a specialization;
- :class:`KeyPadding` — ``valid[b, j]`` from a runtime source (HF's ``attention_mask``);
- :class:`FlexMask` — a FlexAttention ``mask_mod`` subgraph, evaluated per block from global positions.

Score modifications (applied to the scaled scores before the softmax, in this order):
:class:`Alibi` (``s + slope_h * (j - i)``), :class:`SoftCap` (``c * tanh(s / c)``), :class:`FlexScore`.

The ring op executes every static spec (causal, sliding windows, ALiBi, soft-cap and ANDs of these)
and the runtime terms :class:`Documents` and :class:`KeyPadding`, whose data (``doc_ids``,
``key_valid``) it takes as tensor inputs (``MaskSpec.ring_supported``); flex subgraphs are not
executed.  :meth:`MaskSpec.visible` is the plain-torch reference for every term but flex.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

# -- mask terms ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Causal:
    """Query ``i`` sees keys ``j <= i``."""

    def encode(self) -> str:
        return "causal"


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """Query ``i`` sees keys ``i - left <= j <= i + right``; ``None`` leaves that side unbounded.
    HF's ``sliding_window=w`` with causal is ``Causal() & SlidingWindow(w - 1, None)``."""

    left: int | None
    right: int | None = None

    def __post_init__(self):
        for side in (self.left, self.right):
            if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
                raise ValueError(f"SlidingWindow sides must be non-negative ints or None, got {self}")

    def encode(self) -> str:
        return f"window({_opt(self.left)},{_opt(self.right)})"


@dataclasses.dataclass(frozen=True)
class Documents:
    """Query and key must belong to the same document.  ``source`` names the runtime input the ids come
    from: position ids (``ids=False``: a document starts where the positions do not step by one, HF's
    packing convention) or document ids compared as they are (``ids=True``: a FlexAttention ``mask_mod``'s
    ``doc[b, q] == doc[b, kv]``; any integers, not necessarily sorted)."""

    source: str
    ids: bool = False

    def encode(self) -> str:
        return f"{'document_ids' if self.ids else 'documents'}({self.source})"


@dataclasses.dataclass(frozen=True)
class KeyPadding:
    """Key ``j`` of batch row ``b`` is visible only where ``valid[b, j]``; ``source`` names the input.
    ``contiguous``: the model's mask is this spec only for calls whose every row's valid keys are one run
    (BLOOM's ALiBi counts a row's real tokens: with a hole in the padding its bias is not one ALiBi); the
    backend checks each call and runs one with a hole unsharded (``guards.exactness_guarded``)."""

    source: str
    contiguous: bool = False

    def encode(self) -> str:
        return f"key_padding({self.source}{',contiguous' if self.contiguous else ''})"


@dataclasses.dataclass(frozen=True)
class FlexMask:
    """A FlexAttention ``mask_mod``; ``graph`` names the subgraph (a ``get_attr`` target) that computes it."""

    graph: str

    def encode(self) -> str:
        return f"flex_mask({self.graph})"


# -- score modifications ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Alibi:
    """``s + slopes[h] * (j - i)`` (one slope per query head)."""

    slopes: tuple[float, ...]

    def encode(self) -> str:
        return "alibi(" + ",".join(repr(float(s)) for s in self.slopes) + ")"


@dataclasses.dataclass(frozen=True)
class SoftCap:
    """``cap * tanh(s / cap)`` on the scaled scores (Gemma-2's attention soft-capping)."""

    cap: float

    def __post_init__(self):
        if not self.cap > 0:
            raise ValueError(f"SoftCap needs a positive cap, got {self.cap}")

    def encode(self) -> str:
        return f"softcap({float(self.cap)!r})"


@dataclasses.dataclass(frozen=True)
class FlexScore:
    """A FlexAttention ``score_mod`` subgraph (a ``get_attr`` target)."""

    graph: str

    def encode(self) -> str:
        return f"flex_score({self.graph})"


MaskTerm = Causal | SlidingWindow | Documents | KeyPadding | FlexMask
ScoreMod = Alibi | SoftCap | FlexScore
_TERM_ORDER = (Causal, SlidingWindow, Documents, KeyPadding, FlexMask)
_SCORE_ORDER = (Alibi, SoftCap, FlexScore)
# terms whose values are known at compile time from positions alone
STATIC_TERMS = (Causal, SlidingWindow)
STATIC_SCORE_MODS = (Alibi, SoftCap)
# terms whose values are data: the ring op takes them as tensors, never as specializations
RUNTIME_TERMS = (Documents, KeyPadding)


def _opt(v: int | None) -> str:
    return "-" if v is None else str(v)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """An AND of mask terms and a list of score modifications; the empty spec is full attention.

    Build with :meth:`full`, :meth:`causal`, the term constructors and ``&``::

        MaskSpec.causal() & SlidingWindow(4095)          # Mistral's sliding window
        MaskSpec.causal() & Documents("position_ids")    # packed documents
    """

    terms: tuple[MaskTerm, ...] = ()
    score_mods: tuple[ScoreMod, ...] = ()

    def __post_init__(self):
        kinds = [type(t) for t in self.terms]
        if any(k not in _TERM_ORDER for k in kinds):
            raise TypeError(f"unknown mask term in {self.terms}")
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"a MaskSpec holds at most one term of each kind, got {self.terms}")
        mods = [type(m) for m in self.score_mods]
        if any(k not in _SCORE_ORDER for k in mods) or len(set(mods)) != len(mods):
            raise ValueError(f"score modifications must be distinct Alibi/SoftCap/FlexScore, got {self.score_mods}")
        # canonical order, so that equal specs compare and encode equal
        object.__setattr__(self, "terms", tuple(sorted(self.terms, key=lambda t: _TERM_ORDER.index(type(t)))))
        object.__setattr__(self, "score_mods",
                           tuple(sorted(self.score_mods, key=lambda m: _SCORE_ORDER.index(type(m)))))

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def full(cls) -> "MaskSpec":
        return cls()

    @classmethod
    def causal(cls) -> "MaskSpec":
        return cls((Causal(),))

    def __and__(self, other: "MaskSpec | MaskTerm | ScoreMod") -> "MaskSpec":
        if isinstance(other, MaskSpec):
            return _combine(self, other.terms, other.score_mods)
        if isinstance(other, _TERM_ORDER):
            return _combine(self, (other,), ())
        if isinstance(other, _SCORE_ORDER):
            return _combine(self, (), (other,))
        return NotImplemented

    # -- questions the passes and the op ask -----------------------------------------------------------
    def term(self, kind: type) -> Any:
        return next((t for t in (*self.terms, *self.score_mods) if isinstance(t, kind)), None)

    @property
    def is_full(self) -> bool:
        return not self.terms and not self.score_mods

    @property
    def is_causal(self) -> bool:
        """Exactly causal: one :class:`Causal` term and nothing else."""
        return self.terms == (Causal(),) and not self.score_mods

    @property
    def ring_supported(self) -> bool:
        """What the ring op executes: static terms and score mods, computable from global positions
        (:class:`Causal`, :class:`SlidingWindow`, :class:`Alibi`, :class:`SoftCap`), and the runtime
        terms :class:`Documents` and :class:`KeyPadding` (their data are op inputs)."""
        return all(isinstance(t, STATIC_TERMS + RUNTIME_TERMS) for t in self.terms) and \
            all(isinstance(m, STATIC_SCORE_MODS) for m in self.score_mods)

    @property
    def runtime_terms(self) -> tuple[MaskTerm, ...]:
        """The :class:`Documents` / :class:`KeyPadding` terms: their values are data."""
        return tuple(t for t in self.terms if isinstance(t, RUNTIME_TERMS))

    @property
    def static_part(self) -> "MaskSpec":
        """The spec without its runtime terms: what global positions alone decide (a superset of
        the visible entries, so its block geometry bounds the work)."""
        static = tuple(t for t in self.terms if not isinstance(t, RUNTIME_TERMS))
        # a spec is immutable: the common all-static one is its own static part (the geometry asks for it per
        # rank pair, ~10^6 times for explain at 64 ranks)
        return self if len(static) == len(self.terms) else MaskSpec(static, self.score_mods)

    @property
    def runtime_sources(self) -> tuple[str, ...]:
        """Names of the runtime inputs the mask reads (document ids, key padding)."""
        return tuple(t.source for t in self.terms if isinstance(t, (Documents, KeyPadding)))

    @property
    def kind(self) -> str:
        """One word for reports: ``full``, ``causal``, or the encoding."""
        if self.is_full:
            return "full"
        if self.is_causal:
            return "causal"
        return self.encode()

    # -- custom-op argument ----------------------------------------------------------------------------
    def encode(self) -> str:
        """A string for custom-op arguments and cache keys; :meth:`decode` inverts it."""
        parts = [t.encode() for t in self.terms] + [m.encode() for m in self.score_mods]
        return "&".join(parts) if parts else "full"

    @classmethod
    def decode(cls, text: str) -> "MaskSpec":
        if text == "full":
            return cls()
        terms, mods = [], []
        for part in text.split("&"):
            match = re.fullmatch(r"(\w+)(?:\((.*)\))?", part)
            if match is None:
                raise ValueError(f"not a MaskSpec encoding: {text!r}")
            name, arg = match.group(1), match.group(2)
            if name == "causal" and arg is None:
                terms.append(Causal())
            elif name == "window":
                left, right = (None if x == "-" else int(x) for x in arg.split(","))
                terms.append(SlidingWindow(left, right))
            elif name == "documents":
                terms.append(Documents(arg))
            elif name == "document_ids":
                terms.append(Documents(arg, ids=True))
            elif name == "key_padding":
                source, _, flag = arg.partition(",")
                if flag not in ("", "contiguous"):
                    raise ValueError(f"unknown key_padding flag {flag!r} in {text!r}")
                terms.append(KeyPadding(source, contiguous=flag == "contiguous"))
            elif name == "flex_mask":
                terms.append(FlexMask(arg))
            elif name == "alibi":
                mods.append(Alibi(tuple(float(x) for x in arg.split(","))))
            elif name == "softcap":
                mods.append(SoftCap(float(arg)))
            elif name == "flex_score":
                mods.append(FlexScore(arg))
            else:
                raise ValueError(f"unknown MaskSpec term {part!r} in {text!r}")
        return cls(tuple(terms), tuple(mods))

    def __str__(self) -> str:
        return self.kind

    # -- the plain-torch reference -----------------------------------------------------------------------
    def visible(self, q_positions: torch.Tensor, kv_positions: torch.Tensor, *,
                q_docs: torch.Tensor | None = None, kv_docs: torch.Tensor | None = None,
                kv_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Bool ``[..., Sq, Skv]``: True where query (global position ``q_positions[i]``) may attend key
        ``kv_positions[j]``.  Document ids (``q_docs``/``kv_docs``, shaped like the positions or with a
        leading batch dim) and key validity (``kv_valid``, ``[B, Skv]``) are needed only when the spec
        has those terms.  A :class:`FlexMask` needs its subgraph: not evaluated here."""
        qi = q_positions.unsqueeze(-1)
        kj = kv_positions.unsqueeze(-2)
        visible = torch.ones(torch.broadcast_shapes(qi.shape, kj.shape), dtype=torch.bool, device=qi.device)
        for term in self.terms:
            if isinstance(term, Causal):
                visible = visible & (kj <= qi)
            elif isinstance(term, SlidingWindow):
                if term.left is not None:
                    visible = visible & (kj >= qi - term.left)
                if term.right is not None:
                    visible = visible & (kj <= qi + term.right)
            elif isinstance(term, Documents):
                if q_docs is None or kv_docs is None:
                    raise ValueError(f"{term} needs q_docs and kv_docs")
                visible = visible & (q_docs.unsqueeze(-1) == kv_docs.unsqueeze(-2))
            elif isinstance(term, KeyPadding):
                if kv_valid is None:
                    raise ValueError(f"{term} needs kv_valid")
                visible = visible & kv_valid.to(torch.bool).unsqueeze(-2)
            else:
                raise NotImplementedError(f"{term} is evaluated from its subgraph, not here")
        return visible


def _combine(spec: MaskSpec, terms, mods) -> MaskSpec:
    return MaskSpec(spec.terms + tuple(terms), spec.score_mods + tuple(mods))


# a fill at or below this absorbs every score a model produces (|s| < 1e22: below half an fp32 ulp of 1e30), so a
# row whose every score is filled is exactly uniform
UNIFORM_FILL_LIMIT = -1e30


# -- one match per attention ----------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionMatch:
    """One attention in the graph, in SDPA normal form.

    ``node`` is the ``F.scaled_dot_product_attention`` node that computes it after detection (a manual
    ``softmax(q kᵀ) v`` is replaced by one; one SDPA can't express, soft-capped, stays as written and is
    recorded on its ``probs @ v`` node with a refusal).  A spec other than full/causal keeps the constant
    ``attn_mask`` on the node, which computes exactly ``mask``.  ``query``/``key``/``value`` are its
    ``[B, H, S, D]`` inputs (K/V with ``kv_heads`` heads, never repeated when detection could undo a
    ``repeat_kv``); ``scale`` ``None`` means ``D ** -0.5``.  ``refusal`` (a :class:`burstc.refusals.Refusal`) is set when the
    attention can't be sharded (its mask is not understood), with the reason; ``notes`` say what
    detection did (a constant mask folded, ``repeat_kv`` undone) for the report.
    """

    node: Any                       # torch.fx.Node
    query: Any
    key: Any
    value: Any
    mask: MaskSpec
    scale: float | None = None
    heads_q: int | None = None
    kv_heads: int | None = None
    source: str = "sdpa"            # "sdpa" | "manual"
    mask_origin: str = ""           # how detection found the mask ("constant mask folded at compile time", ...)
    notes: tuple[str, ...] = ()
    refusal: Any = None             # burstc.refusals.Refusal | None
    # the model fills hidden scores with a float (finfo.min: eager's uniform average over all keys for a query
    # row whose every key is hidden; -inf: NaN) where the ring op gives 0: exact only for calls without such
    # rows, which the backend checks per call (has_fully_hidden_rows)
    float_fill: bool = False
    # the one value the model gives every hidden score (finfo.min, -inf), None when unknown or not one value
    hidden_fill: float | None = None
    fill_replaces: bool = False     # masked_fill replaces the hidden scores (else the fill is added to them)
    # gpt-oss's attention sinks: a [1, H, 1, 1] node of per-head logits that join each row's softmax as one more
    # key with a zero value (out = softmax-over-keys output * sigmoid(lse - sink)); None without
    sink: Any = None
    # the dtype autocast's matmuls ran the attention in (its q, k, v were cast to it in the graph), None without
    cast_to: Any = None

    @property
    def mask_description(self) -> str:
        """For reports: ``causal (constant mask folded at compile time)``, ``is_causal``, ``none``."""
        if self.mask_origin:
            return f"{'none' if self.mask.is_full and self.source == 'manual' else self.mask.kind} ({self.mask_origin})"
        return "is_causal" if self.mask.is_causal else ("none" if self.mask.is_full else self.mask.kind)

    @property
    def gqa_groups(self) -> int | None:
        if self.heads_q is None or not self.kv_heads:
            return None
        return self.heads_q // self.kv_heads

    @property
    def hidden_rows(self) -> str | None:
        """What this attention gives a query row that sees no key, as the ring op's ``hidden_rows``: ``"zero"``
        (SDPA; no float fill), ``"uniform"`` (a finite fill added to the scores that absorbs every score,
        ``<= UNIFORM_FILL_LIMIT``: fp32/bf16 ``finfo.min``, not fp16's; under ALiBi and a soft-cap too, whose
        per-entry gradient the op computes from every hidden row), ``"uniform_replaced"`` (a finite fill
        that replaces the scores, ``masked_fill``), or None: no exact mode (``-inf``: NaN rows; mixed fills;
        fp16's ``finfo.min``), such calls must run unsharded."""
        if not self.float_fill:
            return "zero"
        fill = self.hidden_fill
        if fill is None or not math.isfinite(fill):
            return None
        if self.fill_replaces:
            return "uniform_replaced"
        if fill <= UNIFORM_FILL_LIMIT and all(isinstance(mod, (Alibi, SoftCap)) for mod in self.mask.score_mods):
            return "uniform"
        return None

    @property
    def shardable(self) -> bool:
        return self.refusal is None and self.mask.ring_supported


def document_ids_from_positions(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Document id of every token of packed sequences (int64 ``[B, S]``, from 0): a document starts where the
    position ids do not step by one from the previous token (HF's packed-sequence convention,
    ``DataCollatorWithFlattening``: each document's positions restart at 0)."""
    previous = torch.cat([position_ids_BS[..., :1] - 1, position_ids_BS[..., :-1]], dim=-1)
    return torch.cumsum((position_ids_BS - previous != 1).to(torch.int64), dim=-1)


def document_ids_for_batch(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """Document ids given as a tensor (``[S]`` shared by every row, or ``[B, S]``) -> int64 ``[B, S]``."""
    return ids.to(torch.int64).expand(batch, ids.shape[-1]).contiguous()


def document_ids(source: torch.Tensor, batch: int, ids: bool) -> torch.Tensor:
    """The int64 document ids of a :class:`Documents` term's input: given as they are (``ids=True``, then
    ``[B, S]``) or derived from restarting position ids (``ids=False``)."""
    return document_ids_for_batch(source, batch) if ids else document_ids_from_positions(source)


def has_fully_hidden_rows(mask: MaskSpec, *, doc_ids_BS: torch.Tensor | None = None,
                          key_valid_BS: torch.Tensor | None = None) -> bool:
    """Does some query row of this call see no key at all?  (:func:`fully_hidden_rows`, any.)"""
    hidden_BS = fully_hidden_rows(mask, doc_ids_BS=doc_ids_BS, key_valid_BS=key_valid_BS)
    return hidden_BS is not None and bool(hidden_BS.any())


def fully_hidden_rows(mask: MaskSpec, *, doc_ids_BS: torch.Tensor | None = None,
                      key_valid_BS: torch.Tensor | None = None) -> torch.Tensor | None:
    """The query rows of this call that see no key at all (bool ``[B, S]``), or None when the mask can hide
    none.  Only :class:`KeyPadding` can hide every key of a row (the static terms and documents always leave
    the diagonal).  O(B * S): the keys a query may see form one range (its window, within its document when
    documents are contiguous runs); the row is hidden when that range holds no valid key.  Unsorted document
    ids (a document resuming later): answered exactly through the dense ``[B, S, S]`` visibility, chunked by
    rows."""
    if key_valid_BS is None or mask.term(KeyPadding) is None:
        return None
    valid_BS = key_valid_BS.to(torch.bool)
    batch, seq = valid_BS.shape
    i = torch.arange(seq, device=valid_BS.device)
    window, documents = mask.term(SlidingWindow), mask.term(Documents)
    if documents is not None and doc_ids_BS is not None and not _documents_are_runs(doc_ids_BS):
        hidden_BS = torch.zeros(batch, seq, dtype=torch.bool, device=valid_BS.device)
        for start in range(0, seq, 1024):  # unsorted ids: a document is not one run
            rows = i[start:start + 1024]
            visible = mask.visible(rows, i, q_docs=doc_ids_BS[:, start:start + 1024], kv_docs=doc_ids_BS,
                                   kv_valid=valid_BS)
            hidden_BS[:, start:start + 1024] = ~visible.any(-1)
        return hidden_BS
    lo = torch.zeros(batch, seq, dtype=torch.long, device=valid_BS.device)
    hi = i.expand(batch, seq).clone() if mask.term(Causal) is not None else torch.full_like(lo, seq - 1)
    if window is not None and window.left is not None:
        lo = torch.maximum(lo, i - window.left)
    if window is not None and window.right is not None:
        hi = torch.minimum(hi, i + window.right)
    if documents is not None and doc_ids_BS is not None:
        starts = torch.ones(batch, seq, dtype=torch.bool, device=valid_BS.device)
        starts[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
        doc_start = torch.cummax(torch.where(starts, i, 0), dim=-1).values
        ends = torch.ones_like(starts)
        ends[:, :-1] = starts[:, 1:]
        doc_end = torch.flip(torch.cummin(torch.flip(torch.where(ends, i, seq - 1), [-1]), dim=-1).values, [-1])
        lo, hi = torch.maximum(lo, doc_start), torch.minimum(hi, doc_end)
    prefix = torch.nn.functional.pad(valid_BS.to(torch.long).cumsum(-1), (1, 0))
    count = prefix.gather(-1, hi + 1) - prefix.gather(-1, lo)
    return count == 0


def padding_is_contiguous(key_valid_BS: torch.Tensor) -> bool:
    """Are every row's valid keys one contiguous run (right, left or both-sided padding; no hole)?  A row with
    no valid key has no hole either."""
    valid_BS = key_valid_BS.to(torch.bool)
    run_starts = valid_BS[:, :1].to(torch.long).sum(-1) + (valid_BS[:, 1:] & ~valid_BS[:, :-1]).sum(-1)
    return bool((run_starts <= 1).all())


def _documents_are_runs(doc_ids_BS: torch.Tensor) -> bool:
    """Is every document one contiguous run of tokens (as many id changes as distinct ids, less one)?"""
    changes = (doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]).sum(-1)
    return all(int(changes[b]) == doc_ids_BS[b].unique().numel() - 1 for b in range(doc_ids_BS.shape[0]))
