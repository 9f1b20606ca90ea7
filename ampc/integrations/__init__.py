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
