"""Hand-written small models that probe one pass behaviour each (refusals, in-place ops, position-wise
ops); every constructor seeds itself so that each rank and the eager reference build the same weights."""
import torch


class MeanPooled(torch.nn.Module):
    """Mixes positions outside attention with a mean over the sequence (every token sees the whole sequence's
    mean): the shard pass sums each rank's tokens, all-reduces and divides by the whole count."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 16)
        self.head = torch.nn.Linear(16, 97)

    def pool(self, h):
        return h.mean(dim=1, keepdim=True)

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + self.pool(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


def mean_pooled():
    torch.manual_seed(0)
    return MeanPooled()


class SumPooled(MeanPooled):
    """Every token sees a sum over the whole sequence: the sum's gradient comes from every rank's tokens."""

    def pool(self, h):
        return 0.05 * h.sum(dim=1, keepdim=True)


def sum_pooled():
    torch.manual_seed(0)
    return SumPooled()


class MaxPooled(MeanPooled):
    """Mixes positions outside attention with a max over the sequence: the shard pass must refuse."""

    def pool(self, h):
        return h.amax(dim=1, keepdim=True)


def max_pooled():
    torch.manual_seed(0)
    return MaxPooled()


class Bidirectional(torch.nn.Module):
    """Non-causal SDPA: padding the sequence would change the real tokens' outputs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 97)

    def forward(self, ids, labels):
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


def bidirectional():
    torch.manual_seed(0)
    return Bidirectional()


class _InPlaceBase(torch.nn.Module):
    """Embedding + causal self-attention + LM head, with hooks for in-place ops that Dynamo records
    with unused results (what the passes must neither drop nor read around)."""
    variant = ""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 16)
        self.pos = torch.nn.Embedding(64, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.router = torch.nn.Linear(16, 4)
        self.head = torch.nn.Linear(16, 97, bias=False)

    def forward(self, ids, labels):
        seq = ids.shape[1]
        positions = torch.arange(seq)
        if self.variant == "positions":
            positions.add_(1)  # written after it is made: a shard of the old value would be wrong
        h = self.emb(ids) + self.pos(positions)
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.variant == "mask":
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()
            mask[seq // 2:, : seq // 4] = False  # no longer causal: must not be folded as if it were
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        if self.variant == "scatter":
            # an MoE-style top-1 gate built with scatter_ (its result unused, as in Glm4Moe's router)
            scores = self.router(h).sigmoid()
            gate = torch.zeros_like(scores)
            gate.scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
            h = h * (scores * gate).sum(-1, keepdim=True)
        logits = self.head(h)
        if self.variant == "logits":
            logits.mul_(0.5)  # a temperature applied in place: the fused loss must not drop it
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


class InPlaceScatter(_InPlaceBase):
    variant = "scatter"


class InPlaceLogits(_InPlaceBase):
    variant = "logits"


class InPlaceMask(_InPlaceBase):
    variant = "mask"


class InPlacePositions(_InPlaceBase):
    variant = "positions"


class PositionwiseMinMax(torch.nn.Module):
    """``ones_like``, binary ``torch.max``/``minimum``, ``max(dim=-1)`` and ``min(dim=-1)`` on the hidden
    states (as in xIELU-style activations and MoE routers): position-wise, so shardable."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 97, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = torch.max(h, torch.ones_like(h) * -0.5) + torch.min(h, dim=-1, keepdim=True)[0]
        h = h - h.max(-1).values.unsqueeze(-1) * 0.1
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 97), labels.view(-1))


class UnequalHeadWidths(torch.nn.Module):
    """Causal SDPA whose values are narrower (DeepSeek's latent attention: q/k 12 wide, v 8) or wider than its
    queries and keys: the ring pads the narrower side with zeros and slices the output back."""

    def __init__(self, qk_dim: int, v_dim: int):
        super().__init__()
        torch.manual_seed(0)
        self.qk_dim, self.v_dim = qk_dim, v_dim
        self.emb = torch.nn.Embedding(97, 16)
        self.qk = torch.nn.Linear(16, 2 * 2 * qk_dim)
        self.v = torch.nn.Linear(16, 2 * v_dim)
        self.out = torch.nn.Linear(2 * v_dim, 16)
        self.head = torch.nn.Linear(16, 97)

    def forward(self, ids, labels):
        h = self.emb(ids)
        q, k = self.qk(h).view(*ids.shape, 2, 2, self.qk_dim).permute(2, 0, 3, 1, 4)
        v = self.v(h).view(*ids.shape, 2, self.v_dim).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(*ids.shape, 2 * self.v_dim))
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 97), labels.view(-1))


def narrow_values():
    return UnequalHeadWidths(12, 8)


def wide_values():
    return UnequalHeadWidths(4, 8)


class _OneAttention(torch.nn.Module):
    """Embedding, one 2-head attention's projections, LM head (seeded)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 97)


class QueryKeyPadded(_OneAttention):
    """Called like an HF model (``input_ids``, ``labels``, ``attention_mask``), but its mask hides padded
    queries as well as padded keys: not the key padding burstc takes as runtime data, causal only when the
    attention_mask is all ones (exercises the all-ones specialization and its unsharded fallback)."""

    def forward(self, input_ids, labels, attention_mask, use_cache=False):
        batch, seq = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).view(batch, seq, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        valid = attention_mask.bool()
        allowed = causal[None, None] & valid[:, None, :, None] & valid[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + out.transpose(1, 2).reshape(batch, seq, 16)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))
        return type("Output", (), {"loss": loss})()


def query_key_padded():
    return QueryKeyPadded()


class DocumentIdsMasked(_OneAttention):
    """Takes the document id of every token (``doc_ids`` ``[B, S]``, any integers) and builds its own SDPA
    mask from them: causal within a document."""

    def forward(self, ids, labels, doc_ids):
        batch, seq = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(batch, seq, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
        same_document = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal & same_document)
        h = h + out.transpose(1, 2).reshape(batch, seq, 16)
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 97), labels.view(-1))


def document_ids_masked():
    return DocumentIdsMasked()


def document_ids_inputs():
    """Two rows of 32 tokens with unsorted document ids (a document may resume after another)."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 97, (2, 32), generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 6 + [0] * 4 + [2] * 12, [5] * 3 + [7] * 20 + [5] * 9])
    return ids, doc_ids


def document_ids_loss(model, inputs):
    ids, doc_ids = inputs
    return model(ids, ids.roll(-1, dims=1), doc_ids)
