"""Opt level O6: O4 with the eligible linear layers' matmuls in fp8 (torchao's Float8Linear, on the
CPU through torch's own fp8 matmul): which layers convert and why the others do not, numerics
against O4, checkpoints that move between O4 and O6 and load without torchao, compile, the facade."""

from __future__ import annotations

import builtins
import contextlib
import logging

import pytest
import torch
from helpers import HAS_TORCHAO, NO_TORCHAO, O6_SMALL_MODEL
from resume_helpers import final_state, make_trainer
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampddp import AmpUsageError, ConfigError, Precision
from ampddp.amp import Amp
from ampddp.checkpoint.inspect import summarize
from ampddp.distributed.full_state import plain_tensor
from ampddp.observe import Reporting, read_metrics
from ampddp.precision.fp8 import EagerFp8Warning, plan_fp8
from ampddp.zoo.models import GPT
from ampddp.zoo.text import ByteWindows, corpus_bytes

pytestmark = pytest.mark.skipif(not HAS_TORCHAO, reason=NO_TORCHAO)


class Mixed(nn.Module):
    """A linear layer of every kind the fp8 plan tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.subclassed = nn.modules.linear.NonDynamicallyQuantizableLinear(64, 64)
        self.odd = nn.Linear(64, 40)
        self.small = nn.Linear(40 - 8, 16)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        self.head = nn.Linear(64, 10)


def reasons(model: nn.Module, **settings) -> dict[str, str]:
    options = {"recipe": "rowwise", "skip": None, "min_size": 32, **settings}
    return {v.name: v.reason for v in plan_fp8(model, options["recipe"], options["skip"], options["min_size"])}


def test_the_plan_says_which_linear_layers_run_in_fp8_and_why_the_others_do_not():
    plan = reasons(Mixed())
    assert plan == {
        "stem": "the first linear layer (kept bf16 unless precision.fp8_filter is set)",
        "subclassed": "a NonDynamicallyQuantizableLinear (a subclass of nn.Linear: its forward may not be Linear's)",
        "odd": "dims not multiples of 16 (fp8 matmuls need them)",
        "small": "a dim below precision.fp8_min_size=32",
        "body.0": "fp8",
        "body.1": "fp8",
        "head": "the last linear layer (kept bf16 unless precision.fp8_filter is set)",
    }
    assert reasons(Mixed(), skip=("body.1",))["stem"] == "fp8"  # a filter replaces the first/last default
    assert reasons(Mixed(), skip=("body.*",))["body.0"] == "matches precision.fp8_filter 'body.*'"
    assert reasons(Mixed(), skip=(), min_size=None)["body.0"].startswith("too small for fp8 to pay off with rowwise scaling")
    big = nn.Sequential(nn.Linear(64, 64), nn.Linear(4096, 8192), nn.Linear(64, 64))
    assert reasons(big, min_size=None)["1"] == "fp8"  # torchao's H100 sizes: large enough for rowwise


def test_layers_fp8_would_change_are_left_alone_and_say_why():
    altered = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    altered[1].register_parameter("lora_a", nn.Parameter(torch.zeros(4, 64)))
    altered[2].register_forward_hook(lambda module, args, output: None)
    altered[3] = nn.utils.parametrizations.weight_norm(altered[3])
    plan = reasons(altered, skip=())
    assert plan["1"] == "has own tensors (lora_a), which fp8's Float8Linear would not carry over"
    assert plan["2"] == "has hooks, which fp8's Float8Linear would not carry over"
    assert plan["3"].startswith("a ParametrizedLinear") and plan["4"] == plan["0"] == "fp8"
    assert reasons(nn.Linear(64, 64), skip=()) == {
        "(the model)": "the model itself (a conversion replaces a layer inside a model: wrap it, e.g. in nn.Sequential)"
    }


def test_only_o6_runs_a_model_an_o6_set_up_converted():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    Precision("O6", overrides=O6_SMALL_MODEL).build_engine().setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    for mode in ("O4", "native-bf16"):
        with pytest.raises(AmpUsageError, match=r"models\[0\] layer '0' runs in fp8 \(torchao's Float8Linear, from an O6 set-up\)"):
            Precision(mode).build_engine().setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(ConfigError, match=r"NVIDIA apex's amp has no O6; use impl builtin"):
        Precision("O6", impl="apex").build_engine()


def test_fp8_settings_are_o6_only_and_checked():
    with pytest.raises(ConfigError, match=r"fp8_recipe, fp8_min_size apply to opt level O6 \(fp8 matmuls\), not to O4"):
        Precision("O4", overrides={"fp8_recipe": "rowwise", "fp8_min_size": 16}).build_engine()
    with pytest.raises(ConfigError, match=r"fp8_recipe='rowwize' is not valid \(did you mean 'rowwise'\?\); valid: rowwise, tensorwise"):
        Precision("O6", overrides={"fp8_recipe": "rowwize"}).build_engine()
    with pytest.raises(ConfigError, match=r"fp8_filter='head' is not valid; give a list of layer name patterns"):
        Precision("O6", overrides={"fp8_filter": "head"}).build_engine()


def test_without_torchao_o6_is_one_line_naming_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ConfigError, match=r"opt level O6 runs its matmuls in fp8 through torchao, which is not installed .*ampddp\[fp8\]"):
        Precision("O6").build_engine()  # at once: a recipe check refuses it before any work


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(256, layers=2, width=64, heads=2, context=32)


def gpt_batches(steps: int):
    windows = ByteWindows(corpus_bytes()[:60_000], 32)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        chosen = [windows[int(index)] for index in torch.randint(len(windows), (16,), generator=generator)]
        yield {key: torch.stack([sample[key] for sample in chosen]) for key in chosen[0]}


class Float8Matmuls(TorchDispatchMode):
    """Counts matmuls dispatched with torchao's fp8 tensors as their operands."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += all(type(a).__name__ == "Float8TrainingTensor" for a in args[-2:])
        return func(*args, **(kwargs or {}))


def _fed_by_fp8(node: object, depth: int = 4) -> bool:
    """Whether a graph value is an fp8 tensor or made from one by a few casts, scalings and transposes: an emulated fp8
    matmul (a CPU without torch's fp8 matmul, ``hardware.emulates_fp8``) multiplies such upcasts."""
    if not isinstance(node, torch.fx.Node):
        return False
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    return depth > 0 and node.op == "call_function" and bool(node.args) and _fed_by_fp8(node.args[0], depth - 1)


def _fp8_matmul(node: torch.fx.Node) -> bool:
    if node.target is torch.ops.aten._scaled_mm.default:
        return True
    return node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and all(_fed_by_fp8(a) for a in node.args[-2:])


class ScaledMatmulsInGraphs:
    """A torch.compile backend (AOT autograd, run eagerly) counting fp8 matmuls (torch's ``_scaled_mm``, or the
    emulation's product of fp8 operands cast up) in the forward and backward graphs it is given."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.count = 0
        self.backend = aot_autograd(fw_compiler=self._counted, bw_compiler=self._counted)

    def _counted(self, graph: torch.fx.GraphModule, example_inputs):
        self.count += sum(_fp8_matmul(node) for node in graph.graph.nodes)
        return graph.forward


def gpt_losses(mode: str, overrides: dict | None = None, steps: int = 50, compile: bool = False) -> tuple[list[float], int]:
    """Losses of ``steps`` AdamW steps of a small GPT, and how many matmuls ran in fp8: in the first
    forward, or (``compile``) in the compiled graphs."""
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = Precision(mode, overrides=overrides or {}).build_engine()
    engine.setup([model], [optimizer])
    graphs = ScaledMatmulsInGraphs()
    forward = torch.compile(model, backend=graphs.backend) if compile else model
    losses, seen = [], Float8Matmuls()
    for index, batch in enumerate(gpt_batches(steps)):
        with seen if index == 0 and not compile else contextlib.nullcontext(), engine.forward_context():
            loss = forward(**batch)["loss"]
        engine.backward(loss)
        engine.step(optimizer)
        engine.zero_grad(optimizer)
        losses.append(loss.item())
    engine.teardown()
    return losses, graphs.count if compile else seen.count


def largest_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


FP8_STEPS = 8
"""Steps each recipe trains against O4: torch's CPU fp8 matmuls are slow reference kernels on some CPUs
(Intel with AMX: 2.6 s a step of this GPT, where O4 takes 0.04 s)."""


def test_o6_runs_the_eligible_matmuls_in_fp8_and_follows_o4():
    # Measured over these 8 steps: 0.11% (rowwise) and 0.05% (tensorwise) at most from O4's losses.
    reference, none = gpt_losses("O4", steps=FP8_STEPS)
    assert none == 0
    for recipe in ("rowwise", "tensorwise"):
        losses, fp8 = gpt_losses("O6", {"fp8_min_size": 16, "fp8_recipe": recipe}, steps=FP8_STEPS)
        assert fp8 == 11, f"{recipe}: {fp8} matmuls in fp8 (2 blocks x 6 linear layers: q, k, v, proj, the MLP's two; less the first one)"
        assert largest_gap(losses, reference) <= 1e-2, (recipe, largest_gap(losses, reference))
        assert losses[-1] < losses[0] - 1.5


def test_o6_compiles_with_its_fp8_matmuls_in_the_graphs_and_trains_as_eager():
    eager, _ = gpt_losses("O6", O6_SMALL_MODEL, steps=3)
    compiled, fp8 = gpt_losses("O6", O6_SMALL_MODEL, steps=3, compile=True)
    assert compiled == pytest.approx(eager, rel=1e-3)
    assert fp8 == 3 * 13, f"{fp8} fp8 matmuls in the graphs: 13 layers (2 blocks x 6, the head), each 1 forward + 2 backward"


def test_o6_checkpoints_move_to_o4_and_back_and_load_without_torchao(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ampddp")
    make_trainer(tmp_path, "O6", max_steps=3, report=Reporting(progress="off", plots=False)).fit()
    summary = summarize(tmp_path)
    assert summary["mode"] == "O6" and summary["fp8_layers"] == ["0"] and summary["fp8_recipe"] == "rowwise"
    make_trainer(tmp_path, "O4", max_steps=5, report=Reporting(progress="off", plots=False)).fit()
    make_trainer(tmp_path, "O6", max_steps=7, report=Reporting(progress="off", plots=False)).fit()
    state = final_state(tmp_path)
    assert state["progress"]["global_step"] == 7
    # metrics.jsonl says in which mode each stretch ran, and O6's table where it starts.
    records = read_metrics(tmp_path)
    assert [(r["step"], r["precision"]) for r in records if r["kind"] == "start"] == [(0, "O6"), (3, "O4"), (5, "O6")]
    assert [(r["step"], r["in_fp8"]) for r in records if r["kind"] == "fp8_layers"] == [(0, 1), (5, 1)]
    plain = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    plain.load_state_dict(state["model"])  # the keys of nn.Linear: no torchao needed to read the weights
    assert "1 of 2 linear layer(s) in fp8" in caplog.text
    emulated = [r.message for r in caplog.records if "has no fp8 matmul hardware: its fp8 matmuls run emulated" in r.message]
    assert len(emulated) == 2 and emulated[0].startswith("precision O6 on cpu is slower than fp32 here"), "once per O6 set-up"


def test_the_amp_facade_takes_o6_with_its_settings(caplog):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = Amp()
    with caplog.at_level(logging.WARNING, logger="ampddp.precision"):
        model, optimizer = amp.initialize(model, optimizer, opt_level="O6", fp8_min_size=16, verbosity=0)
    assert sum("fp8 matmuls run emulated" in r.message for r in caplog.records) == 1
    assert type(model[2]).__name__ == "Float8Linear" and type(model[0]) is nn.Linear
    before = model[2].weight.detach().clone()
    loss = model(torch.randn(8, 32)).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert not torch.equal(model[2].weight, before) and model[2].weight.dtype == torch.float32
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0


def test_layers_are_named_inside_wrappers_and_per_model_when_a_set_up_has_several():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    compiled = torch.compile(model, backend="aot_eager")
    assert list(reasons(nn.DataParallel(compiled), skip=("1",))) == ["0", "1", "2"]  # not module._orig_mod.1
    assert reasons(compiled, skip=("1",))["1"] == "matches precision.fp8_filter '1'"
    first, second = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64))
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    engine = Precision("O6", overrides=O6_SMALL_MODEL).build_engine()
    engine.setup([first, second], [optimizer])
    assert engine.precision_state().fp8_layers == ("models[0].0", "models[0].1", "models[1].0")
    engine.teardown()


def test_fp8_outside_torch_compile_on_the_watched_device_warns_once(caplog):
    # On a GPU (the watched device) eager fp8 is slower than bf16; compiled, the check is traced away.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    Precision("O6", overrides=O6_SMALL_MODEL).build_engine().convert_storage(model)
    for devices, compiled, warnings_expected in ((("cpu",), True, 0), (("cpu",), False, 1), (("cuda",), False, 0)):
        caplog.clear()
        handles = EagerFp8Warning(devices=devices).install(model)
        assert len(handles) == 3
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with caplog.at_level(logging.WARNING, logger="ampddp"):
            for _ in range(2):
                run(torch.randn(4, 32))
        warnings = [r.message for r in caplog.records if "without torch.compile" in r.message]
        assert len(warnings) == warnings_expected, (devices, compiled, warnings)
        assert all("fp8 layer 0 runs" in warning for warning in warnings)
        for handle in handles:
            handle.remove()


def test_checkpoints_take_fp8_all_gather_weights_as_plain_tensors_with_or_without_a_scale():
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    data = torch.randn(16, 32)
    for scale in (None, torch.tensor(2.0)):  # the scale a forward's refresh leaves on the live weight
        wrapped = WeightWithDynamicFloat8CastTensor(data, LinearMMConfig(), torch.float8_e4m3fn, scale)
        plain = plain_tensor(wrapped)
        assert type(plain) is torch.Tensor and plain is data
    assert plain_tensor(data) is data


WITHOUT_FP8_MATMUL = """
import torch
from torch import nn
from ampddp import Precision
from ampddp.precision.hardware import cpu_fp8_matmul
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
meta = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to("meta")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
settings = {"fp8_min_size": 16, "verbosity": 0}
Precision("O6", overrides=settings).build_engine().convert_storage(meta, torch.device("cpu"))
engine = Precision("O6", overrides=settings).build_engine()
engine.setup([model], [optimizer])
for _ in range(2):
    with engine.forward_context():
        loss = model(torch.randn(16, 32)).float().pow(2).mean()
    engine.backward(loss)
    engine.step(optimizer)
print(cpu_fp8_matmul(), type(model[2]).__name__, model[2].config.emulate, meta[2].config.emulate, torch.isfinite(loss).item())
"""


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith(("AVX", "AMX")), reason="oneDNN's ISA cap is x86's")
def test_o6_trains_emulated_on_a_cpu_without_torchs_fp8_matmul():
    # oneDNN's CPU fp8 matmul needs AVX512-FP16; on a CPU that has it, held to AVX-512 BF16 (an AMD EPYC's ISA) it refused to
    # build one, and O6 failed in its first backward. A CPU without AVX512-FP16 gets torch's own reference kernel instead,
    # cap or not (an Intel Xeon with AVX-512 and no BF16): there O6 uses it. Also for a model on the meta device, told where
    # it will train.
    import os
    import subprocess
    import sys
    from pathlib import Path

    environment = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_FP8_MATMUL], env=environment, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    served, layer, emulated, meta_emulated, finite = done.stdout.split()
    assert (layer, finite) == ("Float8Linear", "True")
    assert emulated == meta_emulated == str(served == "False"), done.stdout
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "avx512_fp16" in cpuinfo.read_text().split():
        assert served == "False", "the cap takes oneDNN's fp8 matmul away on a CPU with AVX512-FP16"
