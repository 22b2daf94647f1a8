# A simulated DGX Spark: its own sshd (Ansible and head->worker rsync reach it over SSH, as on real
# hardware) and its own dockerd (rank containers use network_mode host inside it, as on real hardware).
ARG BASE_IMAGE=glm53-sim/base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      docker.io openssh-server openssh-client rsync python3 python3-requests python3-docker \
      iproute2 iputils-ping procps ca-certificates curl sudo python3-venv python3-pip zstd \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd /root/.ssh /etc/docker \
 && chmod 700 /root/.ssh \
 && sed -i 's/^#\?PermitRootLogin.*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config
# The owner's account, as DGX OS makes it: uid 1000, in the docker group, sudo without a password (what the
# collection's root steps use: page-cache drop, earlyoom, its sudoers drop-in). Ansible logs in as this user
# (inventory/sim); root login stays possible for the one root case the tests keep.
RUN useradd --create-home --uid 1000 --shell /bin/bash --groups docker,sudo spark \
 && install -d -o spark -g spark -m 700 /home/spark/.ssh \
 && printf 'spark ALL=(ALL) NOPASSWD:ALL\n' > /etc/sudoers.d/90-spark \
 && chmod 440 /etc/sudoers.d/90-spark
# Trust what the machine building the simulation trusts (TLS-intercepting proxies), like a real site CA.
COPY build/ca-bundle.crt /usr/local/share/ca-certificates/build-host.crt
RUN update-ca-certificates >/dev/null
COPY docker/sim/node-entrypoint.sh /usr/local/sbin/node-entrypoint
ENTRYPOINT ["/usr/local/sbin/node-entrypoint"]
