"""Peers behind emulated NATs, on the emulated WAN of :mod:`p2ptrain.testing._wan`: what a user's
home or lab machine looks like to the rest of the network (it can dial out; nobody can dial in).

    with emulated_nat(public=2, lans=[2, 1], rate="100mbit") as net:
        net.public[0].ip          # a WAN address, reachable from everyone
        net.private[0].ip         # 192.168.1.2: inside LAN 0 only
        net.routers[0].ip         # LAN 0's public face: what others see when a private peer dials
        net[i]                    # every peer (public first, then private), for wan_node_processes

How (the recipe of ../shared/FIELD-NOTES.md): the WAN gets one peer per public peer and one per LAN
(the LAN's *router*). Each router namespace holds a bridge :data:`LAN_BRIDGE` with address
``192.168.<lan+1>.1/24``; each private peer has its own namespace, a veth to that bridge, an
address ``192.168.<lan+1>.<2+i>`` and a default route via the router. Inside the router,
``net.ipv4.ip_forward=1`` and ``iptables -t nat -A POSTROUTING -o wan0 -j MASQUERADE``: private
peers' connections leave with the router's address; nothing routes *into* a LAN, so an inbound
dial to a private peer fails. Peers of one LAN reach each other directly over the LAN bridge.

What a router does with an unsolicited inbound TCP packet (one that matches no connection its
private peers opened) decides whether hole punching can work through it:

- by default (Linux MASQUERADE alone) the packet is for the router itself, whose TCP stack answers
  a SYN with a reset; the reset reaches the peer that sent it (it matches that peer's own
  connection attempt in the sender's NAT) and aborts its connect. A TCP simultaneous open then
  succeeds only if both SYNs cross within the one-way delay: microseconds here, so practically never;
- with ``firewall=True`` the router also drops such packets (``iptables -A INPUT -i wan0 -p tcp -m
  conntrack --ctstate NEW -j DROP``), as home routers' firewalls do: the first SYN is dropped, the
  other side's SYN opens its own NAT's mapping, and the simultaneous open goes through
  (measured: MASQUERADE keeps source ports, and conntrack lets the crossing SYNs pass).

Rates: each private peer's veth gets tbf at its rate on both ends, as a WAN peer's link does; a
router's WAN link is limited to the sum of its LAN's rates (the LAN's members do not share a
narrower uplink: a measurement of relayed against direct paths compares equal per-peer links).

Cleanup is the WAN harness's: every namespace is named ``<prefix>p<N>`` (private peers numbered
after the WAN's peers), so leaving the block, or the next harness after a SIGKILL, removes them,
and with them every veth and the LAN bridges inside. Needs root and iptables:
:func:`nat_unavailable` says why not.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from p2ptrain.testing._wan import (
    IFACE,
    STOP_GRACE_S,
    EmulatedWan,
    WanError,
    WanPeer,
    _run,
    _tbf,
    emulated_wan,
    parse_rate,
    wan_unavailable,
)

# The bridge inside a router namespace that joins its LAN's peers (and the router's LAN address).
LAN_BRIDGE = "lan0"
# LAN k's addresses: LAN_SUBNET.format(k + 1) + ".1" is the router, ".2", ".3", ... its peers.
# Private addresses that exist only inside these namespaces, never routed to the root namespace.
LAN_SUBNET = "192.168.{}"
# A LAN's peers: a /24 and readable names; a test needs a handful.
MAX_LAN_PEERS = 200


def nat_unavailable() -> str | None:
    """Why emulated NATs cannot be set up here (one line, for a test's skip), or None if they can."""
    reason = wan_unavailable()
    if reason:
        return reason.replace("the emulated WAN", "the emulated NAT")
    if shutil.which("iptables") is None:
        return "the emulated NAT needs `iptables` on PATH (the routers MASQUERADE)"
    return None


@dataclass
class Lan:
    """One NAT: its router (a peer of the WAN) and the private peers behind it."""

    router: WanPeer
    peers: list[WanPeer]


class EmulatedNat(Sequence[WanPeer]):
    """Public peers then private peers, in order (``net[i]``); routers are not peers of the run."""

    def __init__(self, wan: EmulatedWan, public: list[WanPeer], lans: list[Lan]) -> None:
        self.wan = wan
        self.prefix = wan.prefix
        self.public = public
        self.lans = lans  # filled while the harness builds them

    @property
    def routers(self) -> list[WanPeer]:
        return [lan.router for lan in self.lans]

    @property
    def private(self) -> list[WanPeer]:
        return [p for lan in self.lans for p in lan.peers]

    def __len__(self) -> int:
        return len(self.public) + len(self.private)

    def __getitem__(self, index: int) -> WanPeer:  # type: ignore[override]  # (no slices)
        return [*self.public, *self.private][index]

    def __iter__(self) -> Iterator[WanPeer]:
        return iter([*self.public, *self.private])

    def lan_of(self, peer: WanPeer) -> int | None:
        """The index of the LAN ``peer`` sits in, or None for a public peer."""
        for k, lan in enumerate(self.lans):
            if peer in lan.peers:
                return k
        return None

    def close(self) -> None:
        """Stop the private peers' processes; the WAN's close removes every namespace (idempotent)."""
        for peer in self.private:
            for proc in peer._procs:
                if proc.poll() is None:
                    proc.terminate()


# A home router's firewall: unsolicited inbound TCP to the router is dropped, not answered (module doc).
FIREWALL_RULE = ("-A", "INPUT", "-i", IFACE, "-p", "tcp", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")


def _add_lan(wan: EmulatedWan, k: int, router: WanPeer, sizes: int, rate: int, first_index: int, firewall: bool) -> Lan:
    net = LAN_SUBNET.format(k + 1)
    ns = router.namespace
    _run("ip", "-n", ns, "link", "add", LAN_BRIDGE, "type", "bridge")
    _run("ip", "-n", ns, "addr", "add", f"{net}.1/24", "dev", LAN_BRIDGE)
    _run("ip", "-n", ns, "link", "set", LAN_BRIDGE, "up")
    _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    _run("ip", "netns", "exec", ns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", IFACE, "-j", "MASQUERADE")
    if firewall:
        _run("ip", "netns", "exec", ns, "iptables", *FIREWALL_RULE)
    peers = []
    for i in range(sizes):
        index = first_index + i
        peer_ns, router_end, peer_end = f"{wan.prefix}p{index}", f"l{k}h{i}", f"{wan.prefix}n{index}"
        peer = WanPeer(index, peer_ns, f"{net}.{i + 2}", rate, rate, router_end)
        _run("ip", "netns", "add", peer_ns)
        peers.append(peer)
        # Made in the root namespace (names unique to this harness), then one end moved to each side.
        _run("ip", "link", "add", peer_end, "type", "veth", "peer", "name", f"{wan.prefix}h{index}")
        _run("ip", "link", "set", f"{wan.prefix}h{index}", "netns", ns)
        _run("ip", "-n", ns, "link", "set", f"{wan.prefix}h{index}", "name", router_end)
        _run("ip", "-n", ns, "link", "set", router_end, "master", LAN_BRIDGE)
        _run("ip", "-n", ns, "link", "set", router_end, "up")
        _run("ip", "link", "set", peer_end, "netns", peer_ns)
        _run("ip", "-n", peer_ns, "link", "set", peer_end, "name", IFACE)
        _run("ip", "-n", peer_ns, "addr", "add", f"{peer.ip}/24", "dev", IFACE)
        _run("ip", "-n", peer_ns, "link", "set", IFACE, "up")
        _run("ip", "-n", peer_ns, "link", "set", "lo", "up")
        _run("ip", "-n", peer_ns, "route", "add", "default", "via", f"{net}.1")
        _run("tc", "-n", peer_ns, "qdisc", "add", "dev", IFACE, *_tbf(rate))
        _run("tc", "-n", ns, "qdisc", "add", "dev", router_end, *_tbf(rate))
    return Lan(router, peers)


@contextmanager
def emulated_nat(public: int = 2, lans: Sequence[int] = (2, 1), rate: str | int = "100mbit", *,
                 firewall: bool = False) -> Iterator[EmulatedNat]:
    """``public`` peers on the WAN and, per entry of ``lans``, a NAT with that many private peers
    behind it; every peer's link limited to ``rate`` both ways. ``firewall``: the routers drop
    unsolicited inbound TCP instead of answering it with a reset (the module says why it matters). Everything is removed when the
    block ends, however it ends; raises :class:`~p2ptrain.testing.WanError` where it cannot
    be set up (:func:`nat_unavailable` says why)."""
    reason = nat_unavailable()
    if reason:
        raise WanError(reason)
    if public < 0 or not lans or any(not 1 <= n <= MAX_LAN_PEERS for n in lans):
        raise ValueError(f"an emulated NAT needs at least one LAN of 1 to {MAX_LAN_PEERS} peers, not {list(lans)}")
    bits = parse_rate(rate)
    router_rates = [bits] * public + [bits * n for n in lans]
    with emulated_wan(public + len(lans), bits, rates=router_rates) as wan:
        net = EmulatedNat(wan, list(wan)[:public], [])
        try:
            index = len(wan)
            for k, n in enumerate(lans):
                net.lans.append(_add_lan(wan, k, wan[public + k], n, bits, index, firewall))
                index += n
            yield net
        finally:
            net.close()
            for peer in net.private:  # their namespaces go with the WAN's; their processes are ours to wait for
                for proc in peer._procs:
                    try:
                        proc.wait(STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
