# node-exporter for the simulated cluster, from Debian's prometheus-node-exporter package, laid out like the
# upstream prom/node-exporter image the real Sparks run (entrypoint the exporter, running as nobody).
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus-node-exporter \
 && rm -rf /var/lib/apt/lists/*
USER nobody
EXPOSE 9100
ENTRYPOINT ["/usr/bin/prometheus-node-exporter"]
