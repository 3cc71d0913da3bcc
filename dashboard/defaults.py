"""The dashboard's defaults, which `kvwatch dashboard` offers and the app falls back on; a module of its own
so that the command line names them without importing Streamlit."""

from kvwatch.config.settings import LAB_DIRECTORY

DEFAULT_CONFIG = LAB_DIRECTORY / "kvwatch.yaml"  # the config `kvwatch lab up` writes
DEFAULT_REFRESH_SECONDS = 15
