"""The lab: a simulated multi-replica inference cluster that kvwatch runs against and is tested on."""
