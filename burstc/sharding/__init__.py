"""Sequence-parallel analysis for the ``shard`` pass: typed placements, refusal codes, the op rules
and the analyzer that applies them to a Dynamo graph (the rewrite lives in ``burstc.passes.shard``)."""
