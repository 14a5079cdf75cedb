"""``python -m ampddp.apex``: an unchanged apex-era script runs with ``apex`` resolving to ampddp.apex,
under python, ``-m MODULE``, torchrun (2 processes) and the old ``torch.distributed.launch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.apex.runner import RunnerUsageError, local_rank_flag, main, parse
from ampddp.distributed import free_port

JOB = Path(__file__).resolve().parents[1] / "apex_era_job.py"
REPO = Path(__file__).resolve().parents[2]


def run(args, cwd, timeout=240, env=None):
    merged = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    merged.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=merged)


def reports(out_dir, count):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(count)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_runner_runs_an_unchanged_apex_script_as_python_would(tmp_path, opt_level):
    done = run(["-m", "ampddp.apex", str(JOB), "--opt-level", opt_level, "--steps", "2", "--out", str(tmp_path)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (report,) = reports(tmp_path, 1)
    assert report["has_apex"] and report["apex_module"] == "ampddp.apex.amp"
    assert report["name"] == "__main__"
    assert report["argv"] == [str(JOB), "--opt-level", opt_level, "--steps", "2", "--out", str(tmp_path)]
    assert report["path0"] == str(JOB.parent)
    assert report["output_dtype"] == ("torch.float16" if opt_level == "O1" else "torch.float32")
    assert report["loss_dtypes"] == ["torch.float32"] * 2  # the loss outside the model is fp32, as with apex
    assert report["loss_scale"] == 2.0**16


@pytest.mark.timeout(300)
def test_runner_runs_a_module_with_dash_m_and_passes_a_launcher_local_rank(tmp_path):
    (tmp_path / "apex_era_mod.py").write_text(JOB.read_text())
    done = run(["-m", "ampddp.apex", "--local-rank=3", "-m", "apex_era_mod", "--steps", "1", "--out", str(tmp_path)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (report,) = reports(tmp_path, 1)
    assert report["argv"][0] == str(tmp_path / "apex_era_mod.py")
    assert report["argv"][1:] == ["--local_rank=3", "--steps", "1", "--out", str(tmp_path)]
    assert report["local_rank"] == 3 and report["env_local_rank"] == "3"


def test_without_the_runner_the_script_has_no_apex(tmp_path):
    done = run([str(JOB), "--steps", "1", "--out", str(tmp_path)], cwd=tmp_path)
    assert done.returncode != 0 and "NameError" in done.stderr  # its apex path is switched off: apex is not installed


PROBE = Path(__file__).resolve().parents[1] / "apex_discovery_probe.py"
APEX_MODULES = ("apex", "apex.amp", "apex.parallel", "apex.optimizers", "apex.normalization", "apex.fp16_utils", "amp_C", "apex_C")


@pytest.mark.timeout(300)
def test_under_the_runner_apex_is_found_installed_by_every_standard_check_and_nowhere_else(tmp_path):
    """transformers asks find_spec *and* importlib.metadata.version("apex"); others scan distributions,
    map top-level names to distributions, or run pip show: each answers as for an installed apex 0.1, in
    the runner's process and in the Python processes it starts; without the runner, nothing does."""
    done = run(["-m", "ampddp.apex", str(PROBE)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["version"] == found["distribution"] == found["__version__"] == found["child_version"] == "0.1"
    assert found["metadata"] == ["apex", "0.1"] and found["requires"] == ["packaging>20.6"]
    assert found["files"] == ["amp_C.py", "apex/__init__.py", "apex_C.py"] and found["files_exist"]
    assert found["distributions"] == 1  # listed once, not by both the path finder and the alias hook
    assert found["packages"] == {"apex": ["apex"], "amp_C": ["apex"], "apex_C": ["apex"]}
    assert found["specs"] == dict.fromkeys(APEX_MODULES, True)
    assert "Name: apex\nVersion: 0.1" in found["pip_show"]
    assert found["pkg_resources"] in ("0.1", "no pkg_resources")

    done = run([str(PROBE)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(done.stdout)
    assert plain["version"] == plain["files"] == "PackageNotFoundError" and plain["distributions"] == 0
    assert plain["specs"]["apex"] is False and plain["packages"]["apex"] is None
    assert plain["pip_show"] == plain["child_version"] == "exit 1"
    assert plain["pkg_resources"] in ("DistributionNotFound", "no pkg_resources")

    aliased = "from ampddp.apex.aliasing import alias_apex; alias_apex(); import importlib.metadata as m; "
    aliased += "print(m.version('apex'), sum(d.metadata['Name'] == 'apex' for d in m.distributions()))"
    done = run(["-c", aliased], cwd=tmp_path)
    assert done.stdout.split() == ["0.1", "1"], done.stderr[-2000:]  # a program that aliases itself: the hook answers


@pytest.mark.smoke
@pytest.mark.timeout(400)
def test_torchrun_two_processes_run_the_script_and_agree(tmp_path):
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ampddp.apex", str(JOB)]
    done = run([*args, "--opt-level", "O2", "--out", str(tmp_path)], cwd=tmp_path, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = reports(tmp_path, 2)
    assert first["params"] == second["params"] and first["masters"] == second["masters"]
    assert first["loss_dtypes"] == ["torch.float32"] * 4
    assert "no process group" not in done.stderr  # the script joined its ranks: nothing to warn about


@pytest.mark.timeout(300)
def test_a_script_launched_on_several_processes_that_never_joins_them_is_warned_once_per_rank(tmp_path):
    """torchrun's variables without init_process_group: every rank trains its own copy on all the data."""
    script = tmp_path / "unjoined.py"
    script.write_text(
        "import torch\ntry:\n    from apex import amp\nexcept ImportError:\n    from ampddp import amp\n"
        "for _ in range(2):\n"
        "    model = torch.nn.Linear(4, 4)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    model, optimizer = amp.initialize(model, optimizer, opt_level='O1', verbosity=0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE="2")
    done = subprocess.run(
        [sys.executable, "-m", "ampddp.apex", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("rank 1 of 2: amp.initialize ran with no process group started") == 1, done.stderr
    assert "init_process_group" in done.stderr
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0 and "no process group" not in plain.stderr  # the library (no runner): scripts own their launch


@pytest.mark.timeout(400)
def test_old_torch_distributed_launch_passes_local_rank_in_the_apex_spelling(tmp_path):
    port = str(free_port())
    args = ["-m", "torch.distributed.launch", "--nproc-per-node", "2", "--master-port", port, "-m", "ampddp.apex", str(JOB)]
    done = run([*args, "--steps", "2", "--out", str(tmp_path)], cwd=tmp_path, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = reports(tmp_path, 2)
    assert (first["local_rank"], second["local_rank"]) == (0, 1)
    assert first["params"] == second["params"]


def test_runner_usage_errors_exit_2_with_the_usage(tmp_path, capsys):
    for args, message in [([], "no program given"), (["missing.py"], "does not exist"), (["--bogus"], "unknown runner option"),
                          (["-m"], "-m needs a module name"), (["--local-rank=x", "s.py"], "whole number")]:  # fmt: skip
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert "usage: python -m ampddp.apex" in err or "whole number" in err


def test_parse_and_local_rank_spelling():
    program = parse(["--local_rank", "2", "-m", "pytest", "-x"])
    assert (program.target, program.is_module, program.args, program.local_rank) == ("pytest", True, ["-x"], "2")
    assert local_rank_flag("parser.add_argument('--local-rank', type=int)") == "--local-rank"
    assert local_rank_flag("parser.add_argument('--local_rank')  # or --local-rank") == "--local_rank"
    with pytest.raises(RunnerUsageError):
        parse(["--local-rank"])


@pytest.mark.timeout(180)
def test_under_the_runner_impl_apex_is_refused_and_missing_apex_modules_name_a_replacement(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch\n"
        "from apex import amp\n"
        "import amp_C\n"
        "from apex.fp16_utils import *\n"
        "from apex.multi_tensor_apply import multi_tensor_applier\n"
        "from apex.normalization import FusedLayerNorm\n"
        "from apex.normalization.fused_layer_norm import fused_layer_norm_affine\n"
        "from apex.optimizers import FusedAdam, FusedLAMB\n"
        "from apex.optimizers.fused_sgd import FusedSGD\n"
        "from apex.parallel.LARC import LARC\n"
        "print('PATHS', amp_C.__name__, FP16_Optimizer.__module__, network_to_half.__name__, FusedSGD.__module__)\n"
        "try:\n    import apex.contrib.xentropy\nexcept ModuleNotFoundError as error:\n    print('MISSING', error)\n"
        "try:\n    amp.initialize(torch.nn.Linear(2, 2), opt_level='O1', impl='apex')\n"
        "except Exception as error:\n    print('REFUSED', type(error).__name__, error)\n"
    )
    done = run(["-m", "ampddp.apex", str(script)], cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "PATHS ampddp.apex.amp_C ampddp.apex.fp16_utils.fp16_optimizer network_to_half ampddp.apex.optimizers.fused_sgd" in done.stdout
    assert "MISSING apex.contrib is not provided by ampddp.apex" in done.stdout
    assert "REFUSED ConfigError" in done.stdout and "impl='builtin'" in done.stdout


@pytest.mark.timeout(300)
def test_processes_the_program_spawns_resolve_apex_too(tmp_path):
    script = tmp_path / "spawning.py"
    script.write_text(
        "import multiprocessing as mp\n"
        "import subprocess, sys\n"
        "from apex import amp\n"
        "def work(x):\n    import apex, amp_C\n    return apex.__name__ + ' ' + amp_C.__name__\n"
        "if __name__ == '__main__':\n"
        "    print('FILE', __file__)\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n        print('SPAWNED', pool.map(work, [0])[0])\n"
        "    child = subprocess.run([sys.executable, '-c', 'import apex; print(apex.__name__)'], capture_output=True, text=True)\n"
        "    print('SUBPROCESS', child.stdout.strip())\n"
    )
    done = run(["-m", "ampddp.apex", "spawning.py"], cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"FILE {script}" in done.stdout  # absolute, as python gives __main__.__file__
    assert "SPAWNED ampddp.apex ampddp.apex.amp_C" in done.stdout
    assert "SUBPROCESS ampddp.apex" in done.stdout


SPAWNING_SCRIPT = """
import torch, torch.multiprocessing as mp, torch.nn as nn
from apex import amp

def cast_of_a_layer_never_initialized():
    return str(nn.Linear(2, 2)(torch.randn(1, 2)).dtype)

def worker(rank, out):
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    open(out, "w").write(cast_of_a_layer_never_initialized())

if __name__ == "__main__":
    import sys
    model = nn.Linear(4, 4)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    print(cast_of_a_layer_never_initialized())
    mp.spawn(worker, args=(sys.argv[1],), nprocs=1)
"""


@pytest.mark.timeout(300)
def test_spawned_workers_cast_process_wide_as_the_runners_own_process(tmp_path):
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING_SCRIPT)
    done = run(["-m", "ampddp.apex", str(script), str(tmp_path / "child.txt")], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["torch.float16"]
    assert (tmp_path / "child.txt").read_text() == "torch.float16"


CHECKPOINTING_SCRIPT = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from apex import amp

class Block(nn.Module):  # LayerNorm and GELU on a Linear's fp16 output, as Swin's blocks
    def __init__(self):
        super().__init__()
        self.fc_in, self.norm, self.fc_out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)
    def forward(self, x):
        return self.fc_out(F.gelu(self.norm(self.fc_in(x))))

class Net(nn.Module):
    def __init__(self, use_checkpoint, reentrant):
        super().__init__()
        self.stem, self.blocks, self.head = nn.Linear(16, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 1)
        self.use_checkpoint, self.reentrant = use_checkpoint, reentrant
    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.use_checkpoint else block(x)
        return self.head(x)

def train(use_checkpoint, reentrant=True):
    torch.manual_seed(0)
    model = Net(use_checkpoint, reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level=sys.argv[1], verbosity=0)
    for _ in range(4):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]

reference = train(False)
for reentrant in (True, False):
    weights = train(True, reentrant)
    print("reentrant" if reentrant else "non-reentrant", max(float((a - b).abs().max()) for a, b in zip(reference, weights)))
"""


@pytest.mark.timeout(120)
def test_under_the_runner_a_checkpointed_run_trains_as_without_checkpointing(tmp_path):
    """Swin's --use-checkpoint at O1: the recompute in the backward (inside scale_loss, where the runner's
    op lists are off) casts as the forward did, so the weights end bit for bit as without checkpointing."""
    script = tmp_path / "checkpointing.py"
    script.write_text(CHECKPOINTING_SCRIPT)
    done = run(["-m", "ampddp.apex", str(script), "O1"], cwd=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["reentrant", "0.0", "non-reentrant", "0.0"]
