# The mirror-agent image, built from this workspace.
#   docker build -t etcd-mirror/agent .
# (Needs a registry for the base images; the test suite never builds it.)
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
