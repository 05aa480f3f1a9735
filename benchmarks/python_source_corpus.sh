#!/usr/bin/env bash
# Prepare a corpus of about MB megabytes of source code taken from this machine, for GPU studies whose
# runs must not repeat data (the embedded default corpus repeats within minutes on an H100).
#   bash benchmarks/python_source_corpus.sh OUT_DIR [MB] [py|code]
# py (default): the Python files of this interpreter's site-packages (the device image holds 381 MB:
#   110.7M training tokens at vocabulary 8192, fewer than a 3-minute run of a small model reads).
# code: those first, then C/C++/CUDA sources and headers, type stubs and reStructuredText/Markdown docs
#   from site-packages, the standard library and the system's and CUDA's include directories (on the
#   device image: 677.9 MB in 62,307 files, 217.2M training tokens in 2 minutes; no 3-minute run of the
#   100M models at batch 64 reads it twice). Evaluation samples the validation split's rows in a shuffled
#   order, so its several sources are all measured.
# The files are copied first: `hydra-lm prepare` refuses a directory holding .pt files.
set -euo pipefail
out=${1:?usage: python_source_corpus.sh OUT_DIR [MB] [py|code]}
mb=${2:-100}
kind=${3:-py}
[ "$kind" = py ] || [ "$kind" = code ] || { echo "the third argument is py or code, not $kind" >&2; exit 2; }
[ -f "$out/meta.json" ] && { echo "$out is prepared already"; exit 0; }
src=$(mktemp -d)
python3 - "$src" "$mb" "$kind" <<'PY'
import glob, shutil, sys, sysconfig
from pathlib import Path
dst, budget, kind = Path(sys.argv[1]), float(sys.argv[2]) * 1e6, sys.argv[3]
site = Path(sysconfig.get_paths()["purelib"])
passes = [([site], {".py"})]
if kind == "code":
    roots = [site, Path(sysconfig.get_paths()["stdlib"]), Path("/usr/include"),
             *map(Path, sorted(glob.glob("/usr/local/cuda*/include")))]
    passes += [(roots, {".c", ".h", ".cc", ".cpp", ".cu", ".cuh", ".hpp", ".pyi", ".rst", ".md"}),
               (roots[1:], {".py"})]
total, seen, i = 0, set(), 0
for roots, suffixes in passes:
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if total >= budget:
                break
            if path.suffix not in suffixes or not path.is_file():
                continue
            key = path.resolve()
            size = path.stat().st_size
            if key in seen or not 0 < size < 512_000:
                continue
            seen.add(key)
            shutil.copyfile(path, dst / f"{i:07d}_{path.name}")
            total, i = total + size, i + 1
print(f"copied {total / 1e6:.1f} MB of source ({i} files, {kind}) from {site} and beyond" if kind == "code"
      else f"copied {total / 1e6:.1f} MB of Python source from {site}")
PY
python3 -m hydra_lm prepare --inputs "$src" --out "$out" --no_progress
rm -rf "$src"
