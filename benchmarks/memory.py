"""Bytes per parameter held for params, grads, fp32 masters and optimizer state, per mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import Budget, Row
from loops import batch, many_layer_mlp, sgd

from ampddp import build_engine

# SGD with momentum: what each mode should hold per parameter at its fullest point of a step.
FP32 = 4 + 4 + 4  # param, grad, momentum: every mode whose weights stay fp32 (autocast casts on the fly)
MASTERED = 2 + 2 + 4 + 4 + 4  # low-precision param and grad, fp32 master, master grad, momentum
THEORY = {"O0": FP32, "O1": FP32, "O2": MASTERED, "O3": 2 + 2 + 2, "O4": FP32, "O5": MASTERED, "native-fp16": FP32, "native-bf16": FP32}


def _held_bytes(model, optimizer, engine) -> int:
    tensors = {}
    for p in model.parameters():
        tensors[id(p)] = p
        if p.grad is not None:
            tensors[id(p.grad)] = p.grad
    for p in engine.master_params(optimizer):
        tensors[id(p)] = p
        if p.grad is not None:
            tensors[id(p.grad)] = p.grad
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run(device: str, budget: Budget) -> list[Row]:
    rows = []
    x, y = batch(32, device)
    for mode, theory in THEORY.items():
        model = many_layer_mlp().to(device)
        count = sum(p.numel() for p in model.parameters())
        optimizer = sgd(model.parameters())
        engine = build_engine(mode, **({"verbosity": 0} if mode.startswith("O") else {}))
        engine.setup([model], [optimizer])
        peak = 0
        for _ in range(2):
            with engine.forward_context():
                loss = F.cross_entropy(model(x).float(), y)
            engine.backward(loss)
            peak = max(peak, _held_bytes(model, optimizer, engine))
            engine.unscale_(optimizer)
            peak = max(peak, _held_bytes(model, optimizer, engine))
            engine.step(optimizer)
        measured = peak / count
        note = "fp16 model grads are freed once unscaled into the masters" if mode in ("O2", "O5") else ""
        rows.append(Row(f"memory/bytes-per-param/{mode}", measured, float(theory), "bytes/param", theory / measured, 1, 0.0, note))
    return rows
