#!/usr/bin/env bash
# Builds the agent image etcd-mirror/agent:dev with no registry: the release binary, the shared
# libraries ldd lists, a CA bundle (for sides whose tls block names no ca_file) and a non-root
# user (10001, "mirror"), put together with `docker import` as the etcd images are. The
# Dockerfile does the same where a registry is reachable. Skips the import when the image
# already holds this binary. Installs what it lacks first (scripts/setup.sh).
#
#   scripts/image.sh            # then: docker run etcd-mirror/agent:dev --help
#
# MIRROR_IMAGE_PROFILE=dev packs the debug binary instead: the tests check the image's layout,
# user, ports and args, which are the same, and a release build of every dependency would add
# minutes to each CI run; the agent has no release-only code. MIRROR_IMAGE_BIN=FILE packs FILE
# as it is, with no build (what scripts/test.sh does with the debug agent its workspace build
# just made: `cargo build -p mirror-agent` alone would compile ~60 crates again with another
# feature set, 1.6 min of a CI run).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/setup.sh

log() { printf 'image: %s\n' "$*" >&2; }
tag="etcd-mirror/agent:dev"

if ! docker info >/dev/null 2>&1; then
  log "no Docker engine answers"; exit 1
fi
if [ ! -f /etc/ssl/certs/ca-certificates.crt ]; then
  log "apt-get install ca-certificates"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates >/dev/null
fi

if [ -n "${MIRROR_IMAGE_BIN:-}" ]; then
  bin="$MIRROR_IMAGE_BIN"
  [ -x "$bin" ] || { log "MIRROR_IMAGE_BIN: $bin is not an executable"; exit 2; }
else
  case "${MIRROR_IMAGE_PROFILE:-release}" in
    release) cargo build --release --locked --quiet -p mirror-agent; dir=release ;;
    dev) cargo build --locked --quiet -p mirror-agent; dir=debug ;;
    *) log "MIRROR_IMAGE_PROFILE: ${MIRROR_IMAGE_PROFILE} (release or dev)"; exit 2 ;;
  esac
  bin="${CARGO_TARGET_DIR:-$repo/target}/$dir/mirror-agent"
fi
sum="$(cat "$bin" /etc/ssl/certs/ca-certificates.crt "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ "$(docker image inspect -f '{{ index .Config.Labels "etcd-mirror.build" }}' "$tag" 2>/dev/null)" = "$sum" ]; then
  log "$tag is up to date"
  exit 0
fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/etc/etcd-mirror" "$root/tmp"
chmod 1777 "$root/tmp"
install -m 0755 "$bin" "$root/usr/local/bin/mirror-agent"
# Every shared library the binary links, at the path the loader looks for it.
ldd "$bin" | grep -o '/[^ ]*' | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/sbin/nologin\nmirror:x:10001:10001:etcd-mirror:/nonexistent:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nmirror:x:10001:\n' >"$root/etc/group"

log "docker import $tag"
tar --numeric-owner --owner=0 --group=0 -C "$root" -c . | docker import \
  --change 'USER 10001:10001' \
  --change 'EXPOSE 8080' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENTRYPOINT ["/usr/local/bin/mirror-agent"]' \
  --change 'CMD ["run", "--config", "/etc/etcd-mirror/mirror.toml", "--listen", "0.0.0.0:8080", "--log-format", "json"]' \
  --change "LABEL etcd-mirror.build=$sum" \
  - "$tag" >/dev/null
log "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
