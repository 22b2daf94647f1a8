# The API edge for the simulated cluster, from Debian's nginx package, laid out like the upstream nginx image the
# real Sparks run (the command starts with `nginx`, which is on PATH), so the edge role runs both the same way.
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light \
 && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/*
EXPOSE 8443
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
