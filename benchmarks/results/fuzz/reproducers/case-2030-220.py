"""burstc fuzz reproducer (crash): P=2 hf:FalconH1/sdpa | B2xS1 | {'backend': 'aot_eager', 'layout': 'auto', 'attention_plan': 'burst'}

rank 0 {'backend': 'aot_eager', 'layout': 'auto', 'attention_plan': 'burst'}: RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension spans across two con
ib/python3.11/site-packages/torch/_dynamo/eval_frame.py", line 1446, in _fn
    return fn(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/aot_autograd.py", line 1277, in forward
    return compiled_fn(full_args)
           ^^^^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py", line 1141, in runtime_wrapper
    result = _codegen_runtime_wrapper(
             ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/subclass_codegen.py:codegen(runtime_wrapper_orchestration)", line 11, in _runtime_wrapper
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/utils.py", line 93, in g
    return f(*args)
           ^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/autograd/function.py", line 625, in apply
    return super().apply(*args, **kwargs)  # type: ignore[misc]
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py", line 3462, in forward
    return CompiledFunction._fwd_fn(
           ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/subclass_codegen.py:codegen(compiled_function_forward)", line 2, in _compiled_forward
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/utils.py", line 93, in g
    return f(*args)
           ^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/fx/_lazy_graph_module.py", line 134, in _lazy_forward
    return self(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^
  File "/work/venv-fuzz29/lib/python3.11/site-packages/torch/fx/graph_module.py", line 1000, in call_wrapped
    return self._wrapped_call(self, *args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

Run: python case-2030-220.py   (spawns 2 gloo ranks; exits 1 while the failure reproduces)
"""
import sys

from burstc.testing.fuzz import Case, reproduce
from burstc.testing.fuzz_models import HFSpec, InputSpec, ModelSpec  # noqa: F401 (the case's repr uses them)

CASE = Case(model=HFSpec(config_name='FalconH1Config', impl='sdpa', overrides=(), checkpointing=False), inputs=InputSpec(batch=2, seq=1, documents=(), padding='none', pad_lengths=(), ignore='none', seed=63050), world_size=2, options=(('backend', 'aot_eager'), ('layout', 'auto'), ('attention_plan', 'burst')), alternative=None, seed=0, precision='fp32')

if __name__ == "__main__":
    sys.exit(reproduce(CASE))
