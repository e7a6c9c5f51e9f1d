"""`tiered-ckpt ls | show STEP|best|latest | verify [STEP] | export [STEP] --to FORMAT -o PATH |
delete STEP [--dry-run] [--yes] | gc [--dry-run] | free [--all-jobs] [--force] [--dry-run] [--yes] |
advise [--interruptions-per-day N] [--node-losses-per-day N] | config check FILE | bench`; `--json` on ls, show,
verify, gc, free and advise.

Exit status: 0 ok; 1 the command ran and found or left a problem (damage, something gc could not remove);
2 nothing was done: bad arguments or config, an unknown step, no checkpoints, a refusal. The commands that
list, describe or clean up open the job's tiers and index without the save and load paths, so they start
without importing torch (docs/operations.md, *CLI*).

The package: `main.py` parses the command line and runs a command; `commands.py` holds the commands
(`free.py` the one that gives host memory back, `memory.py` what `ls` says of it, `advise.py` the one that
recommends an interval);
`job_store.JobStore` opens a job for them; `text.py` formats what they print (text and JSON)."""
from .main import main
from .text import KEY_WIDTH

__all__ = ["main", "KEY_WIDTH"]
