# alignpipe on NeMo-RL v0.7.0: the image every GPU stage runs in (runtime.image).
#
# NeMo-RL's release image already holds its pinned CUDA/torch 2.11/transformers/vLLM 0.20/
# Ray stack in /opt/nemo_rl_venv (first on PATH) and its source + examples/ in /opt/nemo-rl.
# We add alignpipe with its *core* dependencies (dvc, omegaconf, hydra, pyyaml) plus dvclive,
# constrained to the versions already installed, so nothing NeMo-RL pinned can move: a
# conflict fails the build instead of silently upgrading torch/transformers/ray.
#
# The base is pinned by digest (tags are mutable). To update it (docs/GPU.md):
#   skopeo inspect --format '{{.Digest}}' docker://nvcr.io/nvidia/nemo-rl:v0.7.0
#   # or: docker buildx imagetools inspect nvcr.io/nvidia/nemo-rl:v0.7.0 --format '{{json .Manifest.Digest}}'
# then build with --build-arg NEMO_RL_DIGEST=sha256:... (or edit the default below) and
# set runtime.image in conf/config.yaml to the result (ideally by its own digest).
#
# PLACEHOLDER: the default digest below is all zeros because the real v0.7.0 digest is not
# recorded in this repository's references and could not be looked up offline. A build
# without --build-arg NEMO_RL_DIGEST fails at the pull, by design.
ARG NEMO_RL_IMAGE=nvcr.io/nvidia/nemo-rl
ARG NEMO_RL_TAG=v0.7.0
ARG NEMO_RL_DIGEST=sha256:0000000000000000000000000000000000000000000000000000000000000000

FROM ${NEMO_RL_IMAGE}:${NEMO_RL_TAG}@${NEMO_RL_DIGEST}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The package is installed for its dependencies and entry point. At run time the launcher
# bind-mounts the repository and puts it first on PYTHONPATH, and every stage refuses to run
# an alignpipe other than the repository's: code edits need no rebuild, dependency changes do.
COPY pyproject.toml README.md /opt/alignpipe/
COPY alignpipe /opt/alignpipe/alignpipe

# Constrain to every version already in NeMo-RL's venv (editable/local entries excluded).
RUN uv pip install --no-cache --python /opt/nemo_rl_venv/bin/python \
        --constraint <(uv pip freeze --python /opt/nemo_rl_venv/bin/python | grep -v -e '^-e ' -e ' @ ') \
        "/opt/alignpipe[nemo_rl]" \
    && /opt/nemo_rl_venv/bin/alignpipe --help > /dev/null \
    && /opt/nemo_rl_venv/bin/dvc --version \
    && /opt/nemo_rl_venv/bin/python -c "import alignpipe.engines.nemo_rl.environment as e; assert e.HAVE_NEMO_RL" \
    && /opt/nemo_rl_venv/bin/python -c "import lm_eval.models.vllm_causallms"

# Stages run with cwd = the repository (the launcher's -w); NeMo-RL entry scripts run
# from here. No USER: the launcher passes --user $(id -u):$(id -g) so outputs belong to
# the invoking user, and HOME is set to a writable scratch dir.
WORKDIR /opt/nemo-rl
ENV ALIGNPIPE_NEMO_RL_VERSION=0.7.0 \
    NEMO_RL_DIR=/opt/nemo-rl
