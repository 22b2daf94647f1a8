# The container registry the simulated cluster pulls the engine base image from (Debian's distribution/registry),
# with htpasswd authentication (apache2-utils' htpasswd writes the file at start from the sim credentials).
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker-registry apache2-utils \
 && rm -rf /var/lib/apt/lists/*
COPY docker/sim/registry.yml /etc/docker/registry/config.yml
COPY docker/sim/registry-entrypoint.sh /usr/local/bin/registry-entrypoint.sh
EXPOSE 5000
ENTRYPOINT ["/usr/local/bin/registry-entrypoint.sh"]
