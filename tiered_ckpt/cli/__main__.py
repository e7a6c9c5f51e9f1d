"""`python -m tiered_ckpt.cli ...`, as the `tiered-ckpt` command."""
import sys

from .main import main

sys.exit(main())
