"""ampc inside the frameworks people train with.

Each submodule imports its framework, so import the one you use:

- ``ampc.integrations.lightning``: ``AmpcPrecision``, a precision plugin for Lightning's
  ``Trainer(plugins=[...])`` (and ``AmpcFabricPrecision`` for ``Fabric``).
- ``ampc.integrations.accelerate``: ``use_ampc(accelerator)``, ampc's autocast and scaler in an
  ``Accelerator`` (and under the transformers ``Trainer``).
- ``ampc.integrations.torchtitan``: a model converter to ``ampc.fp8`` layers and ampc's
  master-weight AdamW as the optimizer.

This package itself imports nothing, so ``import ampc`` never loads a framework.
"""
import importlib

_FRAMEWORKS = ("lightning", "accelerate", "torchtitan")


def __getattr__(name):
    # ampc.integrations.lightning works after a plain import; the framework loads only then
    if name in _FRAMEWORKS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ampc.integrations' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_FRAMEWORKS))
