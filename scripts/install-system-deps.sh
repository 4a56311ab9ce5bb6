#!/usr/bin/env bash
# Debian packages the tests and benchmarks drive. Idempotent: installs only what is missing.
set -euo pipefail
need=()
command -v mosquitto_sub >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v mosquitto >/dev/null 2>&1 || need+=(mosquitto)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)  # PySpark (Spark tests)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing Debian packages: ${need[*]} (run as root or install them)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # The mosquitto package starts a system broker on 1883; tests run their own instances.
    (systemctl disable --now mosquitto 2>/dev/null || service mosquitto stop 2>/dev/null || pkill -x mosquitto) >/dev/null 2>&1 || true
fi
