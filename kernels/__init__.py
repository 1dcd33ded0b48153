"""burstc.kernels: the fused LM-head + cross-entropy kernels (chunked torch, Triton). Installed as ``burstc.kernels``.

From a checkout, ``python -m pytest`` / ``python -c`` put the repository root on sys.path first, where this folder
would shadow the Hugging Face ``kernels`` distribution that transformers (>= 5.25) depends on and imports: its
``from kernels import ...`` would then fail inside ``import transformers``. Imported under that top-level name,
this module steps aside and loads the installed ``kernels`` in its place (the import system hands the importer
whatever ``sys.modules["kernels"]`` holds once this body has run); where none is installed it stays empty.
"""
if __name__ == "kernels":
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec

    def _load_installed_kernels() -> None:
        checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
        elsewhere = [entry for entry in _sys.path if _os.path.abspath(entry or _os.curdir) != checkout_root]
        spec = _PathFinder.find_spec("kernels", elsewhere)
        if spec is None or spec.loader is None:
            return
        this_module = _sys.modules["kernels"]
        module = _module_from_spec(spec)
        _sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            _sys.modules["kernels"] = this_module
            raise

    _load_installed_kernels()
