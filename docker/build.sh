#!/bin/sh
# Build the p2ptrain image with podman on a machine that cannot pull registry images.
#
#   docker/build.sh                      # base + image; P2PTRAIN_TORCH_FIND_LINKS=/opt/wheels for a local wheel
#
# 1. Two bases, Debian bookworm root filesystems made with debootstrap, imported, made once and kept:
#    localhost/p2ptrain-base:bookworm (Python 3.11, venv, gcc, GMP and Python headers: the build
#    stage) and localhost/p2ptrain-runtime:bookworm (Python 3.11, venv, CA certificates: the image).
# 2. The image (docker/Dockerfile on those bases): the package and torch's CPU wheel in /opt/venv.
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
CACHE="${P2PTRAIN_BUILD_CACHE:-/var/tmp/p2ptrain-build}"
TORCH_FIND_LINKS="${P2PTRAIN_TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"
HOST_CA="${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
export CONTAINERS_CONF="$REPO/docker/containers.conf"

mirror() {  # the Debian mirror apt already uses (deb822 "URIs:" or a one-line "deb" entry)
    sed -n -e 's/^URIs: *\([^ ]*\/debian\)\/*$/\1/p' -e 's/^deb  *\(http[^ ]*\/debian\)\/* bookworm.*/\1/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n 1
}

# base NAME PACKAGES: debootstrap bookworm with PACKAGES into $CACHE/NAME, import it as localhost/NAME:bookworm
base() {
    if podman image exists "localhost/$1:bookworm"; then return; fi
    if [ ! -e "$CACHE/$1/.complete" ]; then
        MIRROR="${DEBIAN_MIRROR:-$(mirror)}"
        MIRROR="${MIRROR:-http://deb.debian.org/debian}"
        echo "build: debootstrap bookworm from $MIRROR into $CACHE/$1 (about a minute)"
        rm -rf "${CACHE:?}/$1"
        debootstrap --variant=minbase --include="$2" bookworm "$CACHE/$1" "$MIRROR"
        touch "$CACHE/$1/.complete"
    fi
    echo "build: importing $CACHE/$1 as localhost/$1:bookworm"
    tar -C "$CACHE/$1" --exclude=./.complete --exclude='./var/cache/apt/*' --exclude='./var/lib/apt/lists/*' -c . \
        | podman import --change 'CMD ["/bin/bash"]' - "localhost/$1:bookworm"
}

mkdir -p "$CACHE/pip"
base p2ptrain-base python3,python3-venv,python3-dev,gcc,libgmp-dev,ca-certificates
base p2ptrain-runtime python3,python3-venv,ca-certificates

set -- --network host --build-arg BASE=localhost/p2ptrain-base:bookworm \
    --build-arg RUNTIME_BASE=localhost/p2ptrain-runtime:bookworm --build-arg BUILD_PACKAGES= \
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
