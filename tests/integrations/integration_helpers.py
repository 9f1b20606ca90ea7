"""What the framework tests share: importing a framework that may be absent, small data."""
import importlib
import os

import pytest
import torch


def need(module):
    """Imports `module`, or skips the test file without it; under CI (which installs the
    frameworks with scripts/setup.sh) a missing framework fails instead."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            raise RuntimeError(f"{module} is not installed, and CI is set: "
                               "scripts/setup.sh installs it") from e
        pytest.skip(f"needs {module}", allow_module_level=True)


def regression_data(n=48, features=16, outputs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randn(n, outputs, generator=g)


def regression_step(module, batch):
    """A training step's loss: ``module.net``'s mean squared error on ``batch``, kept in
    ``module.losses``."""
    x, y = batch
    loss = torch.nn.functional.mse_loss(module.net(x).float(), y)
    module.losses.append(loss.detach().clone())
    return loss


def state_bytes(optimizer):
    """Bytes of the tensors in the optimizer's state."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))


def param_bytes(params):
    return sum(p.numel() * p.element_size() for p in params)
