#!/usr/bin/env bash
# Installs every Debian package kvferry needs to build, test, benchmark and run its demo.
# Idempotent: packages already present are skipped, and apt is only called when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libzmq3-dev cppzmq-dev libsodium-dev libmsgpack-cxx-dev nlohmann-json3-dev libcpp-httplib-dev
  libmicrohttpd-dev
  libucx-dev ucx-utils
  libspdlog-dev libfmt-dev libcli11-dev libexpected-dev
  libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev
  clang libclang-rt-14-dev clang-format
  python3 iperf3 gnuplot-nox procps iproute2 etcd-server etcd-client
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: must run as root to install packages" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
