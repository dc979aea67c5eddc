"""`--fwd-configs FILE`: load forward launch settings written by `kernel_breakdown.py --fwd-sweep --best FILE`
into `mhla_triton.FWD_CONFIGS` (to time a sweep's winner before it is written into the module)."""

import json


def load(path):
    from mhla_convert.kernels import mhla_triton as MT

    if path:
        MT.FWD_CONFIGS = {(bd, bdv): tuple(cfg) for bd, bdv, *cfg in json.load(open(path))}
    print("FWD_CONFIGS:", MT.FWD_CONFIGS, flush=True)
