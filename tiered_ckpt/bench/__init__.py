"""The benchmark behind `tiered-ckpt bench`: tiered_ckpt and its baselines measured in one run."""

# printed under every table with a "met" column: what its NO means
MET_LEGEND = ("met: yes = within the target in this run; NO = missed in this run. A NO is a figure to look at, not a "
              "failure: the bench still exits 0, and docs/benchmarks.md (*Where a target is missed, and why*) says "
              "which targets a small, shared machine misses and why.")
