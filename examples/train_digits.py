"""Train a small MLP on scikit-learn's handwritten digits at any ampddp precision mode, on 1..N processes.

    python examples/train_digits.py --mode O2
    python examples/train_digits.py --mode native-bf16 --nproc-per-node 2
    torchrun --nproc-per-node 2 examples/train_digits.py --mode O1 --sync-bn auto

The digits (1,797 8x8 images, 10 classes) ship inside scikit-learn, so nothing is downloaded.
Under torchrun, SLURM (srun) or --nproc-per-node, each process trains on its shard with DDP, and
the held-out accuracy counts every test image exactly once.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampddp import PRECISION_MODES
from ampddp.choices import STRATEGIES, SYNC_BN_CHOICES
from ampddp.distributed import (
    DistEnv,
    Parallel,
    PeerWatch,
    ResumableSampler,
    eval_sampler,
    global_batch_loss_weight,
    launch_local,
    print_main,
    seed_everything,
    setup_distributed,
    shutdown_distributed,
    sum_across_ranks,
)
from ampddp.prepare import prepare


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(images / 16.0, labels, test_size=0.25, random_state=seed, stratify=labels)

    def as_dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))

    return as_dataset(x_train, y_train), as_dataset(x_test, y_test)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


@torch.no_grad()
def evaluate(prepared, loader: DataLoader) -> tuple[float, int]:
    """Accuracy over the whole held-out set: each rank scores its unpadded shard, counts are summed."""
    prepared.model.eval()
    correct = seen = 0
    for x, y in loader:
        x, y = x.to(prepared.env.device), y.to(prepared.env.device)
        with prepared.engine.forward_context():
            correct += (prepared.model(x).argmax(1) == y).sum().item()
        seen += len(y)
    prepared.model.train()
    totals = sum_across_ranks(torch.tensor([correct, seen], dtype=torch.float64))
    return (totals[0] / totals[1]).item(), int(totals[1].item())


def train(env: DistEnv, args: argparse.Namespace) -> float:
    seed_everything(args.seed)
    train_set, test_set = load_data(args.seed)
    prepared = prepare(
        make_model(args.hidden),
        lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4),
        env,
        precision=args.mode,
        parallel=Parallel(strategy=args.strategy, sync_bn=args.sync_bn),
    )
    torch.manual_seed(env.rank_seed(args.seed))
    sampler = ResumableSampler(train_set, env, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=eval_sampler(test_set, env))
    print_main(env, f"mode {args.mode}, {env.describe()}: {len(train_set)} training and {len(test_set)} held-out digits")

    with PeerWatch(env) as watch, watch.guard():
        return run_epochs(prepared, sampler, train_loader, test_loader, args)


def run_epochs(prepared, sampler, train_loader: DataLoader, test_loader: DataLoader, args: argparse.Namespace) -> float:
    env, engine, optimizer = prepared.env, prepared.engine, prepared.optimizer
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        total = 0.0
        for x, y in train_loader:
            x, y = x.to(env.device), y.to(env.device)
            optimizer.zero_grad()
            with engine.forward_context():
                loss = F.cross_entropy(prepared.model(x), y)
            engine.backward(loss * global_batch_loss_weight(len(y), env))
            engine.clip_grad_norm_([optimizer], max_norm=5.0)
            engine.step(optimizer)
            total += loss.item() * len(y)
        accuracy, _ = evaluate(prepared, test_loader)
        mean_loss = float(sum_across_ranks(total).item()) / len(train_loader.dataset)
        print_main(
            env,
            f"epoch {epoch:3d}  loss {mean_loss:.4f}  held-out acc {accuracy:.4f}  "
            f"loss scale {engine.loss_scale():g}  skipped steps {engine.skipped_steps}",
        )
    accuracy, seen = evaluate(prepared, test_loader)
    print_main(env, f"done in {time.perf_counter() - start:.1f}s: held-out accuracy {accuracy:.4f} over {seen} digits")
    return accuracy


def _spawned(env: DistEnv, args: argparse.Namespace) -> float:
    return train(env, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="O2", choices=PRECISION_MODES, help="precision mode (default: O2)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES)
    parser.add_argument("--sync-bn", default="off", choices=SYNC_BN_CHOICES)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="spawn this many local processes (when not under torchrun/SLURM)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung collective fails")
    args = parser.parse_args()

    if args.nproc_per_node > 1:
        launch_local(_spawned, args.nproc_per_node, (args,), device=args.device, timeout_s=args.timeout)
        return
    env = setup_distributed(device=args.device, timeout_s=args.timeout)
    try:
        train(env, args)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
