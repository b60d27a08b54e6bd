"""The cluster: identical nodes of devices, the links inside and between them, and the
``NODESxDEVICESxDEVICE`` spec that names a preset one (``Cluster.from_spec``).

Devices and links are hardware.py's; the presets, presets.py's.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .conditions import ProfileConditions, noisy_profile_warning
from .errors import ConfigError
from .hardware import Device, Fabric, Link, check_count, check_number, from_dict
from .presets import DEVICE_PRESETS, device_preset, host_devices, link_presets

_SPEC_FORM = "NODESxDEVICES_PER_NODExDEVICE e.g. 128x8xA100-80GB"


def _spec_error(spec: Any, reason: str) -> ConfigError:
    return ConfigError(f"cluster spec {spec!r} is malformed: {reason}; expected {_SPEC_FORM}; "
                       f"known devices: {', '.join(DEVICE_PRESETS)}")


def _parse_spec(spec: str) -> tuple[int, int, str]:
    """Split "NODESxPER_NODExDEVICE" (or "PER_NODExDEVICE") into counts and a device name."""
    if not isinstance(spec, str):
        raise _spec_error(spec, "it must be a string")
    text = spec.strip()
    # The device part starts at the first letter that is not the separator 'x'.
    start = next((i for i, c in enumerate(text) if c.isalpha() and c.lower() != "x"), None)
    if start is None:
        raise _spec_error(spec, "no device name")
    if start == 0 or text[start - 1].lower() != "x":
        raise _spec_error(spec, f"missing the device count before {text[start:]!r}")
    tokens = re.split("[xX]", text[:start - 1])
    if len(tokens) > 2:
        raise _spec_error(spec, f"too many counts {tokens}")
    counts = []
    for token in tokens:
        if not re.fullmatch(r"\s*[+-]?\d+\s*", token):
            raise _spec_error(spec, f"count {token!r} is not an integer")
        if int(token) < 1:
            raise _spec_error(spec, f"count {token!r} must be >= 1")
        counts.append(int(token))
    nodes, per_node = counts if len(counts) == 2 else (1, counts[0])
    device = text[start:]
    if device.lower() not in {k.lower() for k in DEVICE_PRESETS}:
        raise _spec_error(spec, f"unknown device {device!r}")
    return nodes, per_node, device


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` identical nodes of ``devices_per_node`` devices each.

    A node is what ``intra_node`` joins: one NVLink (scale-up) domain, a DGX's 8 GPUs or a GB200 NVL72
    rack's 72. ``devices_per_host``: the devices one machine (one operating system, one torchrun) drives,
    which a domain larger than a machine holds several of (a GB200 compute tray: 4); None: the node is
    one machine. ``inter_node`` is per device: a node's total NIC bandwidth is
    ``devices_per_node * inter_node.bandwidth``. ``fabric``: the tiers above the nodes when there is more
    than one (pods of nodes, oversubscribed between them; hardware.Fabric), None: one non-blocking tier.
    ``profile_conditions``: what the measurements of a :meth:`local` cluster were taken under (its device,
    its links; autopar/conditions.py), () for presets.
    """

    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    profile_conditions: tuple[ProfileConditions, ...] = ()
    devices_per_host: int | None = None
    fabric: Fabric | None = None

    def __post_init__(self) -> None:
        check_count("Cluster", "nodes", self.nodes)
        check_count("Cluster", "devices_per_node", self.devices_per_node)
        if self.devices_per_host is not None:
            check_count("Cluster", "devices_per_host", self.devices_per_host)
            if self.devices_per_node % self.devices_per_host:
                raise ConfigError(f"Cluster.devices_per_host={self.devices_per_host} does not divide devices_per_node="
                                  f"{self.devices_per_node}: an NVLink domain holds whole machines; give a divisor, "
                                  "or None when a node is one machine")
        if not isinstance(self.device, Device):
            raise ConfigError(f"Cluster.device={self.device!r} must be a Device")
        for name in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, name), Link):
                raise ConfigError(f"Cluster.{name}={getattr(self, name)!r} must be a Link")
        if self.fabric is not None and not isinstance(self.fabric, Fabric):
            raise ConfigError(f"Cluster.fabric={self.fabric!r} must be a Fabric or None")
        object.__setattr__(self, "profile_conditions", tuple(self.profile_conditions))
        if not all(isinstance(c, ProfileConditions) for c in self.profile_conditions):
            raise ConfigError(f"Cluster.profile_conditions={self.profile_conditions!r} must hold ProfileConditions")

    @property
    def profile_warning(self) -> str | None:
        """A warning line when a measurement behind this cluster was noisy (autopar/conditions.py), else None."""
        return noisy_profile_warning(self.profile_conditions)

    @property
    def host_devices(self) -> int:
        """Devices per machine (processes per torchrun): ``devices_per_host``, else ``devices_per_node``."""
        return self.devices_per_host or self.devices_per_node

    @property
    def hosts(self) -> int:
        """Machines in the cluster."""
        return self.devices // self.host_devices

    @property
    def devices(self) -> int:
        """Total number of devices (``nodes * devices_per_node``)."""
        return self.nodes * self.devices_per_node

    @classmethod
    def from_spec(cls, spec: str, *, intra_node_bandwidth: float | None = None,
                  inter_node_bandwidth: float | None = None, intra_node_latency: float | None = None,
                  inter_node_latency: float | None = None, device_memory: float | None = None,
                  fabric: Fabric | None = None) -> "Cluster":
        """Build a cluster from "NODESxDEVICES_PER_NODExDEVICE" (e.g. "128x8xA100-80GB", "1x2xcpu").

        "8xA100-80GB" means one node. A node is one NVLink domain: "16x72xGB200" is 16 GB200 NVL72 racks
        (each 18 machines of 4 GPUs: ``devices_per_host`` comes from the preset), "2x36xGB200" two NVL36
        domains. The device name is case-insensitive. Links come from the device family's presets. The keyword overrides are per device and per
        direction, in bytes/s and seconds; an overridden bandwidth is taken as the
        achievable number and so gets ``efficiency=1.0`` (an overridden latency keeps
        the preset efficiency). ``device_memory`` (bytes) replaces the preset's memory per device,
        e.g. to keep a reserve for the framework: ``device_memory=70e9`` on an 80 GB part. ``fabric``: the
        network's tiers above the nodes (hardware.Fabric; presets.FABRICS names published ones), None: one
        non-blocking tier.
        """
        nodes, per_node, device_name = _parse_spec(spec)
        device = device_preset(device_name)
        if device_memory is not None:
            check_number("Cluster.from_spec", "device_memory", device_memory)
            device = dataclasses.replace(device, memory=float(device_memory))
        intra, inter = link_presets(device.name)
        intra = _override(intra, "intra_node", intra_node_bandwidth, intra_node_latency)
        inter = _override(inter, "inter_node", inter_node_bandwidth, inter_node_latency)
        host = host_devices(device.name)
        if host is not None and per_node > host:
            if per_node % host:
                raise _spec_error(spec, f"a {device.name} machine holds {host} GPUs, so an NVLink domain of {per_node} "
                                        f"is not whole machines: give a multiple of {host}")
        else:
            host = None
        return cls(nodes=nodes, devices_per_node=per_node, device=device, intra_node=intra, inter_node=inter,
                   devices_per_host=host, fabric=fabric)

    @classmethod
    def local(cls, nprocs: int | None = None, threads_per_rank: int | None = None, *,
              profile_db: str | None = None, refresh: bool = False, strict: bool = False,
              progress: bool = True) -> "Cluster":
        """This machine with measured device and links (the profiler), loaded from the profile cache
        (``profile_db``, default ``~/.cache/autopar/profile.json``) when it was measured before.

        GPUs: one rank per GPU (``nprocs`` of them, default all), NCCL. CPU: ``nprocs`` gloo ranks of
        ``threads_per_rank`` threads (default one-thread ranks on every core; given ``nprocs``
        alone, the cores shared out). ``refresh=True`` measures again and replaces the cache. First
        run: about 10-40 s. A measurement taken while other processes loaded the machine is taken
        again (up to 3 times, the least noisy kept), then warned about (``NoisyProfileWarning``), as
        is a noisy one loaded from the cache; ``strict=True`` refuses it (``NoisyProfileError``).
        """
        from .profiler.local import local_profile
        return cls.of_local(local_profile(nprocs, threads_per_rank, profile_db=profile_db, refresh=refresh,
                                          strict=strict, progress=progress))

    @classmethod
    def of_local(cls, measured: Any) -> "Cluster":
        """The cluster of what :meth:`local` measured (a profiler/local.py ``LocalProfile``)."""
        return cls(nodes=1, devices_per_node=measured.ranks, device=measured.fitted,
                   intra_node=measured.intra_node, inter_node=measured.inter_node,
                   profile_conditions=measured.conditions)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "devices_per_node": self.devices_per_node, "devices_per_host": self.devices_per_host,
                "device": self.device.to_dict(),
                "intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict(),
                "profile_conditions": [c.to_dict() for c in self.profile_conditions],
                "fabric": self.fabric.to_dict() if self.fabric is not None else None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cluster":
        data = from_dict(cls, data)
        for key, kind in (("device", Device), ("intra_node", Link), ("inter_node", Link), ("fabric", Fabric)):
            if isinstance(data.get(key), Mapping):
                data[key] = kind.from_dict(data[key])
        conditions = data.get("profile_conditions", [])
        if not isinstance(conditions, (list, tuple)):
            raise ConfigError(f"cluster profile_conditions={conditions!r} must be a list of objects")
        data["profile_conditions"] = tuple(ProfileConditions.from_dict(c) for c in conditions)
        return cls(**data)

    def describe(self) -> str:
        """E.g. "128 x 8 x A100-80GB (1024 devices; NVLink 300 GB/s, IB 25 GB/s per device)"."""
        intra = f"{self.intra_node.name or 'intra-node'} {self.intra_node.bandwidth / 1e9:g} GB/s"
        inter = f"{self.inter_node.name or 'inter-node'} {self.inter_node.bandwidth / 1e9:g} GB/s"
        hosts = f", {self.hosts} machines of {self.host_devices}" if self.devices_per_host else ""
        fabric = (f"; pods of {self.fabric.pod_nodes} nodes, 1:{self.fabric.oversubscription:g} between them"
                  if self.fabric is not None else "")
        return (f"{self.nodes} x {self.devices_per_node} x {self.device.name} "
                f"({self.devices} devices{hosts}; {intra}, {inter} per device{fabric})")


def _override(link: Link, which: str, bandwidth: float | None, latency: float | None) -> Link:
    if bandwidth is not None:
        check_number("Cluster.from_spec", f"{which}_bandwidth", bandwidth)
        link = Link(bandwidth=bandwidth, latency=link.latency, efficiency=1.0, name=link.name, peers=link.peers)
    if latency is not None:
        check_number("Cluster.from_spec", f"{which}_latency", latency, allow_zero=True)
        link = Link(bandwidth=link.bandwidth, latency=latency, efficiency=link.efficiency, name=link.name,
                    peers=link.peers)
    return link
