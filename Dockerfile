# ampddp on NVIDIA GPUs.
#   docker build -t ampddp .                                   # ampddp only
#   docker build -t ampddp:apex --build-arg WITH_APEX=1 .       # plus apex 25.04 (apex.amp, apex DDP)
#   docker run --gpus all --rm ampddp                          # trains the quickstart recipe
# The base image already has PyTorch and torchvision built for CUDA; pip keeps them. NGC 25.12 holds
# torch 2.10.0a0 (CUDA 13.1, Python 3.12), the oldest torch ampddp supports; 25.04 (torch 2.7) is refused.
# For a reproducible build pin it by digest (docker buildx imagetools inspect nvcr.io/nvidia/pytorch:25.12-py3):
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3@sha256:<digest> -t ampddp .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ARG WITH_APEX=0
ARG APEX_TAG=25.04

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/ampddp
COPY setup.py pyproject.toml README.md ./
COPY src ./src
COPY recipes ./recipes
COPY examples ./examples

# Install ampddp without replacing the image's CUDA build of torch/torchvision: its other
# requirements (setup.py install_requires) by hand, plus matplotlib, the plots extra.
RUN python -m pip install --no-deps -e . \
    && python -m pip install "numpy>=1.22" "PyYAML>=6" "tqdm>=4" "scikit-learn>=1.3" "xxhash>=3.0" "safetensors>=0.4" "matplotlib>=3.7"

# apex from its last tag that still has apex.amp and apex.parallel (removed upstream in 25.05+).
RUN if [ "$WITH_APEX" = "1" ]; then \
        python -m pip uninstall -y apex \
        && python -m pip install -v --no-build-isolation \
            --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
            "git+https://github.com/NVIDIA/apex.git@${APEX_TAG}" \
        && python -c "import apex.amp, apex.parallel"; \
    fi

RUN useradd --create-home --uid 1000 trainer && mkdir -p /work && chown trainer /work
USER 1000
WORKDIR /work

CMD ["ampddp", "train", "/opt/ampddp/recipes/quickstart.yaml", "trainer.run_dir=/work/runs/quickstart"]
