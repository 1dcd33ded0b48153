"""The shard pass's refusal codes: one per family of reasons, each with its one-line meaning.

Every refusal makes the whole graph run unsharded (replicated on every rank); the code says why in a
form tests and tools can match, the reason names the specifics."""
from __future__ import annotations

from burstc.refusals import register_codes

CODES = register_codes("shard", {
    "sequence_length": "no token-index input, or token-index inputs that disagree on the sequence length",
    "dynamic_length": "a symbolic sequence length (dynamic shapes): the rewrite plans for a concrete length",
    "mixes_positions": "an op mixes sequence positions (softmax, linear, norm or repeat along the sequence)",
    "reduces_sequence": "a reduction other than a sum (mean, max, ...) over the sequence dim or over all dims, or a "
                        "sum over them while the layout pads the sequence of a value not laid out as the token rows "
                        "(sums are all-reduced, their pad rows masked first)",
    "slices_sequence": "a slice, index or split of the sequence dim, or tensor indexing of a sharded value",
    "cat_sequence": "a cat along the sequence dim",
    "contracts_sequence": "a matmul contracting over the sequence dim or pairing differently sharded operands",
    "misaligned_operands": "operands sharded along different dims, or a replicated operand that does not "
                           "line up with the sequence",
    "reshapes_sequence": "a reshape that merges or splits the sequence dim in a way the pass cannot follow",
    "merged_rows": "an op (or output) on merged batch and sequence rows that the pass does not support",
    "dropout_in_training": "dropout with p > 0 in training (random masks can't match one device)",
    "attention_mask": "attention with a mask the ring-attention op does not support",
    "attention_operands": "attention operands that are not sharded [B, H, S, D] tensors",
    "unsupported_op": "an op, submodule call or tuple the shard pass has no rule for meets a sharded value",
    "loss_targets": "loss targets that are already sharded or do not line up with the tokens",
    "loss_arguments": "a loss call the pass cannot shard (logits layout, class weights, legacy or "
                      "non-constant arguments)",
    "inplace_write": "an in-place write that sharding would lose or misplace",
    "replicated_gradients": "a replicated value needing gradients meets the loss or an output; its gradient "
                            "would be counted once per rank",
    "no_sequence_work": "no attention or loss over the sequence: nothing worth sharding",
    "analysis_failed": "the shard analysis raised an unexpected error (a bug to report)",
    "padding_not_exact": "the length is not a multiple of what the layout needs and a real token could see the "
                         "pads the layout would add (attention with no causal, document or key-padding term)",
})
