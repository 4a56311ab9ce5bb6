#!/usr/bin/env bash
# Debian packages the broker uses (`runtime`, for make run) and the tests and benchmarks drive
# (the default, for make test). Idempotent: installs only what is missing.
set -euo pipefail
need=()
# The commit log's batch checksum: libdeflate's CRC-32 is 6x zlib's (broker/commitlog/crc.py;
# without it the log falls back to zlib, correct but slower).
ldconfig -p 2>/dev/null | grep -q 'libdeflate\.so\.0' || need+=(libdeflate0)
# The compiled device path (broker/net/_devicelane.pyx, built by pip install -e .): a C
# compiler and the headers of the Python that builds it (Debian's python3 needs its -dev).
command -v cc >/dev/null 2>&1 || need+=(gcc)
# The compiled batch CRC (broker/commitlog/_crc.pyx) falls back to zlib's crc32, and the compiled
# small batch (broker/commitlog/_smallbatch.pyx) checksums with it: its header.
[ -e /usr/include/zlib.h ] || need+=(zlib1g-dev)
py=${PYTHON:-python3}
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
if [ -z "$inc" ] || [ ! -e "$inc/Python.h" ]; then
    ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo 3)
    need+=("python$ver-dev")
fi
if [ "${1:-test}" != runtime ]; then
    command -v mosquitto_sub >/dev/null 2>&1 || need+=(mosquitto-clients)
    command -v mosquitto >/dev/null 2>&1 || need+=(mosquitto)
    command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)  # PySpark (Spark tests)
    # The console's browser test (tests/integration/test_console_browser.py): headless
    # Chromium driven through chromedriver, and a font for its screenshot.
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
    [ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
    # The network lab (tests/netlab.py: namespaces, bridge, nftables faults) and the
    # replicated peer the chaos runs and bench/cluster_bench.py measure (NATS 2.9, MQTT on
    # JetStream R3)
    command -v ip >/dev/null 2>&1 || need+=(iproute2)
    command -v nft >/dev/null 2>&1 || need+=(nftables)
    command -v nats-server >/dev/null 2>&1 || need+=(nats-server)
    # The XDP filter's tests (tests/integration/test_xdp.py): bcc compiles bpf/mqlog_xdp.c
    # against kernel headers; bpftool lists what is attached.
    [ -d /usr/lib/python3/dist-packages/bcc ] || need+=(python3-bpfcc)
    command -v bpftool >/dev/null 2>&1 || need+=(bpftool)
    arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
    dpkg -s "linux-headers-$arch" >/dev/null 2>&1 || need+=("linux-headers-$arch")
fi
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

# bcc looks for the running kernel's headers in /lib/modules/$(uname -r)/build. A kernel that
# ships none (a VM's or a container's) gets Debian's: close enough for XDP's few structures
# (ethhdr, iphdr, udphdr, tcphdr and the BPF uapi have been stable for years).
modules="/lib/modules/$(uname -r)"
if [ "${1:-test}" != runtime ] && [ ! -e "$modules/build" ] && [ "$(id -u)" -eq 0 ]; then
    build=$(ls -d /usr/src/linux-headers-*-"${arch:-amd64}" 2>/dev/null | sort -V | tail -n 1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$build" ] && [ -n "$common" ]; then
        mkdir -p "$modules"
        ln -sfn "$build" "$modules/build"
        ln -sfn "$common" "$modules/source"
    fi
fi
