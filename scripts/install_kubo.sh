#!/usr/bin/env bash
# Install Kubo (the `ipfs` daemon) at the version gridgraph is tested against.
#
# Idempotent: if `ipfs` on PATH or in $(go env GOPATH)/bin already reports the wanted version,
# nothing is built. Otherwise Kubo is built from its Go module source, because
# `go install github.com/ipfs/kubo/cmd/ipfs@vX` refuses modules whose go.mod has replace
# directives (Kubo's does). Build chatter goes to stderr; the last line on stdout is the path
# of the binary.
set -euo pipefail

VERSION="${KUBO_VERSION:-0.43.1}"

if ! command -v go >/dev/null 2>&1; then
    echo "install_kubo.sh: Go is needed to build Kubo; install Go >= 1.26 first" >&2
    exit 1
fi
GOBIN_DIR="$(go env GOPATH)/bin"
DEST="$GOBIN_DIR/ipfs"

for candidate in "$(command -v ipfs || true)" "$DEST"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] &&
        [ "$("$candidate" version 2>/dev/null)" = "ipfs version $VERSION" ]; then
        echo "$candidate"
        exit 0
    fi
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "building Kubo v$VERSION (takes a few minutes)" >&2
SRC="$(go mod download -json "github.com/ipfs/kubo@v$VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
if [ -z "$SRC" ]; then
    echo "install_kubo.sh: go mod download github.com/ipfs/kubo@v$VERSION gave no source dir" >&2
    exit 1
fi
cp -r "$SRC" "$WORK/kubo"
chmod -R u+w "$WORK/kubo"
cd "$WORK/kubo"

# Kubo 0.43.1 replaces go-libp2p with a personal fork (to pull in quic-go v0.62.0 and
# webtransport-go v0.13.0) that the Go module proxy does not serve. go-libp2p v0.50.0 is the
# first release that requires exactly those versions, so when the fork cannot be fetched we
# drop the replace and require that release instead: the TODO above the replace says as much.
FORK="$(awk '$1 == "replace" && $2 == "github.com/libp2p/go-libp2p" { print $4 "@" $5 }' go.mod)"
if [ -n "$FORK" ] && ! go mod download "$FORK" >/dev/null 2>&1; then
    echo "cannot fetch $FORK; building against github.com/libp2p/go-libp2p@v0.50.0" >&2
    go mod edit -dropreplace=github.com/libp2p/go-libp2p \
        -require=github.com/libp2p/go-libp2p@v0.50.0
fi

mkdir -p "$GOBIN_DIR"
go build -mod=mod -o "$WORK/ipfs" ./cmd/ipfs >&2
mv "$WORK/ipfs" "$DEST"
"$DEST" version >&2
echo "$DEST"
