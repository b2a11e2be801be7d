"""InfiniBand / RoCE ports from sysfs: state, trained rate, and error counters over a window.

A port that trained at a lower width or speed, or that drops and retrains while traffic runs,
slows every collective that crosses it; the job then runs at the pace of that node. The kernel
exposes all of it under ``/sys/class/infiniband/<device>/ports/<n>/``: ``state``
(``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``rate`` (``200 Gb/sec (4X HDR)``) and
``counters/``. Counters are cumulative since boot, so only their change over the test window
(a `snapshot` before the network tests, one after) says something about now.

Thresholds (docs/preflight.md, "Host checks"):
- a new ``link_downed`` → CRITICAL: the link went down during the window;
- new ``link_error_recovery``, ``local_link_integrity_errors``, ``excessive_buffer_overrun_errors``
  or ``port_rcv_errors`` → WARNING;
- ``symbol_error`` is judged as a rate, never as "any increment": on PAM4 links (HDR, NDR: 50 and
  100 Gb/s per lane) forward error correction is mandatory and the counter sees errors that FEC
  did not fix, which a healthy link produces now and then. The bit error rate over the window,
  errors / (line rate × seconds), above 1e-12 (ibdiagnet's BER threshold) → WARNING.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from mscale.config.preflight import STATUS_CODE, CheckResult, Status
from mscale.errors import MscaleError

IB_CLASS = ("class", "infiniband")
BER_LIMIT = 1e-12
"""Largest acceptable bit error rate: ibdiagnet's default BER threshold (NVIDIA ibdiagnet user
manual, "Bit Error Rate (BER)")."""
PAM4_GBPS_PER_LANE = 50
"""HDR (50 Gb/s per lane) and faster signal in PAM4 with mandatory FEC; EDR and older in NRZ."""
CRITICAL_COUNTERS = ("link_downed",)
WARNING_COUNTERS = ("link_error_recovery", "local_link_integrity_errors",
                    "excessive_buffer_overrun_errors", "port_rcv_errors")
COUNTERS = CRITICAL_COUNTERS + WARNING_COUNTERS + ("symbol_error",)
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec(?:\s*\((\d+)X\s*([A-Za-z]*)\))?")


@dataclass(frozen=True)
class Port:
    """One port as sysfs shows it at one moment."""

    name: str
    """``<device>/<port>``, e.g. ``mlx5_0/1``."""
    state: str
    phys_state: str
    rate_gbps: float
    lanes: int
    speed: str
    link_layer: str
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state in ("LinkUp", "")

    @property
    def pam4(self) -> bool:
        return self.rate_gbps / max(self.lanes, 1) >= PAM4_GBPS_PER_LANE


@dataclass(frozen=True)
class Snapshot:
    """Every port of a node at time ``t`` (monotonic seconds)."""

    t: float
    ports: dict[str, Port]


def check_sysfs_root(root: str) -> None:
    """Raise MscaleError (exit 3) unless ``root`` looks like a sysfs tree: a directory with a
    ``class/`` directory, as /sys and a fixture tree for ``--sysfs-root`` both have."""
    if not os.path.isdir(root):
        raise MscaleError("the sysfs root is not a directory", file=root, field="--sysfs-root",
                          fix="give /sys, or a fixture tree holding class/infiniband/...")
    if not os.path.isdir(os.path.join(root, "class")):
        raise MscaleError("not a sysfs tree: it has no class/ directory", file=root,
                          field="--sysfs-root",
                          fix="give /sys, or a fixture tree holding class/infiniband/...")


def snapshot(root: str = "/sys") -> Snapshot:
    """Read every InfiniBand/RoCE port under ``root``; no devices → an empty snapshot."""
    base = os.path.join(root, *IB_CLASS)
    ports: dict[str, Port] = {}
    devices = sorted(os.listdir(base)) if os.path.isdir(base) else []
    for dev in devices:
        pdir = os.path.join(base, dev, "ports")
        for num in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
            ports[f"{dev}/{num}"] = _read_port(f"{dev}/{num}", os.path.join(pdir, num))
    return Snapshot(t=time.monotonic(), ports=ports)


def judge_ports(before: Snapshot, after: Snapshot, node: str, *, expected_gbps: float,
                nics: int) -> list[CheckResult]:
    """One result per port of ``after``. A port that is down is CRITICAL only when the active
    ports at the expected rate are fewer than the plan's ``nics_per_node`` (spare or unused ports
    may be down); a port below the cluster file's rate is CRITICAL (a degraded width or speed)."""
    window = max(after.t - before.t, 0.0)
    good = sum(p.active and p.rate_gbps >= expected_gbps for p in after.ports.values())
    out = []
    for name, port in after.ports.items():
        findings: list[tuple[Status, str]] = []
        if not port.active:
            short = good < nics
            findings.append(("CRITICAL" if short else "OK",
                             f"{port.state or '?'}/{port.phys_state or '?'}"
                             + (f": only {good} of the plan's {nics} ports per node are up"
                                if short else f", unused ({good} active ports cover {nics})")))
        elif port.rate_gbps < expected_gbps:
            findings.append(("CRITICAL", f"trained at {port.rate_gbps:g} Gb/s "
                             f"({port.lanes}X {port.speed}), below the cluster's "
                             f"{expected_gbps:g}: reseat or replace the cable"))
        deltas = _deltas(before.ports.get(name), port)
        ber = deltas.get("symbol_error", 0) / (port.rate_gbps * 1e9 * window) if window and \
            port.rate_gbps else 0.0
        if port.active:
            findings += _counter_findings(deltas, ber)
        status = max((s for s, _ in findings), key=STATUS_CODE.__getitem__, default="OK")
        out.append(CheckResult(
            check="ib_port", entity_kind="node", entity=f"{node}:{name}", node=node,
            value=port.rate_gbps, unit="Gb/s",
            expected=f"ACTIVE/LinkUp, >= {expected_gbps:g} Gb/s, 0 new link_downed, "
                     f"symbol BER <= {BER_LIMIT:g}",
            status=status, message="; ".join(m for _, m in findings) or "healthy",
            evidence={"state": port.state, "phys_state": port.phys_state,
                      "link_layer": port.link_layer, "modulation": "PAM4" if port.pam4 else "NRZ",
                      "window_s": round(window, 3), "deltas": deltas, "symbol_ber": ber}))
    return out


def _counter_findings(deltas: dict[str, int], ber: float) -> list[tuple[Status, str]]:
    out: list[tuple[Status, str]] = []
    for name in CRITICAL_COUNTERS:
        if deltas.get(name, 0) > 0:
            out.append(("CRITICAL", f"{name} +{deltas[name]} during the test: the link went "
                        "down; check the cable and the switch port"))
    for name in WARNING_COUNTERS:
        if deltas.get(name, 0) > 0:
            out.append(("WARNING", f"{name} +{deltas[name]} during the test"))
    if ber > BER_LIMIT:
        out.append(("WARNING", f"symbol errors at a bit error rate of {ber:.2g} "
                    f"(> {BER_LIMIT:g}): a marginal link"))
    return out


def _deltas(before: Port | None, after: Port) -> dict[str, int]:
    """Counter increments; a counter that went backwards was reset, so its value is the delta."""
    old = before.counters if before else after.counters
    return {k: v - old[k] if v >= old.get(k, 0) else v
            for k, v in after.counters.items() if k in old}


def _read_port(name: str, pdir: str) -> Port:
    rate_text = _read(os.path.join(pdir, "rate"))
    m = _RATE.match(rate_text)
    counters = {}
    cdir = os.path.join(pdir, "counters")
    for c in COUNTERS:
        text = _read(os.path.join(cdir, c))
        if text.isdigit():
            counters[c] = int(text)
    return Port(name=name, state=_after_colon(_read(os.path.join(pdir, "state"))),
                phys_state=_after_colon(_read(os.path.join(pdir, "phys_state"))),
                rate_gbps=float(m.group(1)) if m else 0.0,
                lanes=int(m.group(2)) if m and m.group(2) else 1,
                speed=(m.group(3) or "") if m else "",
                link_layer=_read(os.path.join(pdir, "link_layer")), counters=counters)


def _after_colon(text: str) -> str:
    """``4: ACTIVE`` → ``ACTIVE``."""
    return text.split(":", 1)[-1].strip()


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""
