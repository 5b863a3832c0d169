#!/usr/bin/env bash
# The system packages the real-pair tier drives as clients no one here wrote: Node.js and npm
# (the npm openai package through `pdclient serve`) and curl. Installed from Debian's
# packages when missing and this user may (root, apt-get present); otherwise the tests that
# need them skip and say which package is missing. Seconds when everything is there.
set -euo pipefail
missing=()
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
command -v curl >/dev/null || missing+=(curl)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} from Debian's packages (one time)" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
else
  echo "not installing ${missing[*]} (needs root and apt-get): the tests that drive them will skip" >&2
fi
