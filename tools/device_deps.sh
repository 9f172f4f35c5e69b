#!/usr/bin/env bash
# The GPU machine has no network and lacks two libraries kiln's text/ needs (PCRE2 and utf8proc
# headers). This fetches their Debian -dev packages here and unpacks them, static archives,
# headers and relocatable pkg-config files, into .cache/device-deps/ (git-ignored); a device call
# carries that folder and tools/gpu_check.sh points pkg-config at it. Usage: tools/device_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest="$PWD/.cache/device-deps"
[ -f "$dest/.done" ] && { echo "$dest"; exit 0; }
rm -rf "$dest" && mkdir -p "$dest/debs"
(cd "$dest/debs" && apt-get download libpcre2-dev libutf8proc-dev >&2)
for f in "$dest"/debs/*.deb; do dpkg -x "$f" "$dest"; done
rm -rf "$dest/debs" "$dest/usr/share"
# Static archives only, so nothing is needed at run time; .pc files relative to their own folder.
find "$dest" -name '*.so*' -delete
sed -i 's|^prefix=.*|prefix=${pcfiledir}/../../..|' "$dest"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
touch "$dest/.done"
echo "$dest"
