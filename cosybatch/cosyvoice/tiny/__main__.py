"""``python -m cosybatch.cosyvoice.tiny --family v1|v2|v3 [--variant ...] [--size ...] [--seed N] [--short] DIR``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import FAMILIES, write_model_dir
from . import __doc__ as package_doc
from .v1 import SIZES as V1_SIZES
from .v1 import VARIANTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cosybatch.cosyvoice.tiny", description=package_doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="DIR")
    parser.add_argument("--family", choices=FAMILIES, default="v2", help="v1: CosyVoice-300M, v2: CosyVoice2-0.5B "
                        "(the default), v3: Fun-CosyVoice3-0.5B")
    parser.add_argument("--variant", choices=VARIANTS, default=None,
                        help="v1 only: base (the default), sft or instruct (sft and instruct add spk2info.pt)")
    parser.add_argument("--size", choices=sorted(V1_SIZES), default=None,
                        help="v1 and v2: tiny (the default) or the real model's sizes; v3 is tiny only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true",
                        help="v1 and v2: make the LM's stop id likely, so rows end a few tokens after their "
                        "minimum length instead of at the length cap (v3's random weights already do)")
    args = parser.parse_args(argv)
    options = {"seed": args.seed}
    if args.short:
        if args.family == "v3":
            parser.error("--short is for v1 and v2: v3's random decoder already ends rows early")
        options["short"] = True
    if args.variant is not None:
        if args.family != "v1":
            parser.error(f"--variant is for --family v1; {args.family} has one variant")
        options["variant"] = args.variant
    if args.size is not None:
        if args.family == "v3":
            parser.error("--size: the v3 writer writes tiny sizes only")
        options["size"] = args.size
    print(write_model_dir(args.out, family=args.family, **options))


if __name__ == "__main__":
    sys.exit(main())
