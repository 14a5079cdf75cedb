"""PyTorch Lightning 1.x's apex backend, unedited: ``python -m ampddp.apex tests/lightning_apex_job.py
O1|O2 --out DIR [--flags]``. Lightning calls ``amp.initialize(lightning_module, optimizers,
opt_level=...)`` when it dispatches, ``amp.scale_loss`` around each backward and clips
``amp.master_params``. ``--flags`` asks as its docs did (``amp_backend="apex", amp_level=...``), which
Lightning refuses on CPU by itself; the explicit plugin is how the same backend runs on a CPU.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.plugins import ApexMixedPrecisionPlugin
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("opt_level")
parser.add_argument("--out", required=True)
parser.add_argument("--flags", action="store_true")
args = parser.parse_args()


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
backend = (
    {"amp_backend": "apex", "amp_level": args.opt_level, "precision": 16}
    if args.flags
    else {"plugins": [ApexMixedPrecisionPlugin(amp_level=args.opt_level)]}
)
model = Classifier()
trainer = pl.Trainer(
    accelerator="cpu",
    devices=1,
    max_epochs=3,
    gradient_clip_val=1.0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    **backend,
)
trainer.fit(model, loader)
from apex import amp  # noqa: E402 - what Lightning's plugin used

report = {
    "losses": model.losses,
    "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    "masters": sorted({str(p.dtype) for p in amp.master_params(trainer.optimizers[0])}),
    "version": pl.__version__,
}
(Path(args.out) / "rank0.json").write_text(json.dumps(report))
