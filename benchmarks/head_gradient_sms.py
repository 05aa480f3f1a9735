"""``hydra-lm bench`` with the head gradient's side stream (model/head_gradient_overlap.py) set otherwise: SMs left to
the trunk (``--trunk_sms``), or switched off (``--off``: every GEMM in the loss's forward, as before the overlap).
For an A/B in one inductor cache (the setting changes eager code only, so after the first run every run is warm):

    for s in off 24 32 40 48; do python benchmarks/head_gradient_sms.py $s -- --model_size 100M --arch both; done

The arguments after ``--`` go to ``hydra-lm bench`` as they are.
"""

from __future__ import annotations

import argparse
import sys

from hydra_lm.cli import main
from hydra_lm.model import head_gradient_overlap

if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("setting", help="'off', or the SMs left to the trunk's kernels")
    setting = p.parse_args(argv[:split]).setting
    if setting == "off":
        head_gradient_overlap.OVERLAP_BYTES = 0
    elif setting.isdigit():
        head_gradient_overlap.TRUNK_SMS = int(setting)
    else:
        raise SystemExit(f"{setting!r}: give 'off' or a number of SMs")
    print(f"head gradient overlap: {setting if setting == 'off' else f'{setting} SMs left to the trunk'}", flush=True)
    main(["bench", *argv[split + 1:]])
