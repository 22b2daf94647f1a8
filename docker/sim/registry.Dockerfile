# The container registry the simulated cluster pulls the engine image from (Debian's distribution/registry).
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker-registry \
 && rm -rf /var/lib/apt/lists/*
COPY docker/sim/registry.yml /etc/docker/registry/config.yml
EXPOSE 5000
ENTRYPOINT ["/usr/bin/docker-registry", "serve", "/etc/docker/registry/config.yml"]
