# The mirror-agent image, built from this workspace, where a registry serves the base images.
#   docker build -t etcd-mirror/agent:dev .
# Without a registry, scripts/image.sh builds the same image (binary, its shared libraries, a CA
# bundle, user 10001, the same ENTRYPOINT/CMD/EXPOSE) with docker import; the test suite builds
# and runs that one (harness/tests/image.rs, scenario agent-container).
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p mirror-agent

# ca-certificates: the system roots a side uses when its tls block names no ca_file.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 mirror
COPY --from=build /src/target/release/mirror-agent /usr/local/bin/mirror-agent
USER 10001
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/mirror-agent"]
CMD ["run", "--config", "/etc/etcd-mirror/mirror.toml", "--listen", "0.0.0.0:8080", "--log-format", "json"]
