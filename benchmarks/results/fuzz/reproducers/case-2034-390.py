"""burstc fuzz reproducer (mismatch): P=2 gen:manual/learned/H1kv1 key_padding window=17 cap=50.0 moe_sorted(k=1) div/ce_mean | B1xS48 pad-right[44] | {'backend': 'aot_eager', 'layout': 'striped', 'attention_plan': 'auto'}

marginal mismatch
rank 0 {'backend': 'aot_eager', 'layout': 'striped', 'attention_plan': 'auto'} vs eager: [('grad:blocks.0.mlp.router.weight', 1.2727306266312155e-05)] (loss 4.011727333068848 vs eager 4.01172733306884
rank 1 {'backend': 'aot_eager', 'layout': 'striped', 'attention_plan': 'auto'} vs eager: [('grad:blocks.0.mlp.router.weight', 1.2727306266312155e-05)] (loss 4.011727333068848 vs eager 4.01172733306884

Run: python case-2034-390.py   (spawns 2 gloo ranks; exits 1 while the failure reproduces)
"""
import sys

from burstc.testing.fuzz import Case, reproduce
from burstc.testing.fuzz_models import HFSpec, InputSpec, ModelSpec  # noqa: F401 (the case's repr uses them)

CASE = Case(model=ModelSpec(vocab=61, dim=24, layers=2, heads=1, kv_heads=1, head_dim=8, attention='manual', mask_source='buffer', mask_fill='finfo.min', masked_fill=True, softmax_fp32=True, gqa='repeat_kv', qkv_bias=False, qk_norm=False, score_softcap=50.0, alibi=False, window=17, documents=False, document_ids_input=False, key_padding=True, positions='learned', norm='layer', mlp='moe_sorted', moe_top_k=1, tied=True, head_bias=False, logits_op='div', loss='ce_mean', sequence_term='none'), inputs=InputSpec(batch=1, seq=48, documents=(), padding='right', pad_lengths=(44,), ignore='none', seed=38090), world_size=2, options=(('backend', 'aot_eager'), ('layout', 'striped'), ('attention_plan', 'auto')), alternative=None, seed=0, precision='fp32')

if __name__ == "__main__":
    sys.exit(reproduce(CASE))
