#!/bin/bash
# make image: an OCI image of egress from Debian packages and the project's wheel, with no
# pull from any image registry. mmdebstrap makes a Debian 12 root filesystem (packages
# from the machine's apt sources); the wheels (egress and its PyPI dependencies, built
# here) go into a venv at /opt/egress in it; podman import makes the image.
#
#   containers/image/build.sh [TAG]     default: localhost/egress:VERSION
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
VERSION=$("$PY" -c 'import egress; print(egress.__version__)')
TAG=${1:-localhost/egress:$VERSION}
RUNC=$(command -v runc || true)
WORK=$(mktemp -d /var/tmp/egress-image.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

"$PY" -m pip wheel -q --disable-pip-version-check --wheel-dir "$WORK/wheels" .
# The hot modules mypyc compiled here (make setup) go in beside the installed sources.
# egress uses a build only while its stamp matches the sources and the interpreter
# (egress/native.py): built on Debian 12 like the image, they are used; else the sources.
mkdir -p "$WORK/native"
for pkg in tunnel datapath resolver observer; do
	if [ -f "egress/$pkg/_native/SOURCES" ]; then
		mkdir -p "$WORK/native/$pkg" && cp -a "egress/$pkg/_native" "$WORK/native/$pkg/"
	fi
done
# What egressd needs of the system (the same list as the Makefile's, without test tools).
PACKAGES=python3,python3-venv,python3-nftables,nftables,iproute2,iptables,procps,util-linux,ca-certificates
mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
	--customize-hook='mkdir -p "$1/tmp/wheels"' \
	--customize-hook="sync-in $WORK/wheels /tmp/wheels" \
	--customize-hook='chroot "$1" python3 -m venv --system-site-packages /opt/egress' \
	--customize-hook='chroot "$1" env PIP_CONFIG_FILE=/dev/null /opt/egress/bin/pip install -q --no-index --no-compile --find-links /tmp/wheels egress' \
	--customize-hook='chroot "$1" /opt/egress/bin/pip uninstall -q -y pip setuptools' \
	--customize-hook="site=\$(chroot \"\$1\" /opt/egress/bin/python -c 'import egress, os; print(os.path.dirname(egress.__file__))') && for pkg in \$(ls $WORK/native); do cp -a $WORK/native/\$pkg/_native \"\$1\$site/\$pkg/\"; done" \
	--customize-hook='for b in egressd egressctl egress-cni egress-cni-install egress-oci-hook; do ln -s /opt/egress/bin/$b "$1/usr/local/bin/$b"; done' \
	--customize-hook='rm -rf "$1"/tmp/wheels "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
	bookworm "$WORK/rootfs.tar"
podman import --quiet \
	--change 'CMD ["egressd"]' \
	--change "LABEL org.opencontainers.image.version=$VERSION" \
	--change 'LABEL org.opencontainers.image.title=egress' \
	"$WORK/rootfs.tar" "$TAG" >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "built $TAG: $((size / 1000000)) MB"
# It runs (no network: the host's forwarding and NAT stay as they are; runc where
# present, as crun refuses hybrid cgroup hosts).
podman run --rm --network none ${RUNC:+--runtime "$RUNC"} --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
	"$TAG" egressctl --version
podman run --rm --network none ${RUNC:+--runtime "$RUNC"} --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
	"$TAG" /opt/egress/bin/python -c 'from egress.datapath.native import NATIVE as d
from egress.resolver.native import NATIVE as r
from egress.tunnel.native import NATIVE as t
from egress.observer.native import NATIVE as o
print(f"tunnel scorer: {t.in_use()}; NFLOG walk: {d.in_use()}; resolver: {r.in_use()}; observer sift: {o.in_use()}")'
