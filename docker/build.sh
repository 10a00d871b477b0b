#!/bin/sh
# Build the p2ptrain image with podman on a machine that cannot pull registry images.
#
#   docker/build.sh                      # base + image; P2PTRAIN_TORCH_FIND_LINKS=/opt/wheels for a local wheel
#
# 1. The base: a Debian bookworm root filesystem (Python 3.11, venv, gcc, GMP, CA certificates)
#    made with debootstrap and imported as localhost/p2ptrain-base:bookworm. Made once, kept.
# 2. The image (docker/Dockerfile from that base): the package and torch's CPU wheel in /opt/venv.
#
# Environment (all optional):
#   P2PTRAIN_IMAGE            image name (default localhost/p2ptrain:latest, what docker/compose.yaml runs)
#   P2PTRAIN_BUILD_CACHE      the root filesystem and pip's cache (default /var/tmp/p2ptrain-build)
#   P2PTRAIN_TORCH_FIND_LINKS a folder holding torch's wheel (mounted into the build) or a URL
#                             (default https://download.pytorch.org/whl/cpu/torch/)
#   DEBIAN_MIRROR             debootstrap's mirror (default: the first deb.debian.org-style URI of apt's sources)
#   HOST_CA                   CA bundle pip inside the build trusts (default /etc/ssl/certs/ca-certificates.crt)
# Needs root (debootstrap) and the packages podman, buildah, runc, debootstrap.
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
IMAGE="${P2PTRAIN_IMAGE:-localhost/p2ptrain:latest}"
BASE=localhost/p2ptrain-base:bookworm
CACHE="${P2PTRAIN_BUILD_CACHE:-/var/tmp/p2ptrain-build}"
TORCH_FIND_LINKS="${P2PTRAIN_TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"
HOST_CA="${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
export CONTAINERS_CONF="$REPO/docker/containers.conf"

mirror() {  # the Debian mirror apt already uses (deb822 "URIs:" or a one-line "deb" entry)
    sed -n -e 's/^URIs: *\([^ ]*\/debian\)\/*$/\1/p' -e 's/^deb  *\(http[^ ]*\/debian\)\/* bookworm.*/\1/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n 1
}

mkdir -p "$CACHE/pip"
if ! podman image exists "$BASE"; then
    if [ ! -e "$CACHE/rootfs/.complete" ]; then
        MIRROR="${DEBIAN_MIRROR:-$(mirror)}"
        MIRROR="${MIRROR:-http://deb.debian.org/debian}"
        echo "build: debootstrap bookworm from $MIRROR into $CACHE/rootfs (about a minute)"
        rm -rf "$CACHE/rootfs"
        debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-dev,gcc,libgmp-dev,ca-certificates \
            bookworm "$CACHE/rootfs" "$MIRROR"
        touch "$CACHE/rootfs/.complete"
    fi
    echo "build: importing the root filesystem as $BASE"
    tar -C "$CACHE/rootfs" --exclude=./.complete --exclude='./var/cache/apt/archives/*.deb' -c . \
        | podman import --change 'CMD ["/bin/bash"]' - "$BASE"
fi

set -- --network host --build-arg BASE="$BASE" --build-arg BUILD_PACKAGES= \
    -v "$CACHE/pip:/root/.cache/pip"
if [ -d "$TORCH_FIND_LINKS" ]; then
    set -- "$@" -v "$(cd "$TORCH_FIND_LINKS" && pwd):/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels
else
    set -- "$@" --build-arg TORCH_FIND_LINKS="$TORCH_FIND_LINKS"
fi
if [ -f "$HOST_CA" ]; then
    set -- "$@" -v "$HOST_CA:/etc/ssl/certs/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/host-ca.crt
fi
echo "build: podman build -t $IMAGE (the first build downloads torch's dependencies and libp2p's)"
podman build "$@" -f "$REPO/docker/Dockerfile" -t "$IMAGE" "$REPO"
podman image ls "$IMAGE"
