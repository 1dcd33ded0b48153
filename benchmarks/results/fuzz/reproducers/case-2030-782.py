"""burstc fuzz reproducer (mismatch): P=2 hf:Starcoder2/eager {'sliding_window': 18} bf16 | B1xS33 pad-left[23] | {'backend': 'aot_eager', 'layout': 'contiguous', 'attention_plan': 'kv_ring'}

marginal mismatch
rank 0 {'backend': 'aot_eager', 'layout': 'contiguous', 'attention_plan': 'kv_ring'} vs eager: [('grad:model.layers.0.input_layernorm.bias', 0.030120481927710843)] (loss 4.568870544433594 vs eager 4.5
rank 1 {'backend': 'aot_eager', 'layout': 'contiguous', 'attention_plan': 'kv_ring'} vs eager: [('grad:model.layers.0.input_layernorm.bias', 0.030120481927710843)] (loss 4.568870544433594 vs eager 4.5

Run: python case-2030-782.py   (spawns 2 gloo ranks; exits 1 while the failure reproduces)
"""
import sys

from burstc.testing.fuzz import Case, reproduce
from burstc.testing.fuzz_models import HFSpec, InputSpec, ModelSpec  # noqa: F401 (the case's repr uses them)

CASE = Case(model=HFSpec(config_name='Starcoder2Config', impl='eager', overrides=(('sliding_window', 18),), checkpointing=False), inputs=InputSpec(batch=1, seq=33, documents=(), padding='left', pad_lengths=(23,), ignore='none', seed=21821), world_size=2, options=(('backend', 'aot_eager'), ('layout', 'contiguous'), ('attention_plan', 'kv_ring')), alternative=None, seed=0, precision='bf16')

if __name__ == "__main__":
    sys.exit(reproduce(CASE))
