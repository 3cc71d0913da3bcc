"""Measured claims about kvwatch's speed and memory; `make bench` runs them all and prints a report."""
