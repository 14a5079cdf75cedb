"""The Trainer's parts: any batch shape, any loss and metric, user checkpoint items, callbacks, settings."""

from __future__ import annotations

import collections
import copy
import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ampddp.checkpoint.store import CheckpointStore
from ampddp.errors import CheckpointError, ConfigError
from ampddp.trainer import Trainer
from ampddp.training import BatchAdapter, Callback, CheckpointSettings, LoopSettings
from ampddp.training.batches import move_to


class TokenDataset(Dataset):
    """Hugging-Face-style items: dicts of input ids, an attention mask and labels."""

    def __init__(self, size: int = 40, length: int = 6, vocab: int = 12) -> None:
        generator = torch.Generator().manual_seed(4)
        self.ids = torch.randint(1, vocab, (size, length), generator=generator)
        lengths = torch.randint(2, length + 1, (size,), generator=generator)
        self.mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        self.labels = (self.ids * self.mask).sum(1) % 3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


@dataclass
class ClassifierOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyTextClassifier(nn.Module):
    """Takes keyword inputs and returns its own loss, like a transformers sequence classifier."""

    def __init__(self, vocab: int = 12, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, input_ids, attention_mask, labels=None) -> ClassifierOutput:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.head(pooled)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return ClassifierOutput(loss, logits)


def top2(outputs, batch) -> dict[str, torch.Tensor]:
    best = outputs.logits.topk(2, dim=-1).indices
    return {"top2": (best == batch["labels"][:, None]).any(-1).sum()}


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def test_a_hugging_face_style_model_with_dict_batches_trains_as_a_hand_written_loop_does(tmp_path):
    train, held_out = TokenDataset(), TokenDataset(size=9)
    model = TinyTextClassifier()
    reference = copy.deepcopy(model)
    trainer = Trainer(model, sgd, train, eval_set=held_out, precision="O0", batch_size=8, max_epochs=3, shuffle=False,
                      metrics=top2, checkpoints=CheckpointSettings(tmp_path))  # fmt: skip
    result = trainer.fit()

    optimizer = sgd(reference.parameters())
    for _ in range(3):
        for start in range(0, len(train), 8):
            batch = {key: value[start : start + 8] for key, value in vars(train).items()}
            batch = {"input_ids": batch["ids"], "attention_mask": batch["mask"], "labels": batch["labels"]}
            optimizer.zero_grad()
            reference(**batch).loss.backward()
            optimizer.step()
    for ours, theirs in zip(trainer.run.module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        outputs = reference.eval()(held_out.ids, held_out.mask, held_out.labels)
    expected_top2 = (outputs.logits.topk(2, -1).indices == held_out.labels[:, None]).any(-1).float().mean().item()
    assert result["eval"]["top2"] == pytest.approx(expected_top2)
    assert result["eval"]["loss"] == pytest.approx(outputs.loss.item(), rel=1e-5)
    assert result["eval"]["samples"] == 9 and "accuracy" not in result["eval"]


def test_a_custom_loss_receives_the_whole_batch_in_training_and_evaluation(tmp_path):
    seen = []

    def weighted(outputs, batch):
        seen.append(sorted(batch))
        return F.cross_entropy(outputs.logits, batch["labels"]) * 2.0

    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(16), eval_set=TokenDataset(4), precision="O4", batch_size=8,
                      loss_fn=weighted, metrics=None, max_steps=2, max_epochs=5)  # fmt: skip
    result = trainer.fit()
    assert seen and all(keys == ["attention_mask", "input_ids", "labels"] for keys in seen)
    assert set(result["eval"]) == {"loss", "samples"}


class PairsAdapter(BatchAdapter):
    """A custom batch shape: (targets, left, right) with the model taking two inputs."""

    def forward(self, model, batch):
        return model(batch[1], batch[2])

    def count(self, batch):
        return len(batch[0])


class PairsDataset(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index):
        left = torch.full((4,), float(index))
        return index % 2, left, -left


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, left, right):
        return self.linear(torch.cat([left, right], -1))


def test_a_custom_batch_adapter_feeds_a_two_input_model():
    loss = lambda outputs, batch: F.cross_entropy(outputs, batch[0])  # noqa: E731
    trainer = Trainer(TwoInputs(), sgd, PairsDataset(), eval_set=PairsDataset(), precision="O0", batch_size=4, max_steps=3,
                      batches=PairsAdapter(), loss_fn=loss, metrics=None)  # fmt: skip
    result = trainer.fit()
    assert trainer.progress.samples_seen == 12 and result["eval"]["samples"] == 12


def test_move_to_keeps_nested_structures_and_their_types():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(2), (torch.zeros(1), 3)], "pair": Pair(torch.ones(1), "text")}
    moved = move_to(batch, torch.device("meta"))
    assert moved["x"][0].is_meta and moved["x"][1][0].is_meta and moved["x"][1][1] == 3
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.is_meta and moved["pair"].b == "text"
    with pytest.raises(TypeError, match="holds no tensor"):
        BatchAdapter().count({"names": ["a", "b"]})


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_start(self, progress):
        self.events.append(("start", progress.global_step))

    def on_step(self, progress, record):
        self.events.append(("step" if record is None else "logged", progress.global_step))

    def on_evaluation(self, progress, metrics):
        self.events.append(("eval", progress.global_step))

    def on_end(self, progress):
        self.events.append(("end", progress.global_step))
        return {"recorded": len(self.events)}


def test_callbacks_see_start_steps_evaluations_and_end_in_order():
    recorder = Recorder()
    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(16), eval_set=TokenDataset(4), precision="O0", batch_size=8,
                      max_epochs=2, log_every=2, callbacks=[recorder])  # fmt: skip
    result = trainer.fit()
    assert recorder.events == [
        ("start", 0),
        ("logged", 1),
        ("logged", 2),
        ("eval", 2),
        ("step", 3),
        ("logged", 4),
        ("eval", 4),
        ("end", 4),
    ]  # fmt: skip  (step 1: the first step a run trains is recorded, so progress shows at once)
    assert result["summary"]["recorded"] == 8


class Counter:
    """A user item saved with the checkpoint (say, an EMA or a data-stream position)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class CountingCallback(Callback):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def on_step(self, progress, record):
        self.counter.value += 10


def counted_trainer(run_dir, max_steps, counter):
    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(32), precision="O0", batch_size=8, max_steps=max_steps,
                      max_epochs=10, checkpoints=CheckpointSettings(run_dir), callbacks=[CountingCallback(counter)])  # fmt: skip
    trainer.checkpointer.register("counter", counter)
    return trainer


def test_a_registered_item_is_saved_and_restored_with_the_run(tmp_path):
    first = Counter()
    counted_trainer(tmp_path, 3, first).fit()
    second = Counter()
    resumed = counted_trainer(tmp_path, 5, second)
    resumed.fit()
    assert first.value == 30 and second.value == 50 and resumed.progress.global_step == 5


def test_a_checkpoint_without_a_registered_item_is_refused_before_anything_changes(tmp_path):
    Trainer(TinyTextClassifier(), sgd, TokenDataset(32), precision="O0", batch_size=8, max_steps=2,
            checkpoints=CheckpointSettings(tmp_path)).fit()  # fmt: skip
    counter = Counter()
    counter.value = 7
    trainer = counted_trainer(tmp_path, 4, counter)
    before = [p.detach().clone() for p in trainer.run.module.parameters()]
    with pytest.raises(CheckpointError, match=r"no state for the registered item.*counter"):
        trainer.load_checkpoint(CheckpointStore(tmp_path).latest())
    assert counter.value == 7 and trainer.progress.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.run.module.parameters()))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is not valid; it must be an integer >= 1"),
        ({"grad_accum_steps": 1.5}, "grad_accum_steps=1.5 is not valid"),
        ({"max_steps": True}, "max_steps=True is not valid; it must be an integer >= 1 or None"),
        ({"clip_grad_norm": float("inf")}, "clip_grad_norm=inf is not valid"),
        ({"shuffle": "yes"}, "shuffle='yes' is not valid; it must be true or false"),
    ],
)
def test_bad_loop_settings_are_refused_with_the_value_and_the_rule(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoopSettings(**settings)


def test_an_unknown_trainer_argument_names_itself_and_the_valid_settings():
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) batchsize; loop settings are: batch_size, grad_accum_steps"):
        Trainer(TinyTextClassifier(), sgd, TokenDataset(8), batchsize=4)


def test_loop_settings_come_as_one_object_or_as_keywords_not_both():
    by_object = Trainer(TinyTextClassifier(), sgd, TokenDataset(8), precision="O0", loop=LoopSettings(batch_size=4, max_steps=2))
    by_keywords = Trainer(TinyTextClassifier(), sgd, TokenDataset(8), precision="O0", batch_size=4, max_steps=2)
    assert by_object.settings == by_keywords.settings == LoopSettings(batch_size=4, max_steps=2)
    with pytest.raises(ConfigError, match=r"loop=LoopSettings\(...\) and the loop setting\(s\) max_steps as keywords"):
        Trainer(TinyTextClassifier(), sgd, TokenDataset(8), loop=LoopSettings(batch_size=4), max_steps=2)
    with pytest.raises(ConfigError, match=r"loop=\{'batch_size': 4\} \(dict\) is not valid; valid: a LoopSettings"):
        Trainer(TinyTextClassifier(), sgd, TokenDataset(8), loop={"batch_size": 4})


def test_the_trainers_docstring_names_everything_it_takes():
    """The door says what it takes: each named argument and each loop setting its ``**settings`` accepts."""
    import inspect

    named = [name for name in inspect.signature(Trainer.__init__).parameters if name not in ("self", "settings")]
    missing = [name for name in (*named, *LoopSettings.names()) if f"``{name}" not in Trainer.__doc__]
    assert not missing, f"Trainer's docstring does not name: {missing}"


def test_a_custom_metric_is_logged_and_printed_by_the_run_observer(tmp_path, capsys):
    from ampddp.distributed.env import detect_env
    from ampddp.observe import Reporting

    env = detect_env({}, device="cpu")
    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(16), eval_set=TokenDataset(6), precision="O0", batch_size=8,
                      max_epochs=1, metrics=top2, report=Reporting(progress="lines"), checkpoints=CheckpointSettings(tmp_path),
                      env=env)  # fmt: skip
    summary = trainer.fit()["summary"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluation = [record for record in records if record["kind"] == "eval"]
    assert len(evaluation) == 1 and set(evaluation[0]) == {"kind", "step", "epoch", "loss", "top2", "samples"}
    printed = capsys.readouterr().out
    assert f"eval step 2 epoch 1.00: loss {evaluation[0]['loss']:.4f} top2 {evaluation[0]['top2']:.4f} (6 samples)" in printed
    assert summary["final_eval_accuracy"] is None and summary["final_eval_loss"] == evaluation[0]["loss"]
    assert (tmp_path / "eval_top2.png").stat().st_size > 1000 and not (tmp_path / "eval_accuracy.png").exists()


def test_a_metric_may_not_take_a_name_the_evaluation_record_uses():
    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(8), eval_set=TokenDataset(4), precision="O0", batch_size=4,
                      max_steps=1, metrics=lambda outputs, batch: {"loss": outputs.logits.sum()})  # fmt: skip
    with pytest.raises(ConfigError, match=r"metric name\(s\) loss are reserved \(loss, samples, kind, step, epoch, nonfinite\)"):
        trainer.evaluate()


class Unsafe(Counter):
    def state_dict(self):
        return {"history": collections.deque([1, 2])}


def test_an_item_whose_state_a_safe_load_cannot_read_is_refused_before_a_checkpoint_is_written(tmp_path):
    trainer = counted_trainer(tmp_path, 2, Counter())
    trainer.checkpointer.register("unsafe", Unsafe())
    with pytest.raises(ConfigError, match=r"checkpoint item 'unsafe': its state_dict holds objects a safe load cannot read"):
        trainer.fit()
    assert CheckpointStore(tmp_path).latest() is None


class Refusing(Counter):
    def load_state_dict(self, state):
        raise ValueError("shape mismatch in the EMA")


def test_an_item_that_refuses_its_state_leaves_the_run_unloaded(tmp_path):
    first = counted_trainer(tmp_path, 2, Counter())
    first.checkpointer.register("ema", Counter())
    first.fit()
    again = counted_trainer(tmp_path, 4, Counter())
    again.checkpointer.register("ema", Refusing())
    before = [p.detach().clone() for p in again.run.module.parameters()]
    with pytest.raises(CheckpointError, match=r"registered item 'ema' refused its saved state \(ValueError: shape mismatch in the EMA\)"):
        again.load_checkpoint(CheckpointStore(tmp_path).latest())
    assert again.progress.global_step == 0 and again.engine.state_dict() == first.engine.__class__.state_dict(again.engine)
    assert all(torch.equal(a, b) for a, b in zip(before, again.run.module.parameters()))


def test_tokens_are_counted_for_token_data_only():
    adapter = BatchAdapter()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert adapter.tokens({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": mask}) == 3
    assert adapter.tokens({"input_ids": torch.ones(2, 3, dtype=torch.long)}) == 6
    assert adapter.tokens((torch.ones(4, 5, dtype=torch.int32), torch.zeros(4, dtype=torch.long))) == 20
    assert adapter.tokens((torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))) == 0
    assert adapter.tokens((torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))) == 0, "pixels are not tokens"


def test_a_token_run_logs_tokens_per_second_and_an_image_run_does_not(tmp_path, capsys):
    from ampddp.observe import Reporting

    trainer = Trainer(TinyTextClassifier(), sgd, TokenDataset(16), precision="O0", batch_size=8, max_steps=2, log_every=1,
                      checkpoints=CheckpointSettings(tmp_path), report=Reporting(progress="lines"))  # fmt: skip
    trainer.fit()
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(train) == 2 and all(record["tokens_per_s"] > 0 for record in train)
    assert " tokens/s" in capsys.readouterr().out
    pictures = torch.utils.data.TensorDataset(torch.randn(16, 16), torch.zeros(16, dtype=torch.long))
    images = Trainer(nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), sgd, pictures, precision="O0", batch_size=8, max_steps=1,
                     log_every=1, checkpoints=CheckpointSettings(tmp_path / "images"))  # fmt: skip
    images.fit()
    assert "tokens_per_s" not in (tmp_path / "images" / "metrics.jsonl").read_text()
