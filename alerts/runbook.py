"""Where the alerts, the boards and the dashboard link the runbook (alerts/runbook.md)."""

RUNBOOK = "alerts/runbook.md"  # in the repository
# A page that opens from Slack, PagerDuty, Alertmanager and Grafana, which a repository path does not.
# `make generate RUNBOOK_URL=...` and the config's dashboard.runbook_url move it (to a wiki, an internal
# mirror).
RUNBOOK_URL = f"https://github.com/kvwatch/kvwatch/blob/main/{RUNBOOK}"
