# One image for every Parkade service: `docker run IMAGE parkade tokenizer | scheduler | executor |
# gateway | topics ...` (compose.yaml runs each with its own command).
#
#   docker build -t parkade .                                  # CPU (torch's CPU build)
#   docker build -t parkade-gpu --build-arg TORCH_VARIANT=cu128 .   # CUDA (compose.gpu.yaml)
#
# Layers go from the slowest-changing to the fastest: system packages, torch, the dependencies
# listed in pyproject.toml, then Parkade's own source. Editing the code rebuilds only the last.
FROM python:3.11-slim-bookworm

# torch's build: `cpu`, or a CUDA one (`cu126`, `cu128`, ...): a folder of PyTorch's index.
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# NOTE: a C compiler stays in the image: the executor builds its CPU decode-attention kernel with
# `cc` on first use (without one it falls back to the slower pure-torch backend), and Triton, on
# CUDA, compiles its launcher stubs the same way.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# NOTE: a virtual environment rather than the system site-packages, so that the same lines work on
# the official image (Python in /usr/local) and on a plain Debian one (PEP 668 refuses a system-wide
# pip install there).
RUN python3 -m venv "$VIRTUAL_ENV"

# torch first, pinned, from PyTorch's index for the variant: an unpinned install from PyPI would
# pull a multi-GB CUDA build into the CPU image. A wheel already at hand can be dropped in
# wheels/ of the build context (`torch-2.13.0+cpu-...whl`: version and variant must match); it is
# used instead of the index (tests/compose/run.sh does this: no network to PyTorch's index there).
# NOTE: `wheel[s]` is a pattern, so that a context without wheels/ still builds; .dockerignore is
# the file that has to come with it (a COPY needs one source that exists) because it rarely
# changes, and any change to it would install torch again.
COPY .dockerignore wheel[s] /tmp/wheels/
RUN set -eu; \
    local_wheel="$(ls /tmp/wheels/torch-${TORCH_VERSION}+${TORCH_VARIANT}-*.whl 2>/dev/null | head -n 1)"; \
    if [ -n "$local_wheel" ]; then \
        pip install "$local_wheel"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    fi; \
    rm -rf /tmp/wheels

# The dependencies alone (read from pyproject.toml; torch is there already), so that a change to
# the source does not install them again.
COPY pyproject.toml /tmp/parkade/pyproject.toml
RUN python -c "import tomllib; \
project = tomllib.load(open('/tmp/parkade/pyproject.toml', 'rb'))['project']; \
open('/tmp/parkade/requirements.txt', 'w').write('\n'.join(project['dependencies']) + '\n')" \
    && pip install -r /tmp/parkade/requirements.txt

# Parkade itself (no test extras). .dockerignore keeps tests, docs and local state out.
COPY . /tmp/parkade/src
RUN pip install /tmp/parkade/src \
    && rm -rf /tmp/parkade \
    && mkdir -p /opt/parkade /models \
    && ln -s "$(python -c 'from parkade.models import DEFAULT_MODEL; print(DEFAULT_MODEL)')" \
        /opt/parkade/stories260K

# The shipped model is also at /opt/parkade/stories260K (what compose.yaml passes by default);
# other models go in /models (a volume in compose.yaml).
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin parkade
USER parkade
WORKDIR /home/parkade

# Prometheus metrics (--metrics-port / PARKADE_METRICS_PORT) and the gateway's HTTP API.
EXPOSE 9100 8000

CMD ["parkade", "--help"]
