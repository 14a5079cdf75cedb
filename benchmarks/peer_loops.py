"""The contenders of benchmarks/peers.py: one training loop each, on the same model, data, order and AdamW.

Every builder takes a ``Setting`` (the work, the precision, the device, the ranks) and returns a
``Runner``: ``train_epoch()`` trains one pass over the rank's batches (a round of the benchmark)
and calls ``meter.tick()`` after every optimizer step; ``module`` is the bare model whose weights
the final-loss check reads. Peers are imported inside their builders, so this module imports
without them.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler, TensorDataset

LR = 1e-3
AMPDDP_MODE = {"fp32": "O0", "bf16": "native-bf16", "o5": "O5", "fp16": "native-fp16", "o2": "O2"}
FACADE_LEVEL = {"fp32": "O0", "bf16": "O4", "o5": "O5", "fp16": "O1", "o2": "O2"}
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "o5": "bf16-true", "fp16": "16-mixed"}
ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
MASTERS = {"o5": torch.bfloat16, "o2": torch.float16}


def adamw(params) -> torch.optim.Optimizer:
    """Every contender's optimizer (torch's defaults otherwise: weight decay 0.01, the for-loop kernel on CPU)."""
    return torch.optim.AdamW(params, lr=LR)


def loss_of(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, in fp32 whatever the model computed in."""
    return F.cross_entropy(outputs.float().flatten(0, -2), labels.flatten())


class Meter:
    """Wall time, process CPU time and minor page faults at the end of every optimizer step."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.ticks: list[tuple[float, float, int]] = []

    def tick(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.ticks.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt))

    def take(self) -> tuple[float, float, float]:
        """Seconds, CPU seconds and faults per step between the first and the last tick since the last
        take: what happens between steps (data, hooks, logging) counts; entering a framework's fit does not."""
        ticks, self.ticks = self.ticks, []
        if len(ticks) < 2:
            raise RuntimeError(f"a round needs at least 2 steps to be timed, it had {len(ticks)}")
        (wall0, cpu0, faults0), (wall1, cpu1, faults1) = ticks[0], ticks[-1]
        steps = len(ticks) - 1
        return (wall1 - wall0) / steps, (cpu1 - cpu0) / steps, (faults1 - faults0) / steps


@dataclass
class Setting:
    """One group of the benchmark as one rank sees it: a work at one precision on one device."""

    build: Callable[[], nn.Module]
    base: nn.Module
    inputs: torch.Tensor
    labels: torch.Tensor
    batch_size: int
    precision: str
    device: str
    rank: int = 0
    world: int = 1
    meter: Meter = field(init=False)

    def __post_init__(self) -> None:
        self.meter = Meter(self.device)

    @property
    def accelerator(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    def ampddp_env(self) -> Any:
        """ampddp's DistEnv: this process alone, or the group joined from torchrun's variables."""
        from ampddp.distributed import detect_env, setup_distributed

        return detect_env({}, device=self.device) if self.world == 1 else setup_distributed(device=self.device, timeout_s=300)

    def join(self) -> None:
        """The process group as a hand-written script joins it (torchrun's variables, ``env://``)."""
        if self.world > 1 and not dist.is_initialized():
            if self.device == "cuda":
                torch.cuda.set_device(self.rank)
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo")

    def model(self) -> nn.Module:
        """A copy of the group's initial model (every contender starts from the same weights)."""
        return copy.deepcopy(self.base)

    def dataset(self, layout: str = "strided") -> TensorDataset:
        """The samples in the order a contender's sharding needs to give every rank the same batches.

        ``strided`` (DistributedSampler, ampddp's ResumableSampler): rank r takes every world-th sample
        from r. ``blocks`` (Accelerate): rank r takes whole batches r, r + world, ...; the samples are
        laid out so that those batches hold what the strided ranks see.
        """
        if layout == "strided" or self.world == 1:
            return TensorDataset(self.inputs, self.labels)
        order = _block_order(len(self.inputs), self.batch_size, self.world)
        return TensorDataset(self.inputs[order], self.labels[order])

    def loader(self) -> DataLoader:
        """The hand-written side's loader: sequential, DistributedSampler across ranks."""
        dataset = self.dataset()
        sampler = DistributedSampler(dataset, self.world, self.rank, shuffle=False) if self.world > 1 else SequentialSampler(dataset)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


def _block_order(samples: int, batch: int, world: int) -> torch.Tensor:
    """Position p = (k * world + r) * batch + j holds sample k * world * batch + r + world * j."""
    position = torch.arange(samples)
    step, rest = position // (world * batch), position % (world * batch)
    rank, row = rest // batch, rest % batch
    return step * world * batch + rank + world * row


@dataclass
class Runner:
    name: str
    module: nn.Module
    train_epoch: Callable[[], None]
    reference: str = "hand"
    """The hand-written loop whose final loss this contender must match."""
    version: str = ""
    steps: int = 0
    """Optimizer steps its last checked round trained."""
    loss: float = float("nan")
    reference_loss: float = float("nan")
    error: str = ""


def _wrap_ddp(model: nn.Module, setting: Setting) -> nn.Module:
    if setting.world == 1:
        return model
    setting.join()
    return DistributedDataParallel(model, device_ids=[setting.rank] if setting.device == "cuda" else None)


def _placed(model: nn.Module, setting: Setting) -> nn.Module:
    setting.join()  # first: a CUDA rank takes its own GPU
    return model.to(setting.device)


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter to ``dtype`` in place (the works have no BatchNorm, which O2/O5 would keep fp32)."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)


def _low(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


# ---- the hand-written loops -------------------------------------------------------------------------
def hand(setting: Setting) -> Runner:
    """What a user writes with torch alone: fp32, autocast (+ GradScaler for fp16), or the master-copy loop."""
    if setting.precision in MASTERS:
        return _hand_masters(setting)
    model = _placed(setting.model(), setting)
    wrapped, optimizer = _wrap_ddp(model, setting), adamw(model.parameters())
    dtype = AUTOCAST.get(setting.precision)
    scaler = torch.amp.GradScaler(setting.device, enabled=dtype is torch.float16)
    loader, device, meter = setting.loader(), setting.device, setting.meter

    def train_epoch() -> None:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = loss_of(wrapped(x), y)
            if scaler.is_enabled():
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            meter.tick()

    return Runner("hand", model, train_epoch)


def _hand_masters(setting: Setting) -> Runner:
    """Low-precision weights, fp32 masters taken from the exact fp32 weights and stepped by AdamW, the
    step's result copied back. fp16 (O2) scales the loss with torch's GradScaler and skips overflowed
    steps; bf16 (O5) does neither."""
    dtype = MASTERS[setting.precision]
    model = _placed(setting.model(), setting)
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    _cast_params(model, dtype)
    wrapped, optimizer, params = _wrap_ddp(model, setting), adamw(masters), list(model.parameters())
    scaler = torch.amp.GradScaler(setting.device, enabled=dtype is torch.float16)
    loader, device, meter = setting.loader(), setting.device, setting.meter

    def train_epoch() -> None:
        for x, y in loader:
            x, y = _low(x.to(device), dtype), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss_of(wrapped(x), y)).backward()
            for master, param in zip(masters, params):
                master.grad, param.grad = param.grad.float(), None
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
            meter.tick()

    return Runner("hand", model, train_epoch)


def hand_bf16_true(setting: Setting) -> Runner:
    """bf16 weights stepped in bf16 by AdamW, no masters: what Lightning's and Fabric's "bf16-true" do,
    the reference their final loss is checked against."""
    model = _placed(setting.model(), setting)
    _cast_params(model, torch.bfloat16)
    wrapped, optimizer = _wrap_ddp(model, setting), adamw(model.parameters())
    loader, device, meter = setting.loader(), setting.device, setting.meter

    def train_epoch() -> None:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_of(wrapped(_low(x.to(device), torch.bfloat16)), y.to(device)).backward()
            optimizer.step()
            meter.tick()

    return Runner("hand-bf16-true", model, train_epoch, reference="hand-bf16-true")


# ---- ampddp -----------------------------------------------------------------------------------------
def ampddp_prepare(setting: Setting) -> Runner:
    """``prepare`` (precision set-up, then torch DDP across ranks) around the same hand-written loop."""
    return _prepared(setting, "ampddp-prepare", AMPDDP_MODE[setting.precision])


def ampddp_o5_no_masters(setting: Setting) -> Runner:
    """``prepare`` at O5 with apex's ``master_weights=False``: bf16 weights stepped in bf16 by AdamW, no fp32 masters,
    the work of Lightning's and Fabric's "bf16-true" (checked against the hand loop doing the same)."""
    from ampddp import Precision

    return _prepared(setting, "ampddp-o5-no-masters", Precision("O5", overrides={"master_weights": False}), "hand-bf16-true")


def _prepared(setting: Setting, name: str, precision: Any, reference: str = "hand") -> Runner:
    from ampddp import prepare

    run = prepare(setting.model(), adamw, setting.ampddp_env(), precision=precision)
    loader, device, meter = setting.loader(), setting.device, setting.meter

    def train_epoch() -> None:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            run.optimizer.zero_grad(set_to_none=True)
            with run.engine.forward_context():
                loss = loss_of(run.model(x), y)
            run.engine.backward(loss)
            run.engine.step(run.optimizer)
            meter.tick()

    return Runner(name, run.module, train_epoch, reference=reference)


def ampddp_trainer(setting: Setting) -> Runner:
    """ampddp's Trainer: in order (shuffle off), nothing on disk, no console or loggers, the loss
    record (and its gradient norm) only at the first step: the peers log nothing either."""
    from ampddp import Trainer
    from ampddp.training.callbacks import Callback

    meter = setting.meter

    class Tick(Callback):
        def on_step(self, progress, record) -> None:
            meter.tick()

    trainer = Trainer(setting.model(), adamw, setting.dataset(), env=setting.ampddp_env(), precision=AMPDDP_MODE[setting.precision],
                      loss_fn=lambda outputs, batch: loss_of(outputs, batch[1]), metrics=None, report=None, callbacks=[Tick()],
                      stop_signals=(), batch_size=setting.batch_size, shuffle=False, max_epochs=1, log_every=2**62)  # fmt: skip

    def train_epoch() -> None:
        trainer.settings = dataclasses.replace(trainer.settings, max_epochs=trainer.progress.epoch + 1)
        trainer.fit()

    return Runner("ampddp-trainer", trainer.run.module, train_epoch)


def amp_facade(setting: Setting) -> Runner:
    """apex's API on ampddp: ``amp.initialize`` + ``amp.scale_loss`` around the hand loop, torch DDP
    wrapped after ``initialize`` as apex's examples do (O4 is apex's bf16 op lists, not torch.autocast)."""
    from ampddp.amp import Amp

    amp = Amp()
    model = _placed(setting.model(), setting)
    model, optimizer = amp.initialize(model, adamw(model.parameters()), opt_level=FACADE_LEVEL[setting.precision], verbosity=0)
    wrapped, loader, device, meter = _wrap_ddp(model, setting), setting.loader(), setting.device, setting.meter

    def train_epoch() -> None:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(wrapped(x.to(device)), y.to(device))
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            meter.tick()

    return Runner("amp-facade", model, train_epoch)


# ---- Lightning ------------------------------------------------------------------------------------
def lightning_trainer(setting: Setting) -> Runner:
    """Lightning's Trainer (strategy "ddp" across ranks, which joins the running process group as under
    torchrun); logger, checkpoints, progress bar and model summary off; the hand loop's sequential
    DistributedSampler (``use_distributed_sampler=False``: the one it adds shuffles training data). Each
    round is one more epoch of the same Trainer; ``configure_optimizers`` hands back the same AdamW
    every fit, so its state carries on."""
    import lightning.pytorch as pl

    meter = setting.meter

    class Model(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model, self.optimizer = model, None

        def training_step(self, batch, index):
            return loss_of(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            self.optimizer = self.optimizer or adamw(self.parameters())
            return self.optimizer

    class Tick(pl.Callback):
        def on_train_batch_end(self, *args) -> None:
            meter.tick()

    model = Model(setting.model())
    trainer = pl.Trainer(accelerator=setting.accelerator, devices=setting.world, strategy="ddp" if setting.world > 1 else "auto",
                         precision=LIGHTNING_PRECISION[setting.precision], max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Tick()],
                         use_distributed_sampler=False)  # fmt: skip
    loader = setting.loader()  # its own DistributedSampler would shuffle: the Trainer shuffles training data whenever it adds one

    def train_epoch() -> None:
        trainer.fit_loop.max_epochs = trainer.current_epoch + 1
        trainer.fit(model, loader)

    return Runner("lightning-trainer", model.model, train_epoch, _bf16_true_reference(setting), pl.__version__)


def fabric(setting: Setting) -> Runner:
    """Lightning Fabric around the hand loop: ``setup``, ``setup_dataloaders``, ``backward``."""
    import lightning
    from lightning.fabric import Fabric

    runtime = Fabric(accelerator=setting.accelerator, devices=setting.world, strategy="ddp" if setting.world > 1 else "auto",
                     precision=LIGHTNING_PRECISION[setting.precision])  # fmt: skip
    runtime.launch()
    model = setting.model()
    wrapped, optimizer = runtime.setup(model, adamw(model.parameters()))
    loader = runtime.setup_dataloaders(DataLoader(setting.dataset(), batch_size=setting.batch_size, shuffle=False))
    train_epoch = _runtime_epoch(runtime, wrapped, optimizer, loader, setting.meter)
    return Runner("fabric", model, train_epoch, _bf16_true_reference(setting), lightning.__version__)


def _runtime_epoch(runtime: Any, wrapped: nn.Module, optimizer: Any, loader: Any, meter: Any) -> Callable[[], None]:
    """The hand loop with a framework's ``backward`` (Fabric's, Accelerate's): what each one's docs show."""

    def train_epoch() -> None:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            runtime.backward(loss_of(wrapped(x), y))
            optimizer.step()
            meter.tick()

    return train_epoch


def _bf16_true_reference(setting: Setting) -> str:
    return "hand-bf16-true" if LIGHTNING_PRECISION[setting.precision] == "bf16-true" else "hand"


# ---- Hugging Face -----------------------------------------------------------------------------------
def accelerate(setting: Setting) -> Runner:
    """Accelerate around the hand loop: ``prepare`` (model, optimizer, loader), ``backward``; its loader
    shards whole batches across ranks, so it reads the ``blocks`` layout."""
    import accelerate as package
    from accelerate import Accelerator

    runtime = Accelerator(mixed_precision=ACCELERATE_PRECISION[setting.precision], cpu=setting.device == "cpu")
    model = setting.model()
    loader = DataLoader(setting.dataset("blocks"), batch_size=setting.batch_size, shuffle=False)
    wrapped, optimizer, loader = runtime.prepare(model, adamw(model.parameters()), loader)
    return Runner("accelerate", model, _runtime_epoch(runtime, wrapped, optimizer, loader, setting.meter), version=package.__version__)


def _scratch_folder() -> str:
    """HF's Trainer needs an output folder even when it saves nothing: one removed when the process ends."""
    folder = tempfile.mkdtemp(prefix="ampddp-peers-hf-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


class _Pairs(Dataset):
    """A TensorDataset's samples as the dicts Hugging Face's Trainer collates."""

    def __init__(self, data: TensorDataset) -> None:
        self.inputs, self.labels = data.tensors

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


class _WithLoss(nn.Module):
    """The model returning Hugging Face's ``{"loss": ...}`` from the same loss as everyone else's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": loss_of(self.model(inputs), labels)}


def hf_trainer(setting: Setting) -> Runner:
    """Hugging Face's Trainer with the same AdamW and a constant schedule passed in, clipping, logging,
    saving and the progress bar off, batches in order (its default sampler shuffles), DDP without the
    unused-parameter search it switches on for models that are not its own. Each round is one ``train()``."""
    import transformers
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    meter = setting.meter

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:
            meter.tick()

    data = _Pairs(setting.dataset("blocks"))
    arguments = TrainingArguments(
        output_dir=_scratch_folder(), per_device_train_batch_size=setting.batch_size,
        max_steps=len(data) // (setting.batch_size * setting.world), max_grad_norm=0.0, bf16=setting.precision == "bf16",
        fp16=setting.precision == "fp16", use_cpu=setting.device == "cpu", report_to="none", save_strategy="no",
        logging_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, remove_unused_columns=False,
        ddp_find_unused_parameters=False, ddp_backend="gloo" if setting.device == "cpu" and setting.world > 1 else None,
        average_tokens_across_devices=False,
    )  # fmt: skip
    model = _WithLoss(setting.model())
    optimizer = adamw(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = InOrder(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, schedule), callbacks=[Tick()])
    trainer.remove_callback(PrinterCallback)  # prints each train()'s summary
    return Runner("hf-trainer", model.model, trainer.train, version=transformers.__version__)
