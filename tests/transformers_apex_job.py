"""Hugging Face transformers 4.x's ``Trainer`` with its apex backend, unedited, as a team pinned to it
runs it: ``python -m ampddp.apex tests/transformers_apex_job.py MODEL --opt-level O1|O2 --out DIR``
(also under ``torchrun --nproc-per-node 2``). Tiny models built from configs, synthetic data, no
downloads. Each rank writes ``DIR/rank{N}.json``: the losses, what evaluate/predict returned, the
saved weights against the fp32 masters, and the final parameters.

``--stop-at K`` ends the run of ``--steps`` after step K with a checkpoint folder (an interrupted job);
``--resume`` then continues it from that folder with ``resume_from_checkpoint``.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("model", choices=["gpt2", "t5"])
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--optim", default="adamw_torch")
args = parser.parse_args()

VOCAB, LENGTH = 64, 16


class Counting(torch.utils.data.Dataset):
    """Sequences that count up from a random start: learnable in a few steps."""

    def __init__(self, size, seed):
        self.starts = torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, index):
        tokens = (self.starts[index] + torch.arange(LENGTH)) % VOCAB
        if args.model == "t5":
            return {"input_ids": tokens, "labels": (tokens + 1) % VOCAB}
        return {"input_ids": tokens, "labels": tokens}


class StopAt(TrainerCallback):
    """The job is killed after step ``stop_at``, right after its checkpoint."""

    def on_step_end(self, training_args, state, control, **kwargs):
        if state.global_step == args.stop_at:
            control.should_save = control.should_training_stop = True
        return control


class StartScaleAt1024(TrainerCallback):
    """A fresh run starts its loss scale at 1024 (apex-era scripts set ``_amp_state.loss_scalers[0]._loss_scale``),
    so that a resumed run shows whether the scale came back from the checkpoint or restarted at 2**16."""

    def on_train_begin(self, training_args, state, control, **kwargs):
        from apex.amp import _amp_state

        _amp_state.loss_scalers[0]._loss_scale = 1024.0


def build_model():
    torch.manual_seed(0)
    if args.model == "t5":
        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
        return T5ForConditionalGeneration(config)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=4))


out = Path(args.out)
training_args = TrainingArguments(
    output_dir=str(out / "trainer"),
    fp16=True,
    half_precision_backend="apex",
    fp16_opt_level=args.opt_level,
    optim=args.optim,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=2,
    max_grad_norm=1.0,
    learning_rate=3e-3,
    warmup_steps=0,
    logging_steps=1,
    save_strategy="no",
    save_safetensors=True,
    report_to=[],
    use_cpu=True,
    seed=7,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
model = build_model()
stopping = args.stop_at is not None and not args.resume
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=Counting(64, seed=1),
    eval_dataset=Counting(16, seed=2),
    callbacks=[] if args.resume else [StartScaleAt1024(), *([StopAt()] if stopping else [])],
)
trainer.train(resume_from_checkpoint=str(out / "trainer" / f"checkpoint-{args.stop_at}") if args.resume else None)

import apex  # noqa: E402 - resolved by the runner; what the Trainer used
from apex import amp  # noqa: E402

report = {
    "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    "logged_steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry],
    "global_step": trainer.state.global_step,
    "loss_scale": amp._amp_state.loss_scalers[0].loss_scale(),
    "apex": apex.__name__,
    "model_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
    "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__module__,
    "norm_classes": sorted({type(m).__module__ + "." + type(m).__name__ for m in trainer.model.modules() if "Norm" in type(m).__name__}),
}
if not stopping:
    metrics = trainer.evaluate()
    report["eval_loss"] = metrics["eval_loss"]
    prediction = trainer.predict(Counting(8, seed=3))
    report["predictions_shape"] = list(
        prediction.predictions[0].shape if isinstance(prediction.predictions, tuple) else prediction.predictions.shape
    )
    trainer.save_model(str(out / "saved"))
if not stopping and trainer.is_world_process_zero():
    saved = load_file(str(out / "saved" / "model.safetensors"))
    report["saved_dtypes"] = sorted({str(t.dtype) for t in saved.values()})
    masters = [master.detach().float() for master in amp.master_params(trainer.optimizer)]
    named = dict(trainer.model.named_parameters())
    report["saved_equal_masters"] = all(any(torch.equal(saved[name], master) for master in masters) for name in saved if name in named)
    report["saved_finer_than_model"] = any(not torch.equal(saved[name], named[name].detach().float()) for name in saved if name in named)
rank = int(os.environ.get("RANK", "0"))
report["params"] = [p.detach().float().sum().item() for p in trainer.model.parameters()]
(out / f"rank{rank}.json").write_text(json.dumps(report))
