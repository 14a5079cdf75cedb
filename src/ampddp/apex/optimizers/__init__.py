"""apex.optimizers on native torch: FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad.

apex-era scripts build these optimizers by name (``from apex.optimizers import FusedAdam``), but apex's
versions need its compiled CUDA extension (``amp_C``) and run nowhere else. The classes here keep
apex's constructor signatures (names, defaults, order) and the update rules of apex's CUDA kernels,
on torch's multi-tensor kernels, on any device:

* FusedSGD, FusedAdam, FusedAdagrad subclass ``torch.optim.SGD`` / ``Adam`` / ``Adagrad`` and step
  through torch's own update functions (``foreach`` on the CPU, ``fused`` on CUDA) wherever apex's
  rule is torch's; the modes torch lacks (``wd_after_momentum``, ``bias_correction=False``,
  ``adagrad_w_mode``) are written with ``torch._foreach_*`` ops.
* FusedLAMB and FusedNovoGrad (no torch counterpart) are written with ``torch._foreach_*`` ops, with
  apex's kernel math: LAMB's global-norm clipping and trust ratio, NovoGrad's per-tensor second
  moment kept as a norm.

fp16/bf16 params are updated in fp32 and rounded back, as apex's kernels do; their optimizer state
is fp32 (apex kept LAMB/NovoGrad/SGD state in the param's dtype) and stays fp32 through
``load_state_dict``. apex arguments that cannot be honoured raise an error saying why; bad values
raise :class:`ampddp.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.apex.optimizers._base import RefusedOptionError  # noqa: F401 - apex had no such class; tests and users catch it here
from ampddp.apex.optimizers.fused_adagrad import FusedAdagrad
from ampddp.apex.optimizers.fused_adam import FusedAdam
from ampddp.apex.optimizers.fused_lamb import FusedLAMB
from ampddp.apex.optimizers.fused_novograd import FusedNovoGrad
from ampddp.apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]

REPLACEMENTS = {
    "FusedMixedPrecisionLamb": "apex.optimizers.FusedLAMB, which does its math in fp32 for fp16/bf16 params; for fp32 master "
    "weights run it under amp.initialize(model, optimizer, opt_level='O2') (or 'O5' for bf16)",
    "DistributedFusedAdam": "torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=apex.optimizers.FusedAdam, ...) "
    "(sharded optimizer state), or apex.optimizers.FusedAdam on a DistributedDataParallel model",
    "DistributedFusedLAMB": "apex.optimizers.FusedLAMB on a DistributedDataParallel model (under ZeroRedundancyOptimizer LAMB's "
    "max_grad_norm clipping would see only each rank's shard of the gradients)",
    "FP16_Optimizer": "apex.fp16_utils.FP16_Optimizer, or amp.initialize(model, optimizer, opt_level='O2')",
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
