# A Hugging Face-compatible endpoint for the simulated cluster: olah serving local git repos offline,
# so hf_snapshot runs the real huggingface_hub client against it.
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv git ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/hub
COPY build/ca-bundle.crt /tmp/ca-bundle.crt
RUN /opt/hub/bin/pip install --no-cache-dir --cert /tmp/ca-bundle.crt olah==0.5.4 && rm /tmp/ca-bundle.crt
ENTRYPOINT ["/opt/hub/bin/olah-cli"]
