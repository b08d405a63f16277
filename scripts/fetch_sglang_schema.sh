#!/usr/bin/env bash
# Fetch SGLang's generated HTTP schema (sglang/api/v1/api_types.py, needs only msgspec) from the
# pinned sglang wheel into .cache/sglang/, where the protocol contract test looks for it.
set -euo pipefail
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SGLANG_SCHEMA_CACHE:-$ROOT/.cache/sglang}"
PYTHON="${PYTHON:-python}"
OUT="$CACHE/api_types.py"
if [ -f "$OUT" ] && [ "$(cat "$CACHE/VERSION" 2>/dev/null)" = "$SGLANG_VERSION" ]; then
  echo "$OUT (sglang $SGLANG_VERSION) already present"; exit 0
fi
mkdir -p "$CACHE/wheel"
"$PYTHON" -m pip download --no-deps --only-binary=:all: "sglang==$SGLANG_VERSION" -d "$CACHE/wheel" >&2
WHEEL="$(ls "$CACHE"/wheel/sglang-"$SGLANG_VERSION"-*.whl | head -n1)"
"$PYTHON" - "$WHEEL" "$OUT" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    data = z.read("sglang/api/v1/api_types.py")
with open(out, "wb") as f:
    f.write(data)
PY
echo "$SGLANG_VERSION" > "$CACHE/VERSION"
rm -rf "$CACHE/wheel"
echo "$OUT"
