"""The mesh: verified message routing, heartbeat membership, peer discovery."""
