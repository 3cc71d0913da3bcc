"""`kvwatch init`: look at a cluster (its gateway, its Prometheus), then write a kvwatch config and the
pieces the user adds elsewhere, matched to it: `survey` looks, `writers` writes, `summary` says what was
found, what was assumed and what to check."""
