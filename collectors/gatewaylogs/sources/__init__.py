"""Where a gateway's access-log records come from: one module (or folder) per kind of source."""
