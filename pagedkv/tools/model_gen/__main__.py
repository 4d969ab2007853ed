"""`python -m pagedkv.tools.model_gen DIR`: generate the default model into DIR (how services ensure it)."""

import sys
from pathlib import Path

from pagedkv.tools.model_gen.writer import generate_default_model

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pagedkv.tools.model_gen DIR")
    generate_default_model(Path(sys.argv[1]))
