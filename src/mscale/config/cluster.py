"""The cluster: how many nodes, what is in each, and how they are wired.

Three bandwidth tiers matter to the planner (MegaScale §3, docs/references.md): the fast domain inside a node
(NVLink) where tensor parallelism lives, the NICs between nodes of one pod, and the links between
pods, often oversubscribed, which data-parallel traffic should avoid.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import Field, field_validator, model_validator

from mscale.config.base import FieldError, StrictModel
from mscale.config.gpus import MAX_RATE, GPUSpec, resolve_gpu
from mscale.hostlist import expand_hostlist

MAX_GPUS = 1 << 20
"""Largest cluster mscale plans for (1,048,576 GPUs; the largest trainings today use ~10^5).
The planner's search and a plan's rank map stay bounded in time and size up to here."""
MAX_PER_NODE = 1024
"""Most GPUs or NICs in one node."""


class ClusterConfig(StrictModel):
    """A cluster description, e.g. ``plans/clusters/a100-12288.yaml``."""

    schema_version: int = Field(default=1, ge=1, le=1)
    """Version of this schema; bumped on incompatible changes."""
    name: str = Field(default="cluster", max_length=200)
    """Free-form name shown in reports."""
    nodes: int | None = Field(default=None, gt=0, le=MAX_GPUS)
    """Number of nodes. May be omitted when ``hostlist`` is given; must agree with it otherwise.
    At most 1,048,576 GPUs in all (nodes·gpus_per_node)."""
    hostlist: str | None = Field(default=None, min_length=1, max_length=1_000_000)
    """Node names in SLURM syntax, e.g. ``node[0001-1536]`` (at most 100,000 nodes). Default:
    ``node00000`` … ."""
    gpus_per_node: int = Field(default=8, gt=0, le=MAX_PER_NODE)
    """Accelerators (one process each) per node."""
    gpu: GPUSpec = Field(json_schema_extra={"doc_type": "preset name or mapping"})
    """A preset name (A100, A100-40GB, H100, H800, H200, cpu) or a full spec."""
    fast_domain_size: int | None = Field(default=None, gt=0, le=MAX_PER_NODE)
    """GPUs joined by the fast interconnect (NVLink); divides ``gpus_per_node``. Default:
    ``gpus_per_node``."""
    fast_domain_gb_per_s: float | None = Field(default=None, gt=0, le=MAX_RATE)
    """Bidirectional GB/s per GPU inside the fast domain. Default: the GPU preset's NVLink rate."""
    nics_per_node: int = Field(default=8, gt=0, le=MAX_PER_NODE)
    """Inter-node NICs per node (one per GPU on the paper's machines)."""
    nic_gbit_per_s: float = Field(default=200, gt=0, le=MAX_RATE)
    """Line rate of one NIC in Gb/s per direction (HDR 200, NDR 400)."""
    nodes_per_pod: int | None = Field(default=None, gt=0, le=MAX_GPUS)
    """Nodes below one spine/pod with non-blocking bandwidth, counted from the first node; the
    last pod may be partial (nodes need not be a multiple of it). Default: the whole cluster is
    one pod."""
    inter_pod_gbit_per_s: float | None = Field(default=None, gt=0, le=MAX_RATE)
    """Per-NIC Gb/s available when traffic leaves the pod. Default: ``nic_gbit_per_s`` (non-blocking)."""

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu_preset(cls, v: Any) -> Any:
        return resolve_gpu(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterConfig":
        if self.hostlist is not None:
            count = _count_hosts(self.hostlist)
            if self.nodes is None:
                object.__setattr__(self, "nodes", count)
            elif self.nodes != count:
                raise FieldError("nodes", f"hostlist {_short(self.hostlist)} names {count} nodes "
                                 f"but nodes is {self.nodes}; make them agree or drop one")
        if self.nodes is None:
            raise FieldError("nodes", "give nodes (a count) or hostlist (SLURM syntax)")
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise FieldError("nodes", f"{self.nodes * self.gpus_per_node:,} GPUs in all "
                             f"(nodes·gpus_per_node), more than the {MAX_GPUS:,} mscale plans for")
        if self.fast_domain_size is not None and self.fast_domain_size > self.gpus_per_node:
            raise FieldError("fast_domain_size", "larger than gpus_per_node is not supported "
                             "(multi-node NVLink domains); set it to gpus_per_node or less")
        if self.fast_domain_size is not None and self.gpus_per_node % self.fast_domain_size:
            raise FieldError("fast_domain_size", "must divide gpus_per_node")
        return self

    # -- derived values: one place so every consumer agrees ------------------------------------
    @property
    def num_nodes(self) -> int:
        assert self.nodes is not None
        return self.nodes

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def domain_size(self) -> int:
        return self.fast_domain_size or self.gpus_per_node

    @property
    def domain_gb_per_s(self) -> float:
        """Unidirectional GB/s per GPU in the fast domain (vendor figures are bidirectional)."""
        return (self.fast_domain_gb_per_s or self.gpu.nvlink_gb_per_s) / 2

    @property
    def node_gb_per_s(self) -> float:
        """Unidirectional GB/s leaving one node over all its NICs."""
        return self.nics_per_node * self.nic_gbit_per_s / 8

    @property
    def pod_nodes(self) -> int:
        return self.nodes_per_pod or self.num_nodes

    @property
    def inter_pod_node_gb_per_s(self) -> float:
        """Unidirectional GB/s one node can push out of its pod."""
        per_nic = self.inter_pod_gbit_per_s or self.nic_gbit_per_s
        return self.nics_per_node * per_nic / 8

    def node_names(self) -> list[str]:
        """Names of all nodes in order; node index i is ``node_names()[i]``."""
        if self.hostlist:
            return expand_hostlist(self.hostlist)
        return [f"node{i:05d}" for i in range(self.num_nodes)]


def _count_hosts(hostlist: str) -> int:
    """How many nodes a cluster file's hostlist names; a node named twice or none at all is
    refused (a node list given twice would otherwise be one node fewer than written, and a
    ``nodes:`` that agreed with the text be told it disagrees)."""
    try:
        names = expand_hostlist(hostlist, unique=False)
    except ValueError as e:
        raise FieldError("hostlist", str(e)) from None
    if not names:
        raise FieldError("hostlist", "names no node; write the nodes in SLURM syntax, e.g. "
                         "node[001-016], or drop hostlist and give nodes")
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:
        raise FieldError("hostlist", f"{_short(hostlist)} names {', '.join(twice[:3])}"
                         f"{' ...' if len(twice) > 3 else ''} more than once; list each node "
                         "once")
    return len(names)


def _short(text: str, limit: int = 60) -> str:
    """A quoted value cut to fit in a one-line error."""
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")
