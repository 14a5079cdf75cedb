"""ampddp beside the frameworks its users would otherwise choose, on the same work (issue #48).

Contenders (``peer_loops``): a hand-written torch loop (the reference), ampddp's ``Trainer`` and
``prepare``, apex's API on ampddp (``amp.initialize`` + ``amp.scale_loss`` around the hand loop),
Lightning 2.x's ``Trainer`` and ``Fabric``, Hugging Face Accelerate and Hugging Face's ``Trainer``.
Work: an MLP 256 -> 4 x 1024 -> 10 (batch 64) and ampddp.zoo's GPT (4 blocks, width 128, 4 heads,
64 tokens, vocabulary 256; batch 8), and, in fp32 only, a ``tiny`` MLP with next to no arithmetic (16 -> 2 x 32 ->
10, batch 128: what a step costs around the model), each from one seeded set of initial weights, on the same
synthetic tensors in the same order (every rank sees the same batches whichever sampler shards them),
with AdamW (lr 1e-3, torch's defaults otherwise) and one loss (fp32 cross-entropy).

Precisions: ``fp32``; ``bf16`` autocast (ampddp native-bf16, Lightning/Fabric "bf16-mixed",
Accelerate/HF bf16; the facade runs apex's O4, its bf16 op lists); ``o5`` (ampddp O5: bf16 weights,
fp32 masters) against a hand O5 loop and the peers' nearest, Lightning/Fabric "bf16-true", which
steps bf16 weights without masters (less work, other numerics: checked against a hand loop that does
the same, ``hand-bf16-true``), and ampddp's O5 without masters (``ampddp-o5-no-masters``, apex's
``master_weights=False``) is the same work as theirs, checked against that loop. On CUDA also ``fp16``
(autocast + GradScaler; ampddp native-fp16, the facade O1) and ``o2`` (fp16 weights, fp32 masters, loss
scaling: ampddp and the facade against a hand loop); a CPU has no fast fp16 arithmetic.

Processes: every contender runs in interpreters of its own (its heap, page faults, CPU time and peak
memory are its own; none inherits the suite's ``mallopt`` settings or a MALLOC_* variable: the issue
measures the C library's defaults), one process with torch's threads, or two ranks with one thread
each, started with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT). Each
joins the process group its own way: the hand loop and the facade ``init_process_group("gloo")`` and
torch DDP, ampddp ``setup_distributed`` (its library path) and ``prepare``, Lightning/Fabric
strategy "ddp", Accelerate and HF's Trainer their multi-CPU (multi-GPU) state. A coordinator sends
every contender one command at a time (build, train a round, report the final loss, peak memory);
each command is bounded in time. ``--smoke`` runs the one-process groups in its own process instead
(seconds; the numbers mean nothing) and one two-rank group of two contenders.

Left out, with the reason printed: a peer that is not installed (``pip install -e ".[peers]"``);
Accelerate and HF's Trainer at o5/o2 (no fp32-master mode: their bf16/fp16 is autocast);
Lightning/Fabric at o2 ("16-true" steps fp16 weights without masters or loss scaling). What each is
given to run the same work: HF's Trainer our AdamW and a constant schedule (its own groups the
parameters and decays the rate), clipping off (``max_grad_norm`` 1.0 by default), batches in order
(its sampler shuffles: ``_get_train_sampler`` overridden), no token-count loss scaling and, for a model
that is not its own, no DDP unused-parameter search; Lightning's Trainer our sequential
DistributedSampler (``use_distributed_sampler=False``: the one it adds shuffles training data);
Accelerate's loader, which deals whole batches to the ranks, the samples laid out so that each rank
gets the batches the others get. Logging, checkpoints, progress bars and summaries are off everywhere
(ampddp: no console, loggers or per-step records).

Before any time counts, every contender trains one round (the warm-up) and its weights' loss on a fixed batch
(fp32, the same code for all: the "final loss") must equal its hand loop's: to the bit on the CPU (``RTOL``
says why CUDA gets 1e-5). It is checked again after the timed rounds; a contender that disagrees is reported
as such and not timed. Then the contenders take turns, one round (one pass over the data: ``steps`` optimizer
steps) each, the order rotating every round, so machine noise hits all alike. All of that is done ``draws``
times, every contender started afresh each time (``full``: 3 draws of 3 rounds): a process's heap layout is
luck that stays with it (the same loop faults 2,000 or 8,500 pages a step in two processes), so a row's rounds
come from several processes. Per contender (rank 0): the median step time between the first and last step of a
round (what runs between steps counts; entering a framework's fit does not), its paired ratio to the hand loop
and to the fastest peer (> 1: this contender faster), process CPU time and minor page faults (``ru_minflt``)
per step, and the peak resident set of its process (interpreter, torch and its framework included). The rows
carry the load average seen and the CPU kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peer_loops as loops
import torch
from harness import Budget, Row, paired_ratio, spread
from torch import nn

RTOL = {"cpu": 0.0, "cuda": 1e-5}
"""How far a contender's final loss may sit from its hand loop's (relative), per device. On the CPU every
contender runs the same kernels in the same order: they agree to the bit (every row of every run so
far), and at the smoke sizes a precision that silently fell back to fp32 differs by 1e-7 only. CUDA's
embedding backward adds with atomics, in no fixed order: two runs of one loop differ in the last bits."""
NO_MASTERS = "no fp32-master mode (its bf16/fp16 is torch.autocast)"
O4_LISTS = "apex's O1/O4 op lists keep softmax, GELU and norms in fp32, where torch's autocast runs some of them in half precision"
NO_O2 = 'no fp16-weight + fp32-master mode ("16-true" steps fp16 weights without masters or loss scaling)'


@dataclass(frozen=True)
class Contender:
    build: Callable[[loops.Setting], loops.Runner]
    side: str  # hand | ampddp | peer
    packages: tuple[str, ...] = ()
    unsupported: dict[str, str] = field(default_factory=dict)
    only: tuple[str, ...] = ()
    """Precisions it runs at (empty: all but ``unsupported``)."""
    differs: str = ""
    """Why its final loss may differ from the hand loop's, said with a disagreement."""


CONTENDERS = {
    "hand": Contender(loops.hand, "hand"),
    "hand-bf16-true": Contender(loops.hand_bf16_true, "hand", only=("o5",)),
    "ampddp-trainer": Contender(loops.ampddp_trainer, "ampddp"),
    "ampddp-prepare": Contender(loops.ampddp_prepare, "ampddp"),
    "ampddp-o5-no-masters": Contender(loops.ampddp_o5_no_masters, "ampddp", only=("o5",)),
    "amp-facade": Contender(loops.amp_facade, "ampddp", differs=O4_LISTS),
    "lightning-trainer": Contender(loops.lightning_trainer, "peer", ("lightning",), {"o2": NO_O2}),
    "fabric": Contender(loops.fabric, "peer", ("lightning",), {"o2": NO_O2}),
    "accelerate": Contender(loops.accelerate, "peer", ("accelerate",), {"o5": NO_MASTERS, "o2": NO_MASTERS}),
    "hf-trainer": Contender(loops.hf_trainer, "peer", ("transformers", "accelerate"), {"o5": NO_MASTERS, "o2": NO_MASTERS}),
}


# ---- the work -----------------------------------------------------------------------------------
def mlp(inputs: int, width: int, depth: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Logits(nn.Module):
    """ampddp.zoo's GPT returning its logits alone (every contender computes the same loss from them)."""

    def __init__(self, **settings: int) -> None:
        super().__init__()
        from ampddp.zoo.models import GPT

        self.gpt = GPT(**settings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids)["logits"]


def gpt(**settings: int) -> nn.Module:
    torch.manual_seed(0)
    return Logits(**settings)


@dataclass(frozen=True)
class Work:
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    classes: int
    batch_size: int
    tokens: bool = False

    def data(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Synthetic inputs and labels from a fixed seed."""
        generator = torch.Generator().manual_seed(1)
        if self.tokens:
            return torch.randint(0, self.classes, (samples, *self.shape), generator=generator), torch.randint(
                0, self.classes, (samples, *self.shape), generator=generator
            )
        return torch.randn(samples, *self.shape, generator=generator), torch.randint(0, self.classes, (samples,), generator=generator)


def work(name: str, size: str) -> Work:
    """The MLP and the GPT at their benchmark size, or toy sizes for ``smoke``; ``tiny``: an MLP with next to
    no arithmetic (16 -> 2 x 32 -> 10, 1.9k parameters) on 128-sample batches, where a step costs what the
    framework around it costs (issue #48's fixed per-step cost)."""
    smoke = size == "smoke"
    if name == "tiny":
        return Work(functools.partial(mlp, 16, 32, 2, 10), (16,), 10, 8 if smoke else 128)
    if name == "mlp":
        inputs, width = (16, 32) if smoke else (256, 1024)
        return Work(functools.partial(mlp, inputs, width, 4, 10), (inputs,), 10, 4 if smoke else 64)
    vocab, width, heads, context = (32, 16, 2, 8) if smoke else (256, 128, 4, 64)
    build = functools.partial(gpt, vocab_size=vocab, layers=1 if smoke else 4, width=width, heads=heads, context=context)
    return Work(build, (context,), vocab, 2 if smoke else 8, tokens=True)


# ---- one contender of one group, here or in processes of its own ------------------------------------------
@dataclass(frozen=True)
class Group:
    work: str
    precision: str
    device: str
    size: str
    steps: int
    rounds: int
    world: int = 1
    only: tuple[str, ...] = ()
    """The contenders to run (empty: every one)."""
    draws: int = 1
    """How many times every contender is started afresh, ``rounds`` timed rounds each (``fresh`` groups): a
    process's heap layout is luck that lasts its life (one-process MLP rows: 2,000 or 8,500 page faults a step
    for the same loop in two processes, 20 or 27 ms a step), so a row samples several processes, not one."""

    @property
    def label(self) -> str:
        return f"{self.work}/{self.precision}/{'1-process' if self.world == 1 else f'{self.world}-process-ddp'}"

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Group:
        """The group a JSON object describes (its lists back to tuples)."""
        return cls(**{**fields, "only": tuple(fields.get("only", ()))})


def missing(name: str, precision: str) -> str | None:
    """Why contender ``name`` does not run at ``precision`` here, or None."""
    contender = CONTENDERS[name]
    if contender.only and precision not in contender.only:
        return "not at this precision"
    if precision in contender.unsupported:
        return contender.unsupported[precision]
    absent = [package for package in contender.packages if importlib.util.find_spec(package) is None]
    return f"{', '.join(absent)} not installed (pip install -e '.[peers]')" if absent else None


class Trained:
    """One contender built in this process: trains a round, counts its steps, reads its final loss."""

    def __init__(self, name: str, group: Group, rank: int = 0) -> None:
        for package in CONTENDERS[name].packages:
            importlib.import_module(package)
        _quiet()  # after the imports: the peers set their loggers' levels when imported
        spec = work(group.work, group.size)
        inputs, labels = spec.data(group.steps * spec.batch_size * group.world)
        model, batch = spec.build(), spec.batch_size
        self.setting = loops.Setting(spec.build, model, inputs, labels, batch, group.precision, group.device, rank, group.world)
        self.probe, self.build = (inputs[: spec.batch_size], labels[: spec.batch_size]), spec.build
        self.runner = CONTENDERS[name].build(self.setting)

    def answer(self, command: str) -> Any:
        """``ready``: what it is; ``warm``: one round, its step count; ``round``: one timed round;
        ``loss``: the final loss; ``finish``: its peak resident set (MiB)."""
        if command == "ready":
            return {"reference": self.runner.reference, "version": self.runner.version, "threads": torch.get_num_threads()}
        if command in ("warm", "round"):
            self.setting.meter.ticks.clear()
            self.runner.train_epoch()
            return len(self.setting.meter.ticks) if command == "warm" else self.setting.meter.take()
        if command == "loss":
            return _probe_loss(self.runner.module, self.build, self.probe)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Local:
    """A contender in this process (smoke: seconds, no process start; the numbers mean nothing)."""

    def __init__(self, name: str, group: Group) -> None:
        self.name, self.trained = name, Trained(name, group)

    def ask(self, command: str) -> Any:
        return self.trained.answer(command)

    def close(self) -> None:
        del self.trained


class Remote:
    """A contender in fresh interpreters of its own, one per rank, started as torchrun starts them
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT; no MALLOC_* variables): its heap, page faults, CPU time and
    peak memory are its own. Each answers the coordinator's commands one line at a time."""

    def __init__(self, name: str, group: Group, scratch: Path) -> None:
        self.name, self.bound = name, _bound(group)
        port = str(_free_port())
        base = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"}
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", name, "--group", json.dumps(dataclasses.asdict(group))]
        self.logs = [scratch / f"{name}.{rank}.log" for rank in range(group.world)]
        self.streams = [log.open("w") for log in self.logs]
        self.processes = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stream, text=True,
                                           env={**base, **_rank_variables(rank, group.world, port)})
                          for rank, stream in enumerate(self.streams)]  # fmt: skip

    def ask(self, command: str) -> Any:
        """Every rank's answer to ``command`` (they run collectively); rank 0's is returned."""
        for process in self.processes:
            process.stdin.write(command + "\n")
            process.stdin.flush()
        answers = [self._read(rank, process) for rank, process in enumerate(self.processes)]
        return answers[0]

    def _read(self, rank: int, process: subprocess.Popen) -> Any:
        ready, _, _ = select.select([process.stdout], [], [], self.bound)
        line = process.stdout.readline() if ready else ""
        if not line:
            self.close()
            tail = self.logs[rank].read_text(errors="replace")[-1500:]
            raise RuntimeError(f"rank {rank} {'stopped' if ready else f'gave no answer within {self.bound:.0f}s'}:\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["ok"]

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                stream.close()
        for stream in self.streams:
            stream.close()


def _rank_variables(rank: int, world: int, port: str) -> dict[str, str]:
    if world == 1:
        return {}
    threads = str(max(1, _cores() // world))  # as torchrun and ampddp's launcher split the cores
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": threads}  # fmt: skip


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _free_port() -> int:
    from ampddp.distributed.launch import free_port

    return free_port()


def _bound(group: Group) -> float:
    """Seconds one command may take before its contender is stopped: generous for a loaded 2-core machine."""
    return {"smoke": 120.0, "quick": 600.0, "full": 900.0}[group.size]


def serve(name: str, group: Group) -> int:
    """A contender's process: build it, then answer one command per line of stdin until ``finish``.
    The answers go out on the original stdout; anything the frameworks print goes to stderr."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    trained = None
    for command in sys.stdin:
        try:
            trained = trained or Trained(name, group, int(os.environ.get("RANK", 0)))
            reply = {"ok": trained.answer(command.strip())}
        except Exception as error:  # the coordinator reports it as this contender's result
            reply = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        channel.write(json.dumps(reply) + "\n")
        channel.flush()
        if command.strip() == "finish" or "error" in reply:
            break
    return 0


# ---- the group: check, then interleave ----------------------------------------------------------------------
def run_group(group: Group, fresh: bool) -> dict[str, Any]:
    """Every contender, ``group.draws`` times in fresh processes (once here when not ``fresh``), its samples
    from every draw together; a contender that failed or disagreed in any draw is reported so, not timed."""
    draws = [_draw(group, fresh) for _ in range(group.draws if fresh else 1)]
    skipped = {name: why for draw in draws for name, why in draw["skipped"].items()}
    disagreed = {name: why for draw in draws for name, why in draw["disagreed"].items() if name not in skipped}
    timed = [name for name in draws[0]["contenders"] if name not in skipped and name not in disagreed]

    def merged(name: str) -> dict[str, Any]:
        mine = [draw["contenders"][name] for draw in draws]
        samples = [sample for entry in mine for sample in entry["samples"]]
        return {**mine[-1], "samples": samples, "peak_rss_mib": _largest(entry["peak_rss_mib"] for entry in mine)}

    entries = {name: merged(name) for name in timed}
    load = [draws[0]["load"][0], draws[-1]["load"][-1]]
    return {"group": dataclasses.asdict(group), "skipped": skipped, "disagreed": disagreed, "load": load, "contenders": entries}


def _largest(values: Iterator[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return max(known) if known else None


def _draw(group: Group, fresh: bool) -> dict[str, Any]:
    """Every contender built, one checked round each, ``rounds`` interleaved timed rounds, checked again.
    ``fresh``: each contender in processes of its own (``Remote``); else all in this one (``Local``)."""
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="ampddp-peers-") as scratch, _peer_state_undone():
        handles, skipped = _start(group, Path(scratch) if fresh else None)
        try:
            info, steps = _warmed(handles, group, Path(scratch) if fresh else None, skipped)
            disagreed, _ = _check(handles, info, steps, group, skipped)
            samples = _rounds(handles, group.rounds, skipped)
            late, losses = _check(handles, info, steps, group, skipped)
            rss = _ask_each(handles, "finish", skipped) if fresh else {}
        finally:
            for handle in handles:
                handle.close()
    load.append(os.getloadavg()[0])
    entries = {handle.name: {"samples": samples[handle.name], **info[handle.name], "loss": losses[handle.name],
                             "reference_loss": losses[info[handle.name]["reference"]], "peak_rss_mib": rss.get(handle.name)}
               for handle in handles}  # fmt: skip
    return {"skipped": skipped, "disagreed": {**disagreed, **late}, "load": load, "contenders": entries}


PORT_TAKEN = "EADDRINUSE"
"""How torch's store says its port was taken (by another process, between the coordinator's pick and rank 0's bind)."""


def _warmed(handles: list, group: Group, scratch: Path | None, skipped: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each contender's description and warm-up step count. One whose port was taken before its rank 0 bound it (the
    race of every launcher that picks a free port: three draws start every contender three times) starts once more,
    on a new port; a second failure is its result."""
    info, steps = _ask_each(handles, "ready", skipped), _ask_each(handles, "warm", skipped)
    for name in [name for name, why in skipped.items() if PORT_TAKEN in why and scratch is not None]:
        del skipped[name]
        again = [Remote(name, group, scratch)]
        info.update(_ask_each(again, "ready", skipped))
        steps.update(_ask_each(again, "warm", skipped))
        handles += again
    return info, steps


def _start(group: Group, scratch: Path | None) -> tuple[list, dict[str, str]]:
    handles, skipped = [], {}
    for name in group.only or CONTENDERS:
        reason = missing(name, group.precision)
        if reason is None:
            try:
                handles.append(Remote(name, group, scratch) if scratch is not None else Local(name, group))
            except Exception as error:  # a framework that cannot set this up here: reported, the others go on
                reason = f"set-up failed: {type(error).__name__}: {str(error)[:300]}"
        if reason is not None and reason != "not at this precision":
            skipped[name] = reason
    return handles, skipped


def _ask_each(handles: list, command: str, failed: dict[str, str]) -> dict[str, Any]:
    """Every handle's answer; one that fails leaves ``handles`` with its reason in ``failed``."""
    answers = {}
    for handle in list(handles):
        try:
            answers[handle.name] = handle.ask(command)
        except Exception as error:
            failed[handle.name] = f"{command} failed: {str(error)[:600]}"
            handles.remove(handle)
            handle.close()
    return answers


def _check(handles: list, info: dict, steps: dict, group: Group, failed: dict[str, str]) -> tuple[dict[str, str], dict[str, float]]:
    """Each final loss against its hand loop's; a contender that disagrees leaves ``handles``."""
    losses = _ask_each(handles, "loss", failed)
    verdicts = {handle.name: _verdict(handle.name, info[handle.name]["reference"], losses, steps[handle.name], group) for handle in handles}
    for handle in [handle for handle in handles if verdicts[handle.name]]:
        handles.remove(handle)
        handle.close()
    return {name: why for name, why in verdicts.items() if why}, losses


def _verdict(name: str, reference: str, losses: dict[str, float], steps: int, group: Group) -> str | None:
    """Why contender ``name`` is not the same work as its reference, or None."""
    expected = losses.get(reference)
    if expected is None:
        return f"its reference ({reference}) did not run"
    if steps != group.steps:
        return f"trained {steps} steps in a round, not {group.steps}"
    if not abs(losses[name] - expected) <= RTOL[group.device] * abs(expected):
        why = CONTENDERS[name].differs
        return f"DISAGREES: final loss {losses[name]:.9g} vs {reference} {expected:.9g}" + (f" ({why})" if why else "")
    return None


def _rounds(handles: list, rounds: int, failed: dict[str, str]) -> dict[str, list]:
    """Each contender trains one round in turn; the order rotates so that no one always goes first."""
    samples: dict[str, list] = {handle.name: [] for handle in handles}
    for index in range(rounds):
        turn = index % max(len(handles), 1)
        for handle in handles[turn:] + handles[:turn]:
            answer = _ask_each([handle], "round", failed)
            if handle.name in answer:
                samples[handle.name].append(answer[handle.name])
        handles[:] = [handle for handle in handles if handle.name not in failed]
    return samples


def _probe_loss(module: nn.Module, build: Callable[[], nn.Module], probe: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The loss of ``module``'s weights (as the model holds them: bf16 under O5) on a fixed batch, in
    fp32 on the CPU by the same code for every contender."""
    fresh = build()
    weights = {name: tensor.detach().float().cpu() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
    fresh.load_state_dict(weights)
    with torch.no_grad():
        return loops.loss_of(fresh(probe[0]), probe[1]).item()


def _quiet() -> None:
    """The peers' banners and hints would bury the benchmark's output."""
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "accelerate", "transformers", "ampddp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


@contextlib.contextmanager
def _peer_state_undone() -> Iterator[None]:
    """What the peers leave in a process for the next group here: Accelerate's one mixed-precision
    state, and the variables HF's TrainingArguments sets for it (ACCELERATE_MIXED_PRECISION=bf16 stays
    after a bf16 group and would make the next group's fp32 Trainer run bf16 autocast)."""
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        if "accelerate.state" in sys.modules:
            sys.modules["accelerate.state"].AcceleratorState._reset_state(True)


# ---- the rows and the plan -----------------------------------------------------------------------------------
@dataclass
class PeerRow(Row):
    """One contender of one group. ``ampddp`` holds this contender's median (a peer's too), ``baseline``
    the hand loop's; ``ratio`` is hand / this (> 1: this contender is faster than the hand loop)."""

    contender: str = ""
    side: str = ""
    vs_best_peer: float | None = None
    best_peer: str = ""
    cpu_ms_per_step: float = 0.0
    minflt_per_step: float = 0.0
    peak_rss_mib: float | None = None
    final_loss: float = 0.0
    reference_loss: float = 0.0
    load_average: list[float] = field(default_factory=list)
    threads: int = 0


def rows_of(result: dict[str, Any]) -> list[PeerRow]:
    """One row per timed contender of a group (none without the hand loop to compare with)."""
    group = Group.of(result["group"])
    contenders = result["contenders"]
    if "hand" not in contenders:
        return []
    walls = {name: [sample[0] for sample in entry["samples"]] for name, entry in contenders.items()}
    peers = [name for name in walls if CONTENDERS[name].side == "peer"]
    best = min(peers, key=lambda name: statistics.median(walls[name]), default="")
    return [_row(group, name, entry, walls, best, result) for name, entry in contenders.items()]


def _row(group: Group, name: str, entry: dict, walls: dict, best: str, result: dict) -> PeerRow:
    mine, hand_times = walls[name], walls["hand"]
    cpu = statistics.median(sample[1] for sample in entry["samples"])
    faults = statistics.median(sample[2] for sample in entry["samples"])
    return PeerRow(f"peers/{group.label}/{name}", statistics.median(mine) * 1e3, statistics.median(hand_times) * 1e3, "ms/step",
                   paired_ratio(mine, hand_times), len(mine), spread(mine), _note(group, name, entry, result), name, CONTENDERS[name].side,
                   paired_ratio(mine, walls[best]) if best else None, best, cpu * 1e3, faults, entry["peak_rss_mib"], entry["loss"],
                   entry["reference_loss"], result["load"], entry["threads"])  # fmt: skip


def _note(group: Group, name: str, entry: dict, result: dict) -> str:
    """What ran (framework, version, its precision setting) and, on the hand loop's row, who was not timed and why."""
    mode = loops.AMPDDP_MODE[group.precision]
    words = {"ampddp-trainer": f"ampddp {mode}", "ampddp-prepare": f"ampddp {mode}",
             "amp-facade": f"amp opt_level {loops.FACADE_LEVEL[group.precision]}",
             "ampddp-o5-no-masters": "ampddp O5 master_weights=False"}.get(name, "")  # fmt: skip
    if name in ("lightning-trainer", "fabric"):
        words = f"lightning {entry['version']} {loops.LIGHTNING_PRECISION[group.precision]}"
    elif entry["version"]:
        words = f"{name.split('-')[0]} {entry['version']}"
    if entry["reference"] != "hand" and name != entry["reference"]:
        words += f"; final loss checked against {entry['reference']} (no masters: not O5's work)"
    if name == "hand" and (result["skipped"] or result["disagreed"]):
        words += "; not timed: " + "; ".join(f"{who}: {why}" for who, why in {**result["skipped"], **result["disagreed"]}.items())
    return words.strip("; ")


def table(rows: list[dict]) -> str:
    """The peers' own table (every measure per contender), for the markdown beside the JSON."""
    mine = [row for row in rows if row["name"].startswith("peers/")]
    if not mine:
        return ""
    lines = ["", "| group | contender | ms/step | vs hand | vs best peer | CPU ms/step | minflt/step | peak RSS MiB | load | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in mine:
        group = row["name"].removeprefix("peers/").rsplit("/", 1)[0]
        best = f"{row['vs_best_peer']:.3f} ({row['best_peer']})" if row["vs_best_peer"] is not None else "-"
        rss = f"{row['peak_rss_mib']:.0f}" if row["peak_rss_mib"] is not None else "-"
        load = "-".join(f"{value:.1f}" for value in row["load_average"])
        lines.append(f"| {group} | {row['contender']} | {row['ampddp']:.3f} | {row['ratio']:.3f} | {best} | {row['cpu_ms_per_step']:.2f} | "
                     f"{row['minflt_per_step']:.0f} | {rss} | {load} | {row['note']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


SMOKE_GROUPS = (("mlp", "fp32"), ("mlp", "o5"), ("gpt", "bf16"))
SMOKE_DDP = ("hand", "ampddp-trainer")


def plan(device: str, budget: Budget) -> list[Group]:
    """Every work at every precision, one process and two; smoke: toy sizes, the one-process groups in
    this process, one DDP group of two contenders."""
    precisions = ["fp32", "bf16", "o5"] + (["fp16", "o2"] if device == "cuda" else [])
    steps, rounds, draws = budget.pick((2, 1, 1), (10, 5, 1), (20, 3, 3))
    works = [("mlp", precision) for precision in precisions] + [("gpt", precision) for precision in precisions] + [("tiny", "fp32")]
    groups = [Group(name, precision, device, budget.size, steps, rounds, draws=draws) for name, precision in works]  # tiny: fixed cost
    if device == "cpu" or torch.cuda.device_count() >= 2:
        groups += [dataclasses.replace(group, world=2) for group in groups]
    if budget.size == "smoke":  # each path once, in seconds: processes of their own take seconds to start, so two contenders
        smoke = [group for group in groups if group.world == 1 and (group.work, group.precision) in SMOKE_GROUPS]
        return [*smoke, Group("mlp", "o5", device, "smoke", steps, rounds, 2, SMOKE_DDP)]
    return groups


def run(device: str, budget: Budget) -> list[Row]:
    """Every group of the plan; smoke runs the one-process groups in this process."""
    rows: list[Row] = []
    for group in plan(device, budget):
        result = run_group(group, fresh=budget.size != "smoke" or group.world > 1)
        _say(result)
        rows += rows_of(result)
    return rows


def _say(result: dict[str, Any]) -> None:
    label = Group.of(result["group"]).label
    for name, why in {**result["skipped"], **result["disagreed"]}.items():
        print(f"peers/{label}: {name} not timed: {why}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``--serve NAME --group JSON``: one contender's process (how ``Remote`` starts them)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--serve", required=True, choices=sorted(CONTENDERS))
    parser.add_argument("--group", required=True, help="a Group as JSON")
    args = parser.parse_args(argv)
    return serve(args.serve, Group.of(json.loads(args.group)))


if __name__ == "__main__":
    sys.exit(main())
