#!/bin/sh
# Kubo container init script (docker/compose.kubo.yaml mounts it into /container-init.d).
# Runs once after `ipfs init`: a private cluster, reachable by the p2ptrain peers only.
set -eu
ipfs bootstrap rm --all
ipfs config --json Discovery.MDNS.Enabled false
ipfs config Routing.Type none
# The RPC API on the compose network (not published to the host): peers reach it as http://kubo:5001.
ipfs config Addresses.API /ip4/0.0.0.0/tcp/5001
ipfs config Addresses.Gateway /ip4/127.0.0.1/tcp/8080
