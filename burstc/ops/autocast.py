"""burstc's ops under ``torch.autocast``: the same casts as the torch ops they replace, nothing inside.

The rewrites replace ops that autocast runs in lower precision (``scaled_dot_product_attention``,
``linear``) by custom ops, which autocast would otherwise pass through uncast: q in fp32 next to v in
bf16 (RoPE promotes q and k), or an fp32 LM head where eager computed bf16 logits.  So:

- :func:`register_lower_precision` gives a custom op autocast's lower-precision rule, with the
  dtype of the enclosing ``torch.autocast`` region (``torch.library.register_autocast`` fixes one
  dtype at registration): floating inputs at the given positions are cast, then the op runs with
  autocast off;
- :func:`without_autocast` wraps an op's implementation so that its own matmuls never get
  autocast's casts (fp32 accumulators stay fp32), in the forward and in a backward that autograd
  runs with the forward's autocast state.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

_DEVICE_TYPES = ("cpu", "cuda")
_LIBRARIES: list = []  # a registration lives as long as its Library object


def cast_like_lower_precision(tensors, device_type: str):
    """``tensors`` as autocast hands them to a lower-precision op inside an enabled region on
    ``device_type`` (floating tensors on that device cast to the region's dtype), else unchanged."""
    if device_type not in _DEVICE_TYPES or not torch.is_autocast_enabled(device_type):  # "meta": no autocast
        return tuple(tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.device.type == device_type
                 else t for t in tensors)


def register_lower_precision(op, positions: tuple[int, ...]) -> None:
    """Autocast rule for custom op ``op`` (a ``torch.library`` custom op): cast the floating tensors at
    ``positions`` to the region's dtype, then run the op below autocast."""
    overload = op._opoverload
    namespace, name = overload._schema.name.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(library)
    for device_type in _DEVICE_TYPES:
        if not torch.amp.is_autocast_available(device_type):
            continue
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        dispatch_key = getattr(torch._C.DispatchKey, key_name)

        def cast_then_run(*args, device_type=device_type, dispatch_key=dispatch_key):
            cast = cast_like_lower_precision([args[i] for i in positions], device_type)
            args = list(args)
            for i, value in zip(positions, cast):
                args[i] = value
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(dispatch_key)):
                return overload(*args)

        if overload.has_kernel_for_dispatch_key(dispatch_key):
            overload.py_kernels.pop(dispatch_key, None)
        overload.py_impl(dispatch_key)(cast_then_run)  # the Python dispatcher (tracing) takes this one
        library.impl(name, lambda _keyset, *args, run=cast_then_run: run(*args), key_name, with_keyset=True)


def without_autocast(fn):
    """Run ``fn`` (an op implementation) with autocast off on the devices of its tensor arguments."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, Tensor)}
        with contextlib.ExitStack() as stack:
            for device_type in devices & set(_DEVICE_TYPES):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            return fn(*args, **kwargs)

    return run
