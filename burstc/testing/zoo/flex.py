"""A small decoder whose attention is FlexAttention with a block mask built in ``forward`` (torchtitan's
``flex`` attention path: causal, sliding-window or ``block_causal`` document masks from document ids).

On CPU torch has no FlexAttention backward kernel and refuses ``requires_grad`` inputs; the eager reference
here lifts that check (:func:`cpu_flex_backward`), which makes torch run its dense math backward — the
single-device oracle the sharded model is compared with."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 97, 32, 4, 2, 2
WINDOW = 6


def _mask_mod(kind: str, doc_ids):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def block_causal(b, h, q_idx, kv_idx):  # torchtitan's document mask: ids per batch row
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return {"causal": causal, "window": window, "documents": block_causal, "eos_documents": block_causal,
            "eos_documents_late": block_causal, "hidden_documents": block_causal}[kind]


EOS_ID = 0


def eos_document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """torchtitan's document ids (``_get_document_mask_mod``): a document ends at each EOS token, so the ids
    count the EOS tokens before each position; computed inside ``forward`` from the token inputs."""
    mask = tokens == eos_id
    mask[:, -1] = True
    acc_mask = torch.cumsum(torch.where(mask, 1, 0), dim=1)
    seq_idx = torch.zeros_like(acc_mask, dtype=torch.int32)
    seq_idx[:, 1:] = acc_mask[:, :-1]
    return seq_idx


SOFT_CAP = 20.0
ALIBI_SLOPES = (0.5, 0.25, 0.125, 0.0625)


def _score_mod(kind: str | None):
    def soft_cap(score, b, h, q_idx, kv_idx):  # Gemma-2's cap, as a score_mod
        return SOFT_CAP * torch.tanh(score / SOFT_CAP)

    slopes = torch.tensor(ALIBI_SLOPES)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return {None: None, "softcap": soft_cap, "alibi": alibi}[kind]


class FlexDecoder(nn.Module):
    def __init__(self, mask: str = "causal", score: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.mask, self.score = mask, score
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * DIM // HEADS) for _ in range(LAYERS))
        self.proj = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, labels, doc_ids=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        B, S = ids.shape
        d = DIM // HEADS
        h = self.emb(ids) if self.mask == "eos_documents_late" else None  # sharded before the ids are known
        if self.mask in ("eos_documents", "eos_documents_late"):
            doc_ids = eos_document_ids(ids, EOS_ID)
        elif self.mask == "hidden_documents":
            # not document ids: a value of the activations (sharded over the sequence), compared like them
            doc_ids = (self.emb(ids).sum(-1) > 0).cumsum(-1)
        block_mask = create_block_mask(_mask_mod(self.mask, doc_ids), B, None, S, S, device=ids.device)
        h = self.emb(ids) if h is None else h
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(h).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
            q = q.view(B, S, HEADS, d).transpose(1, 2)
            k = k.view(B, S, KV_HEADS, d).transpose(1, 2)
            v = v.view(B, S, KV_HEADS, d).transpose(1, 2)
            a = flex_attention(q, k, v, score_mod=_score_mod(self.score), block_mask=block_mask, enable_gqa=True)
            h = h + proj(a.transpose(1, 2).reshape(B, S, DIM))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def flex_decoder(mask: str = "causal", score: str | None = None) -> FlexDecoder:
    return FlexDecoder(mask, score)


def flex_inputs(batch: int = 2, seq: int = 32):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    # documents of uneven lengths, different per row (torchtitan's ids: 0, 0, ..., 1, 1, ...)
    doc_ids = torch.stack([torch.cumsum((torch.rand(seq, generator=g) < 0.15).to(torch.int64), 0)
                           for _ in range(batch)])
    return ids, doc_ids


@contextlib.contextmanager
def cpu_flex_backward():
    """Let eager FlexAttention take ``requires_grad`` inputs on CPU (torch's dense math backward)."""
    import torch.nn.attention.flex_attention as flex

    original = flex._validate_device
    flex._validate_device = lambda q, k, v: None
    try:
        yield
    finally:
        flex._validate_device = original


def flex_loss(model, inputs):
    """The loss of ``model`` (compiled by burstc, or the eager reference under :func:`cpu_flex_backward`)."""
    ids, doc_ids = inputs
    labels = ids.roll(-1, dims=1)
    eager = not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    with cpu_flex_backward() if eager else contextlib.nullcontext():
        return model(ids, labels, doc_ids)


def flex_eos_inputs(batch: int = 2, seq: int = 32):
    """Token rows with EOS tokens (id 0) at uneven places, different per row (the documents a model computing
    its ids from them sees); no document-id input."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    ids[torch.rand(batch, seq, generator=g) < 0.15] = EOS_ID
    return ids, None


flex_causal = functools.partial(flex_decoder, "causal")
flex_window = functools.partial(flex_decoder, "window")
flex_documents = functools.partial(flex_decoder, "documents")
flex_soft_capped = functools.partial(flex_decoder, "documents", "softcap")
flex_alibi = functools.partial(flex_decoder, "causal", "alibi")
flex_eos_documents = functools.partial(flex_decoder, "eos_documents")
flex_eos_documents_late = functools.partial(flex_decoder, "eos_documents_late")
flex_hidden_documents = functools.partial(flex_decoder, "hidden_documents")
