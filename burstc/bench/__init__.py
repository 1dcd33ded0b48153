"""``burstc bench``, shipped with the package so that it runs from a plain ``pip install burstc``:

- :mod:`burstc.bench.end_to_end`: one full training step of a tiny HF Llama, burstc against its peers;
- :mod:`burstc.bench.peers`: the peers' sequence-parallel attention (PyTorch's own ring, all-gather K/V) and the
  bytes each sends, shared with the per-op benchmarks of the source checkout (``benchmarks/ring_attention.py``).

The model comes from ``transformers`` and the lucidrains row from ``ring-attention-pytorch``:
``pip install 'burstc[bench]'``.
"""
