#!/bin/sh
# Make the secrets the compose stack reads (compose/README.md, "Keys and secrets"): run once before `up`.
#
#   sh compose/make-secrets.sh [DIR]        # DIR defaults to compose/secrets (SECRETS_DIR in the compose file)
#
# DIR gets:
#   keys/                   the whole CURVE key set (`pagedkv keys generate --pool executor-0 ...`): keep it safe
#   keys-blockd/            what blockd needs: the server keypair, the operator's (its healthcheck runs blockd-cli),
#                           every client's public key
#   keys-executor-N/        executor-N's: the server keypair, its own pool-executor-N keypair, the public keys
#   keys-gateway/           the gateway's: its own keypair and the server's public key
#   api-keys                the gateway's API keys, one a line (clients send `Authorization: Bearer KEY`)
#   deployment-secret       blockd --deployment-secret-file: keys the block hashes it stores in Redis
#   redis-password          Redis' password (blockd --redis-password-file; the healthcheck's redis-cli)
#   redis.conf              `requirepass` for redis-server, so the password is never on a command line
#
# Runs `pagedkv keys generate` (PAGEDKV=/path/to/pagedkv to use another one). The containers run as uid 1000
# (the image's user `pagedkv`): run this as root, or as uid 1000, so the files end up theirs.
set -eu
dir=${1:-$(dirname "$0")/secrets}
pagedkv=${PAGEDKV:-pagedkv}
pools="executor-0 executor-1 executor-2"
if [ -e "$dir/keys" ]; then
  echo "$dir already holds secrets: remove it first to make new ones" >&2
  exit 1
fi
mkdir -p "$dir"
chmod 700 "$dir"
# shellcheck disable=SC2046
"$pagedkv" keys generate "$dir/keys" $(for p in $pools; do printf -- '--pool %s ' "$p"; done)
# One directory per service: the public keys, and only the secret keys that service uses.
only() {
  target=$dir/keys-$1
  shift
  mkdir -p "$target"
  cp "$dir"/keys/*.key "$target"/
  for name in "$@"; do cp "$dir/keys/$name.key_secret" "$target"/; done
  chmod 700 "$target"
  chmod 600 "$target"/*.key_secret
}
only blockd server operator
only gateway gateway
for p in $pools; do only "$p" server "pool-$p"; done
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
(umask 077 && token | sed 's/^/sk-/' >"$dir/api-keys" && token >"$dir/deployment-secret")
password=$(token)
(umask 077 && echo "$password" >"$dir/redis-password" && echo "requirepass $password" >"$dir/redis.conf")
# redis-server may run as its own user (the official image's `redis`): it reads redis.conf.
chmod 644 "$dir/redis.conf"
if [ "$(id -u)" = 0 ]; then
  chown -R 1000:1000 "$dir"
fi
echo "secrets in $dir; the API key clients send is in $dir/api-keys"
