"""alerts/alertmanager.yml as users copy it: its webhook is where the example config's kvwatch listens."""

from __future__ import annotations

from urllib.parse import urlsplit

import yaml

from paths import REPO


def test_the_webhook_posts_to_where_the_example_config_listens_with_a_token_file():
    template = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
    (webhook,) = [w for r in template["receivers"] for w in r.get("webhook_configs", [])]
    example = yaml.safe_load((REPO / "examples" / "kvwatch.example.yaml").read_text())
    url = urlsplit(webhook["url"])
    assert url.port == int(example["exporter"]["listen"].rpartition(":")[2]) and url.path == "/alerts"
    authorization = webhook["http_config"]["authorization"]
    assert authorization["type"] == "Bearer" and "credentials" not in authorization
    assert authorization["credentials_file"]
