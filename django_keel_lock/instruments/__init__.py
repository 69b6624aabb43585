"""The metrics backends `metrics.load` builds: each imports its package only when chosen."""
