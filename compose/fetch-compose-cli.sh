#!/bin/sh
# `make compose-cli`: the Compose v2 CLI for tests/compose where `docker compose` is not installed (CI, a fresh
# machine): Debian's docker-compose package of the release after bookworm (Compose 2.x, the same binary as the
# CLI plugin, which also runs standalone) is downloaded with apt from this machine's Debian mirror, unpacked, and
# its binary copied to DIR/docker-compose. Nothing is installed system-wide. Where that cannot be done it says
# why and exits 0: tests/compose then skips, saying so too.
set -eu
dir=${1:-.compose-cli}
say() { echo "compose-cli: $*"; }
if docker compose version >/dev/null 2>&1; then
  say "docker compose is installed: nothing to fetch"
  exit 0
fi
if [ -x "$dir/docker-compose" ] && "$dir/docker-compose" version --short >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
  say "no apt-get and dpkg here to fetch it with: tests/compose will skip"
  exit 0
fi
mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
  | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)
if [ -z "$mirror" ]; then
  say "no Debian mirror in this machine's apt sources: tests/compose will skip"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/x"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} trixie main" >"$work/sources.list"
set -- -o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/dev/null \
  -o "Dir::State::Lists=$work/lists" -o Dir::State::status=/dev/null -o "Dir::Cache=$work/cache"
if apt-get "$@" update -qq >"$work/log" 2>&1 && (cd "$work" && apt-get "$@" download docker-compose >>"$work/log" 2>&1); then
  dpkg -x "$work"/docker-compose_*.deb "$work/x"
  mkdir -p "$dir"
  cp "$work/x/usr/libexec/docker/cli-plugins/docker-compose" "$dir/docker-compose"
  say "Compose $("$dir/docker-compose" version --short) in $dir"
else
  say "could not download Debian's docker-compose (tests/compose will skip):"
  tail -n 5 "$work/log"
fi
