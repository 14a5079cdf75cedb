"""Train a small MLP on scikit-learn's handwritten digits at any ampddp precision mode.

    python examples/train_digits.py --mode O2
    python examples/train_digits.py --mode native-bf16 --epochs 20

The digits (1,797 8x8 images, 10 classes) ship inside scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from ampddp import PRECISION_MODES, build_engine


def load_data(device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(images / 16.0, labels, test_size=0.25, random_state=seed, stratify=labels)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long, device=device)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


@torch.no_grad()
def accuracy(model: nn.Module, engine, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with engine.forward_context():
        predictions = model(x).argmax(1)
    model.train()
    return (predictions == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="O2", choices=PRECISION_MODES, help="precision mode (default: O2)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x_train, y_train, x_test, y_test = load_data(device, args.seed)
    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    engine = build_engine(args.mode)
    engine.setup([model], [optimizer])
    print(f"mode {args.mode} on {device}: {len(x_train)} training and {len(x_test)} held-out digits")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train), device=device)
        total = 0.0
        for batch in order.split(args.batch_size):
            optimizer.zero_grad()
            with engine.forward_context():
                loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            engine.backward(loss)
            engine.clip_grad_norm_([optimizer], max_norm=5.0)
            engine.step(optimizer)
            total += loss.item() * len(batch)
        print(
            f"epoch {epoch:3d}  loss {total / len(x_train):.4f}  held-out acc {accuracy(model, engine, x_test, y_test):.4f}  "
            f"loss scale {engine.loss_scale():g}  skipped steps {engine.skipped_steps}"
        )
    print(f"done in {time.perf_counter() - start:.1f}s: held-out accuracy {accuracy(model, engine, x_test, y_test):.4f}")


if __name__ == "__main__":
    main()
