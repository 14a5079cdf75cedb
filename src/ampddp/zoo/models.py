"""Model factory: small built-ins for CPU runs, every torchvision classification model, and a small GPT."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampddp.errors import ConfigError, closest
from ampddp.torch_compat import casts_before_gathers

BUILTINS = ("mlp", "small_cnn")


def _mlp(num_classes: int, channels: int, image_size: int) -> nn.Module:
    width = 256
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(channels * image_size * image_size, width), nn.BatchNorm1d(width), nn.ReLU(),
        nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
        nn.Linear(width, num_classes),
    )  # fmt: skip


def _small_cnn(num_classes: int, channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(32 * 16, num_classes),
    )  # fmt: skip


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int, channels: int, image_size: int) -> nn.Module:
    """``mlp``, ``small_cnn`` or a torchvision classification model (random init, ``num_classes`` outputs)."""
    if name == "mlp":
        return _mlp(num_classes, channels, image_size)
    if name == "small_cnn":
        return _small_cnn(num_classes, channels, image_size)
    available = classification_models()
    if name not in available:
        hint = closest(name, [*BUILTINS, *available])
        examples = ", ".join(available[:6])
        raise ConfigError(
            f"model.name={name!r} is not valid{hint}; valid: {', '.join(BUILTINS)}, a torchvision classification model ({examples}, ...) "
            "or a function of yours as package.module:function"
        )
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions, with its softmax written out (the op apex's
    lists keep in fp32: what FSDP2's plain bf16 loses).

    The query, key and value projections are three layers (``q``, ``k``, ``v``), so tensor parallelism
    splits them by heads, column-wise; a state dict with the earlier fused ``qkv`` layer loads (split
    on the way in). The head count is read from the projections' outputs: under tensor parallelism
    each rank holds ``heads / tp_size`` of them."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (layer(x).view(batch, length, -1, self.head_width).transpose(1, 2) for layer in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (k.shape[-1] ** -0.5)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.proj((weights.to(v.dtype) @ v).transpose(1, 2).reshape(batch, length, -1))


def _gather_stream(part: nn.Module, first: tuple[str, ...]) -> Any:
    """How a block's ``part`` gathers the sequence-split residual stream for its first (column-split) layers ``first``,
    which alone read it: in fp8, cast once before the all-gather, where they are all O6's tensorwise fp8 layers
    (torchao's ``PrepareFloat8ModuleInput``), else as it is."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if all(casts_before_gathers(part.get_submodule(name)) for name in first):
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), fwd_config_submodule_fqn=first[0])
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _split_fused_qkv(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A state dict written before the projections were split (one ``qkv`` layer, rows q, k, v) loads into ``q``, ``k``, ``v``."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3, dim=0)):
                state_dict[f"{prefix}{name}.{kind}"] = part


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.attention_norm, self.attention = norm(width), CausalSelfAttention(width, heads)
        self.mlp_norm = norm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


NORMS = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}


class GPT(nn.Module):
    """A small GPT: token and position embeddings, ``layers`` pre-norm blocks, a final norm and a head.

    ``forward(input_ids, labels=None)`` returns ``{"logits"}`` and, given labels (the next token at
    each position), ``{"loss"}``: mean cross-entropy over the tokens (Hugging Face's convention, so
    ampddp's default loss and tokens/s use it as is).
    """

    def __init__(self, vocab_size: int, layers: int = 4, width: int = 128, heads: int = 4, context: int = 256, norm: str = "rms") -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("layers", layers), ("width", width), ("heads", heads), ("context", context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gpt {name}={value!r} is not valid; it must be an integer >= 1")
        if width % heads:
            raise ConfigError(f"gpt width={width} is not a multiple of heads={heads}; each head takes width/heads features")
        if norm not in NORMS:
            raise ConfigError(f"gpt norm={norm!r} is not valid; valid: {', '.join(NORMS)}")
        self.context = context
        self.pipelined = False
        """Whether this is a pipeline stage (``pipeline_stage``): its forward then returns tensors only."""
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, NORMS[norm]) for _ in range(layers))
        self.final_norm = NORMS[norm](width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def tensor_parallel_plan(self, tp_size: int, sequence_parallel: bool = True, loss_parallel: bool = False) -> dict[str, Any]:
        """How tensor parallelism splits this model over ``tp_size`` ranks (torch's ``parallelize_module`` plan,
        torchtitan's layout): each block's q/k/v and first MLP layer by output columns (each rank a share of the
        heads and hidden units), its attention output and second MLP layer by input rows (partial sums reduced);
        the token embedding by vocabulary rows, the head by vocabulary columns (logits gathered whole: the loss
        is the plain one; ``loss_parallel``: left split by vocabulary, and the forward's own loss is torch's
        vocabulary-parallel cross-entropy, run under ``loss_parallel()``). ``sequence_parallel``: between the
        split layers the residual stream is split by sequence position over the ranks, the norms run on their
        slice (their weights become replicated DTensors), gathered before each split layer; the sequence length
        must then divide by ``tp_size``. A pipeline stage's plan names the modules it holds; the residual stream
        crosses stages as the blocks leave it (split by sequence position with ``sequence_parallel``)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        blocks = list(self.blocks.items() if isinstance(self.blocks, nn.ModuleDict) else enumerate(self.blocks))
        first = blocks[0][1].attention
        heads = first.q.out_features // first.head_width
        if heads % tp_size:
            raise ConfigError(f"gpt heads={heads} do not split over tp_size={tp_size}; choose a tp_size that divides the heads")
        stream = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, Any] = {}  # a pipeline stage's plan names only what it holds; the stream crosses stages as split
        if self.token_embedding is not None:
            plan["token_embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if sequence_parallel:
                plan[f"blocks.{blocks[0][0]}"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                                    use_local_output=True)  # fmt: skip
        if self.head is not None:
            plan["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                           use_local_output=not loss_parallel)  # fmt: skip
            if sequence_parallel:
                plan["final_norm"] = SequenceParallel()
        for index, module in blocks:
            block = f"blocks.{index}"
            for part, first_layers in (("attention", ("q", "k", "v")), ("mlp", ("0",))):
                if sequence_parallel:
                    plan[f"{block}.{part}_norm"] = SequenceParallel()
                    plan[f"{block}.{part}"] = _gather_stream(getattr(module, part), first_layers)
            plan.update({f"{block}.attention.{name}": ColwiseParallel() for name in "qkv"})
            plan[f"{block}.attention.proj"] = RowwiseParallel(output_layouts=stream)
            plan[f"{block}.mlp.0"] = ColwiseParallel()
            plan[f"{block}.mlp.2"] = RowwiseParallel(output_layouts=stream)
        return plan

    def pipeline_stage(self, stage: int, stages: int) -> GPT:
        """This model cut down, in place, to pipeline stage ``stage`` of ``stages``: its share of the blocks (as even
        as they split; earlier stages take one more where they do not), the embeddings on the first stage only, the
        final norm and head on the last only. The parameters keep the whole model's names (``blocks.5.mlp.0.weight``
        stays that on the stage holding block 5), so checkpoints of any split read as the whole model's. A stage
        after the first reads the residual stream instead of token ids; a stage before the last returns it, the last
        its logits as a tensor (a pipeline passes tensors; the loss is computed on them)."""
        layers = len(self.blocks)
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= layers or not 0 <= stage < stages:
            raise ConfigError(f"gpt layers={layers} do not split into {stages} pipeline stage(s); give at most {layers} "
                              "stages (one block each at least)")  # fmt: skip
        share, extra = divmod(layers, stages)
        start = stage * share + min(stage, extra)
        kept = range(start, start + share + (stage < extra))
        self.blocks = nn.ModuleDict({str(index): self.blocks[index] for index in kept})
        if stage > 0:
            self.token_embedding = self.position_embedding = None
        if stage < stages - 1:
            self.final_norm = self.head = None
        self.pipelined = True
        return self

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor] | torch.Tensor:
        if self.token_embedding is None:
            x = input_ids  # a later pipeline stage: the residual stream from the stage before
        else:
            length = input_ids.shape[1]
            if length > self.context:
                raise ValueError(f"a sequence of {length} tokens is longer than the GPT's context of {self.context}; raise its context")
            positions = torch.arange(length, device=input_ids.device)
            x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x)
        if self.head is None:
            return x  # an earlier pipeline stage: the residual stream for the next
        logits = self.head(self.final_norm(x))
        if self.pipelined:
            return logits
        if labels is None:
            return {"logits": logits}
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def gpt(num_classes: int, **settings: Any) -> GPT:
    """A recipe's ``model.name: ampddp.zoo.models:gpt``: ``num_classes`` is the vocabulary (256 for
    ``ampddp.zoo.text``'s bytes); ``model.kwargs``: layers, width, heads, context, norm (rms | layer)."""
    return GPT(num_classes, **settings)
