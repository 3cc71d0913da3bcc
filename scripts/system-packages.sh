#!/bin/sh
# Install the Debian packages kvwatch's lab runs (nginx, Prometheus, Alertmanager) and its tests use
# (Chromium, PostgreSQL, openssl, rsyslog, kubectl, VictoriaMetrics) when they are missing. Idempotent: does nothing when every binary is already there.
set -eu

binary_for() {
    case "$1" in
        nginx) echo /usr/sbin/nginx ;;
        prometheus) echo /usr/bin/prometheus ;;
        prometheus-alertmanager) echo /usr/bin/prometheus-alertmanager ;;
        postgresql) echo /usr/bin/pg_ctlcluster ;;  # postgresql-common, which the server packages need
        rsyslog) echo /usr/sbin/rsyslogd ;;
        kubernetes-client) echo /usr/bin/kubectl ;;  # any kubectl will do: its kustomize renders deploy/k8s
        victoria-metrics) echo /usr/bin/vmalert ;;  # the package ships victoria-metrics, vmagent, vmalert
        *) echo "/usr/bin/$1" ;;
    esac
}

missing=""
for pkg in "$@"; do
    bin=$(binary_for "$pkg")
    [ -n "$bin" ] && [ -x "$bin" ] || missing="$missing $pkg"
done
# A fresh Debian python3 cannot create a virtualenv without python3-venv.
python3 -c 'import ensurepip' 2>/dev/null || missing="$missing python3-venv"
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "kvwatch needs these Debian packages, which are missing:$missing" >&2
    echo "Install them with: sudo apt-get install --no-install-recommends$missing" >&2
    exit 1
fi
echo "Installing Debian packages:$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null

# Debian's victoria-metrics enables a service that serves on :8428 of every interface from install and
# each boot; the lab runs its own on 127.0.0.1, so a service installed here is stopped and disabled.
case " $missing " in
    *" victoria-metrics "*)
        if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
            systemctl disable --now victoria-metrics.service
        elif command -v update-rc.d >/dev/null 2>&1; then
            invoke-rc.d victoria-metrics stop || true  # refused where policy-rc.d never let it start
            update-rc.d victoria-metrics disable
        fi
        ;;
esac
