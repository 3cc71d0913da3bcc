"""The Streamlit dashboard: `app.py` routes, `app_pages/` draw, `data.py` reads (cached)."""
