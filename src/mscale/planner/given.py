"""A layout the user runs today (from options or a file), completed and checked, to be evaluated
next to the search's best."""

from __future__ import annotations

from typing import Any

from mscale.config.base import parse_yaml, read_text, validate
from mscale.config.layout import LayoutConfig, check_layout
from mscale.errors import MscaleError
from mscale.planner.cost import Problem

def load_layout_data(path: str) -> dict[str, Any]:
    """The layout mapping of a file: a bare layout, or the ``layout:`` section of a plan."""
    data = parse_yaml(read_text(path), path)
    if isinstance(data, dict) and isinstance(data.get("layout"), dict):
        data = data["layout"]
    if not isinstance(data, dict):
        raise MscaleError("expected a mapping of layout fields (tp, pp, ...) or a plan",
                          file=path, fix="see docs/plan.md for the layout fields")
    return dict(data)


def given_layout(pb: Problem, options: dict[str, Any], path: str | None) -> LayoutConfig | None:
    """Build the given layout from ``path`` and/or options; None when neither is given.

    Unset fields take the training config's value, then a default (tp 1, pp 1, vpp 1, SP when
    tp > 1); dp is derived from the GPU count (a file's own dp is replaced).
    """
    options = {k: v for k, v in options.items() if v is not None}
    if path is None and not options:
        return None
    data = load_layout_data(path) if path else {}
    data.update(options)
    source = path or "command line"
    tr, world = pb.training, pb.cluster.world_size
    sizes = validate(LayoutConfig, {k: data[k] for k in ("tp", "pp") if k in data}, source,
                     prefix="layout.")  # types and bounds first: the arithmetic below trusts them
    tp, pp = sizes.tp, sizes.pp
    for name, val in (("tp", tp), ("pp", tp * pp)):
        if val < 1 or world % val:
            raise MscaleError(f"{world} GPUs are not divisible by "
                              f"{'tp' if name == 'tp' else 'tp·pp'} = {val}", file=source,
                              field=f"layout.{name}", fix="pick tp and pp whose product divides "
                              f"nodes·gpus_per_node = {world}")
    # derived, even where the file says otherwise: a plan made for another cluster size carries
    # its own dp, and refusing it asked for a dp no option sets
    data["dp"] = world // (tp * pp)
    data.setdefault("sequence_parallel", tp > 1 and pb.model.seq_len % tp == 0)
    for f in ("micro_batch", "zero_stage", "recompute"):
        if getattr(tr, f) is not None:
            data.setdefault(f, getattr(tr, f))
    layout = validate(LayoutConfig, data, source, prefix="layout.")
    check_layout(layout, pb.model, tr, pb.cluster, source=source)
    return layout
