# Prometheus for the simulated cluster, from Debian's package (promtool and the server the CI checks rules
# with), laid out like the upstream prom/prometheus image the real Sparks run: entrypoint the server, data in
# /prometheus owned by nobody, so the monitoring role passes the same arguments to both.
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
