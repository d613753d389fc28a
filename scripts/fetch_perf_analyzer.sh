#!/usr/bin/env bash
# perf_analyzer from the tritonclient==2.51.0 wheel (the release that matches the
# bundled server) and the libb64 it needs, into DEST/bin and DEST/lib. Needs a
# package registry; scripts/install_perf.sh and scripts/pack_offline.sh call it.
#
#   scripts/fetch_perf_analyzer.sh DEST [PYTHON]
set -euo pipefail
dest=$(realpath -m "$1")
python=${2:-python3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dest/bin" "$dest/lib"
"$python" -m pip download --disable-pip-version-check -q --no-deps tritonclient==2.51.0 -d "$tmp"
(cd "$tmp" && "$python" -m zipfile -e tritonclient-2.51.0-*.whl wheel)
install -m 755 "$tmp"/wheel/tritonclient-2.51.0.data/data/bin/perf_analyzer "$dest/bin/"
(cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get download libb64-0d; })
dpkg -x "$tmp"/libb64-0d_*.deb "$tmp/b64"
cp -a "$tmp"/b64/usr/lib/*/libb64.so.0d* "$dest/lib/"
