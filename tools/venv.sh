#!/usr/bin/env bash
# Print the path of a venv holding a requirements file, creating it once per content hash.
# Kept outside the checkout (CI clones afresh each run) and reused while the file is unchanged.
set -euo pipefail
req="$1"
cache="${PDCLIENT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdclient}"
# The key covers the file and the files it includes with `-r`.
includes=$(sed -n 's/^-r[[:space:]]*//p' "$req" | sed "s|^|$(dirname "$req")/|")
hash=$(cat "$req" $includes | sha256sum | cut -c1-12)
venv="$cache/venv-$(basename "$req" .txt)-$hash"
if [ ! -f "$venv/.ready" ]; then
  mkdir -p "$cache"
  exec 9>"$cache/.venv.lock"
  flock 9
  if [ ! -f "$venv/.ready" ]; then
    echo "creating $venv from $req (one time)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
    touch "$venv/.ready"
  fi
fi
echo "$venv"
