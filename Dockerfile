# The FlatCake image: operator, node agent (prepare, serve, reclaim) and benchmark tools, one command.
FROM python:3.11-slim-bookworm
# Node preparation runs these on the host's devices: mdadm (RAID-0), xfsprogs (mkfs.xfs),
# util-linux (wipefs and blkid to find data that must not be formatted, nsenter for the opt-in kubelet
# restart, fallocate), fio (the benchmark's limit).
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        mdadm xfsprogs util-linux fio \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/flatcake
COPY requirements/runtime.txt requirements/peers.txt requirements/
RUN pip install --no-cache-dir -r requirements/runtime.txt
# Mooncake's transfer engine: cross-node reads (cluster.listen / cluster.peers); its dependencies are in runtime.txt.
RUN pip install --no-cache-dir --no-deps -r requirements/peers.txt
COPY . .
RUN pip install --no-cache-dir --no-deps . && rm -rf /opt/flatcake/tests
ENV PYTHONSAFEPATH=1
ENTRYPOINT []
CMD ["flatcake", "--help"]
