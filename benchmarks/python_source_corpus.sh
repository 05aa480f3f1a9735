#!/usr/bin/env bash
# Prepare a corpus of about MB megabytes of Python source taken from this interpreter's site-packages,
# for GPU studies whose runs must not repeat data (the embedded default corpus repeats within minutes
# on an H100). The files are copied first: `hydra-lm prepare` refuses a directory holding .pt files.
#   bash benchmarks/python_source_corpus.sh OUT_DIR [MB]
set -euo pipefail
out=${1:?usage: python_source_corpus.sh OUT_DIR [MB]}
mb=${2:-100}
[ -f "$out/meta.json" ] && { echo "$out is prepared already"; exit 0; }
src=$(mktemp -d)
python3 - "$src" "$mb" <<'PY'
import shutil, sys, sysconfig
from pathlib import Path
dst, budget = Path(sys.argv[1]), float(sys.argv[2]) * 1e6
root = Path(sysconfig.get_paths()["purelib"])
total = 0
for i, path in enumerate(sorted(root.rglob("*.py"))):
    if total >= budget:
        break
    size = path.stat().st_size
    if 0 < size < 512_000:
        shutil.copyfile(path, dst / f"{i:07d}_{path.name}")
        total += size
print(f"copied {total / 1e6:.1f} MB of Python source from {root}")
PY
python3 -m hydra_lm prepare --inputs "$src" --out "$out" --no_progress
rm -rf "$src"
