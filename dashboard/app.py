"""The dashboard's entry point: `streamlit run dashboard/app.py -- --config FILE` (`kvwatch dashboard`)."""

import streamlit as st

from kvwatch.dashboard import ui

st.set_page_config(page_title="kvwatch", page_icon=":material/memory:", layout="wide")
ui.cluster_picker()  # in the sidebar of every page
st.navigation(
    [
        st.Page("app_pages/overview.py", title="Overview", icon=":material/dashboard:", default=True),
        st.Page("app_pages/per_round.py", title="Per-round TTFT", icon=":material/stacked_line_chart:"),
        st.Page("app_pages/replicas.py", title="Cache & replicas", icon=":material/dns:"),
        st.Page("app_pages/sessions.py", title="Sessions", icon=":material/forum:"),
        st.Page("app_pages/alerts.py", title="Alerts", icon=":material/notifications:"),
        st.Page("app_pages/experiment.py", title="A/B experiment", icon=":material/science:"),
        st.Page("app_pages/doctor.py", title="Doctor", icon=":material/stethoscope:"),
    ]
).run()
