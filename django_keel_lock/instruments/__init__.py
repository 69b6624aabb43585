"""The metrics backends `metrics.load` builds (each imports its package only when chosen),
and `base`: what every backend receives from the core."""
