"""The :class:`Placement` result: the three mapping tensors plus the quality figures of a plan."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb_core._validate import check_placement_tensors, check_weight
from eplb_core.metrics import balancedness as _balancedness

__all__ = ["Placement", "PlacementDiff", "avoidable_repeats", "gpu_loads_of"]

MODES = ("strict", "global", "soft")


def gpu_loads_of(weight: Any, phy2log: Any, logcnt: Any, num_gpus: int) -> torch.Tensor:
    """Per-GPU load ``[L, num_gpus]`` float64 of a placement under ``weight [L, N]``, on ``weight``'s
    device.

    An expert's load is split evenly over its ``logcnt [L, N]`` replicas; ``phy2log [L, R]`` (integer)
    holds the expert of every physical slot, GPU-major (slot ``p`` lives on GPU ``p // (R / num_gpus)``).

    Raises:
        ValueError: naming the argument, for loads :func:`eplb_core.rebalance_experts` rejects, shapes
            that do not match, non-integer ``phy2log`` / ``logcnt``, ids outside ``[0, N)``, an expert
            without a replica, or ``num_gpus`` not dividing ``R``.
    """
    w = check_weight(weight)
    phy, cnt = check_placement_tensors(w, phy2log, logcnt, num_gpus)
    per_slot = (w / cnt.to(torch.float64)).gather(1, phy)
    return per_slot.view(per_slot.shape[0], num_gpus, -1).sum(-1)


def avoidable_repeats(
    phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int, num_nodes: int, mode: str
) -> np.ndarray:
    """``[L]`` bool: layers in which a GPU holds two replicas of an expert that has no more replicas
    than the GPUs it may use (its node's in strict mode, all in global and soft mode), so that the
    repeat was avoidable."""
    num_replicas = phy2log.shape[1]
    num_logical = logcnt.shape[1]
    gpu = np.arange(num_replicas) // (num_replicas // num_gpus)
    domain = num_gpus // num_nodes if mode == "strict" else num_gpus
    sorted_key = np.sort(gpu * num_logical + phy2log, axis=1)
    dup = sorted_key[:, 1:] == sorted_key[:, :-1]
    allowed = np.take_along_axis(logcnt, sorted_key[:, 1:] % num_logical, 1) > domain
    return (dup & ~allowed).any(1)


@dataclass(frozen=True)
class PlacementDiff:
    """What changes between two placements of the same shape.

    Attributes:
        changed: ``[L, R]`` bool, slots whose logical expert differs (those weights must be loaded).
        num_changed: ``[L]`` int64 changed slots per layer.
        fraction_changed: changed slots over all slots (a float in ``[0, 1]``).
        bytes_to_move: total bytes to load if ``bytes_per_expert`` was given, else None.
    """

    changed: torch.Tensor
    num_changed: torch.Tensor
    fraction_changed: float
    bytes_to_move: int | None


@dataclass(frozen=True)
class Placement:
    """A plan for every MoE layer, with its quality figures.

    Attributes:
        phy2log: ``[L, R]`` int64, the logical expert held by each physical slot (GPU-major).
        log2phy: ``[L, N, max_replicas]`` int64, physical slots of each logical expert, ``-1`` padded.
        logcnt: ``[L, N]`` int64 replica count of each logical expert.
        weight: ``[L, N]`` float64, the load the plan was made for (all-zero layers replaced by uniform).
        num_groups, num_nodes, num_gpus: the topology it was planned for.
        mode: ``"strict"`` (groups pinned to nodes), ``"global"`` or ``"soft"`` (soft locality).
        gpu_loads: ``[L, num_gpus]`` float64 load per GPU under ``weight``.
        balancedness: ``[L]`` float64, mean GPU load / max GPU load.
        lower_bound: ``[L]`` float64, a lower bound on the max GPU load of any valid plan in this mode.
        gap: ``[L]`` float64, ``max GPU load / lower_bound - 1`` (0 means provably optimal).
        cross_node_share: ``[L]`` float64, share of the layer's load served by replicas outside their
            group's home node (0 outside soft mode).
        changed_slots: ``[L]`` int64 slots changed against the previous plan, or None.
        zero_layers: ``[L]`` bool, layers whose input load was all zero (planned as uniform).
        home_node: ``[L, num_groups]`` int64 node of each group (strict/soft), or None.
        colocated_layers: ``[L]`` bool, layers that may hold two replicas of an expert on one GPU
            although a placement without that exists: a fresh plan flags a layer only where the
            greedy reference plan (:func:`eplb_core.reference.greedy_rebalance`, DeepSeek's packing)
            is more balanced than the planner's plan without such repeats, and takes the greedy plan
            there; a migration keeps a repeat only in a layer whose plan in service had one. None:
            no layer.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    weight: torch.Tensor
    num_groups: int
    num_nodes: int
    num_gpus: int
    mode: str
    gpu_loads: torch.Tensor
    balancedness: torch.Tensor
    lower_bound: torch.Tensor
    gap: torch.Tensor
    cross_node_share: torch.Tensor
    changed_slots: torch.Tensor | None = None
    zero_layers: torch.Tensor | None = None
    home_node: torch.Tensor | None = None
    colocated_layers: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- shape
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_replicas(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(phy2log, log2phy, logcnt)``, the DeepSeek/vLLM return value."""
        return self.phy2log, self.log2phy, self.logcnt

    # ---------------------------------------------------------------- scoring
    def gpu_loads_for(self, weight: torch.Tensor) -> torch.Tensor:
        """``[L, num_gpus]`` GPU loads of this plan under another load ``weight [L, N]``."""
        return gpu_loads_of(torch.as_tensor(weight), self.phy2log, self.logcnt, self.num_gpus)

    def balancedness_for(self, weight: torch.Tensor) -> torch.Tensor:
        """``[L]`` balancedness of this plan under another load (e.g. the next window)."""
        return _balancedness(self.gpu_loads_for(weight))

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        """Check every invariant of a placement; raise ``ValueError`` naming the first violation.

        Checked: shapes and dtypes; every logical expert has at least one replica; ``logcnt`` sums to
        ``num_replicas`` per layer and equals the replica counts in ``phy2log``; ``log2phy`` lists exactly
        the slots of each expert, ascending, ``-1`` padded; equal slots per GPU; in strict mode every replica
        of a group sits on the group's node and every node holds ``num_groups / num_nodes`` groups; no GPU
        holds two replicas of an expert unless the expert has more replicas than GPUs it may use or the
        layer is flagged in ``colocated_layers`` (two replicas on one GPU carry the load of one).
        """
        if any(x.dtype != torch.int64 for x in (self.phy2log, self.log2phy, self.logcnt)):
            raise ValueError("placement tensors must be int64")
        # NumPy on the host: a few dozen small array operations, each far cheaper than a torch call
        p, l2p, cnt = (x.detach().cpu().numpy() for x in (self.phy2log, self.log2phy, self.logcnt))
        num_layers, num_replicas = p.shape
        num_logical = cnt.shape[1]
        if num_replicas % self.num_gpus != 0:
            raise ValueError(f"num_replicas ({num_replicas}) is not a multiple of num_gpus ({self.num_gpus})")
        if int(p.min()) < 0 or int(p.max()) >= num_logical:
            raise ValueError("phy2log holds an expert id outside [0, num_logical)")
        if bool((cnt < 1).any()):
            raise ValueError("some logical expert has no replica (logcnt < 1)")
        if not bool((cnt.sum(1) == num_replicas).all()):
            raise ValueError("logcnt does not sum to num_replicas in every layer")
        layer_offset = np.arange(num_layers)[:, None] * num_logical
        counted = np.bincount((p + layer_offset).ravel(), minlength=num_layers * num_logical)
        if not np.array_equal(counted.reshape(num_layers, num_logical), cnt):
            raise ValueError("logcnt disagrees with the replica counts of phy2log")
        if l2p.shape != (num_layers, num_logical, int(cnt.max())):
            raise ValueError(
                f"log2phy has shape {tuple(l2p.shape)}, expected {(num_layers, num_logical, int(cnt.max()))}"
            )
        used = np.arange(l2p.shape[2]) < cnt[:, :, None]
        if bool((l2p[~used] != -1).any()):
            raise ValueError("log2phy is not -1 padded beyond logcnt")
        if int(l2p.max()) >= num_replicas:
            raise ValueError("log2phy points beyond the physical slots")
        owner = np.take_along_axis(p, np.maximum(l2p, 0).reshape(num_layers, -1), 1).reshape(l2p.shape)
        if bool((used & (owner != np.arange(num_logical)[None, :, None])).any()):
            raise ValueError("log2phy points at a slot that holds another expert")
        if bool((used[..., 1:] & (l2p[..., 1:] <= l2p[..., :-1])).any()):
            raise ValueError("log2phy slots are not distinct and ascending")
        gpu = np.arange(num_replicas) // (num_replicas // self.num_gpus)
        gpus_per_node = self.num_gpus // self.num_nodes
        if self.mode == "strict":
            group = p // (num_logical // self.num_groups)
            node = np.broadcast_to(gpu // gpus_per_node, p.shape)
            node_of_group = np.full((num_layers, self.num_groups), -1, dtype=np.int64)
            np.put_along_axis(node_of_group, group, node, 1)
            if not np.array_equal(np.take_along_axis(node_of_group, group, 1), node):
                raise ValueError("strict mode: replicas of one group sit on different nodes")
            per_node = np.zeros((num_layers, self.num_nodes), dtype=np.int64)
            np.add.at(per_node, (np.arange(num_layers)[:, None], node_of_group), 1)
            if not bool((per_node == self.num_groups // self.num_nodes).all()):
                raise ValueError("strict mode: nodes do not hold num_groups / num_nodes groups each")
        repeats = avoidable_repeats(p, cnt, self.num_gpus, self.num_nodes, self.mode)
        if self.colocated_layers is not None:
            flagged = self.colocated_layers.detach().cpu().numpy()
            if flagged.shape != (num_layers,) or flagged.dtype != np.bool_:
                raise ValueError(f"colocated_layers must be a [{num_layers}] bool tensor")
            repeats &= ~flagged
        if bool(repeats.any()):
            raise ValueError(
                "a GPU holds two replicas of an expert although that was avoidable (layer "
                f"{int(np.flatnonzero(repeats)[0])}, not in colocated_layers)"
            )

    # ---------------------------------------------------------------- comparison
    def diff(
        self, previous: Placement | torch.Tensor, *, bytes_per_expert: int | None = None
    ) -> PlacementDiff:
        """Slots that change from ``previous`` to this plan.

        Args:
            previous: a :class:`Placement` or its ``phy2log [L, R]``.
            bytes_per_expert: size of one expert's weights; gives ``bytes_to_move``.

        Returns:
            A :class:`PlacementDiff`.
        """
        prev = previous.phy2log if isinstance(previous, Placement) else torch.as_tensor(previous)
        if prev.shape != self.phy2log.shape:
            raise ValueError(f"previous has shape {tuple(prev.shape)}, expected {tuple(self.phy2log.shape)}")
        changed = prev.to(self.phy2log.device) != self.phy2log
        num_changed = changed.sum(1)
        total = int(num_changed.sum())
        moved = None if bytes_per_expert is None else total * int(bytes_per_expert)
        return PlacementDiff(changed, num_changed, total / changed.numel(), moved)

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict[str, float]:
        """Layer-averaged figures (floats), as printed by the CLI."""
        out = {
            "balancedness": float(self.balancedness.mean()),
            "min_balancedness": float(self.balancedness.min()),
            "mean_gap": float(self.gap.mean()),
            "cross_node_share": float(self.cross_node_share.mean()),
        }
        if self.changed_slots is not None:
            out["changed_fraction"] = float(self.changed_slots.sum()) / self.phy2log.numel()
        return out

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists of ints/floats)."""
        return {
            "format": "eplb-core/placement-v1",
            "num_groups": self.num_groups,
            "num_nodes": self.num_nodes,
            "num_gpus": self.num_gpus,
            "mode": self.mode,
            "phy2log": self.phy2log.cpu().tolist(),
            "logcnt": self.logcnt.cpu().tolist(),
            "weight": self.weight.cpu().tolist(),
            "zero_layers": None if self.zero_layers is None else self.zero_layers.cpu().tolist(),
            "home_node": None if self.home_node is None else self.home_node.cpu().tolist(),
            "colocated_layers": (
                None if self.colocated_layers is None else self.colocated_layers.cpu().tolist()
            ),
            "summary": self.summary(),
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (see :meth:`load`)."""
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def from_tensors(
        cls,
        phy2log: torch.Tensor,
        weight: torch.Tensor,
        *,
        num_groups: int,
        num_nodes: int,
        num_gpus: int,
        mode: str,
        logcnt: torch.Tensor | None = None,
        home_node: torch.Tensor | None = None,
        zero_layers: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
        lower_bound: torch.Tensor | None = None,
        colocated_layers: torch.Tensor | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Placement:
        """Build a placement (all derived tensors and figures) from ``phy2log`` and the load.

        Args:
            phy2log: ``[L, R]`` integer expert id of every physical slot (GPU-major).
            weight: ``[L, N]`` non-negative finite loads the figures are computed for.
            num_groups, num_nodes, num_gpus: the topology (as in :func:`eplb_core.plan`).
            mode: ``"strict"``, ``"global"`` or ``"soft"``.
            logcnt: ``[L, N]`` replica counts (default: counted from ``phy2log``).
            home_node: ``[L, num_groups]`` node of each group (strict/soft), for ``cross_node_share``.
            zero_layers: ``[L]`` bool, layers planned as uniform because their load was zero.
            previous: ``[L, R]`` the plan this one replaces (gives ``changed_slots``).
            lower_bound: ``[L]`` precomputed bound (default: :func:`eplb_core.lower_bound`).
            colocated_layers: ``[L]`` bool, layers allowed to repeat an expert on a GPU although that
                is avoidable (see the attribute); None: no layer.
            meta: free-form JSON-ready options, kept with the plan.

        Returns:
            A :class:`Placement` that passes :meth:`validate`.

        Raises:
            ValueError: naming the argument for wrong shapes, dtypes, topology or loads, and with
                :meth:`validate`'s message for a placement that breaks an invariant (an expert without
                a replica, a group split over nodes in strict mode, an avoidable repeat, ...).
        """
        from eplb_core._numba import runner
        from eplb_core._numba.utils import log2phy as _log2phy
        from eplb_core._validate import check_topology
        from eplb_core.bounds import lower_bound as _lower_bound

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        phy2log = torch.as_tensor(phy2log)
        if phy2log.dtype == torch.bool or phy2log.is_floating_point() or phy2log.is_complex():
            raise ValueError(f"phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
        w = check_weight(weight).to(phy2log.device)
        if phy2log.dim() != 2 or phy2log.shape[0] != w.shape[0]:
            raise ValueError(
                f"phy2log must be [num_layers, num_replicas] with the {w.shape[0]} layers of weight, "
                f"got shape {tuple(phy2log.shape)}"
            )
        num_logical = w.shape[1]
        check_topology(num_logical, phy2log.shape[1], num_groups, num_nodes, num_gpus)
        phy2log = phy2log.to(torch.int64)
        if int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical:
            raise ValueError(f"phy2log holds an expert id outside [0, {num_logical})")
        if logcnt is None:
            logcnt = torch.zeros_like(w, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
        logcnt = torch.as_tensor(logcnt).to(phy2log.device, torch.int64)
        if logcnt.shape != w.shape:
            raise ValueError(f"logcnt must have weight's shape {tuple(w.shape)}, got {tuple(logcnt.shape)}")
        if bool((logcnt < 1).any()):
            raise ValueError("some logical expert has no replica (logcnt < 1)")
        log2phy = torch.from_numpy(
            runner.call(_log2phy, phy2log.cpu().numpy(), logcnt.to(torch.int64).cpu().numpy())
        ).to(phy2log.device)
        loads = gpu_loads_of(w, phy2log, logcnt, num_gpus)
        if lower_bound is None:
            lower_bound = _lower_bound(w, phy2log.shape[1], num_groups, num_nodes, num_gpus, mode=mode)
        peak = loads.amax(1)
        gap = torch.where(lower_bound > 0, peak / lower_bound.clamp_min(1e-300) - 1, torch.zeros_like(peak))
        cross = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        if home_node is not None and mode == "soft":
            group_size = w.shape[1] // num_groups
            per_slot = (w / logcnt.to(torch.float64)).gather(1, phy2log)
            slot_node = torch.arange(phy2log.shape[1], device=w.device) // (phy2log.shape[1] // num_nodes)
            home = home_node.gather(1, phy2log // group_size)
            off = per_slot * (home != slot_node).to(torch.float64)
            cross = off.sum(1) / per_slot.sum(1).clamp_min(1e-300)
        changed = None if previous is None else (previous.to(phy2log.device) != phy2log).sum(1)
        placement = cls(
            phy2log=phy2log,
            log2phy=log2phy,
            logcnt=logcnt,
            weight=w,
            num_groups=num_groups,
            num_nodes=num_nodes,
            num_gpus=num_gpus,
            mode=mode,
            gpu_loads=loads,
            balancedness=_balancedness(loads),
            lower_bound=lower_bound,
            gap=gap,
            cross_node_share=cross,
            changed_slots=changed,
            zero_layers=zero_layers,
            home_node=home_node,
            colocated_layers=(
                None if colocated_layers is None else torch.as_tensor(colocated_layers).to(phy2log.device)
            ),
            meta=dict(meta or {}),
        )
        placement.validate()
        return placement

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read a plan written by :meth:`save`.

        Raises:
            ValueError: naming the file, when it is missing, is not an eplb-core placement JSON, or
                holds a placement that is not valid for its own topology.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"path {str(path)!r}: cannot read a placement JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("format") != "eplb-core/placement-v1":
            raise ValueError(f"path {str(path)!r} is not an eplb-core placement JSON")

        def tensor(key: str, dtype: torch.dtype) -> torch.Tensor | None:
            return None if data.get(key) is None else torch.tensor(data[key], dtype=dtype)

        try:
            phy2log, weight = tensor("phy2log", torch.int64), tensor("weight", torch.float64)
            if phy2log is None or weight is None:
                raise KeyError("phy2log and weight are required")
            placement = cls.from_tensors(
                phy2log,
                weight,
                num_groups=int(data["num_groups"]),
                num_nodes=int(data["num_nodes"]),
                num_gpus=int(data["num_gpus"]),
                mode=str(data["mode"]),
                logcnt=tensor("logcnt", torch.int64),
                home_node=tensor("home_node", torch.int64),
                zero_layers=tensor("zero_layers", torch.bool),
                colocated_layers=tensor("colocated_layers", torch.bool),
                meta=data.get("meta") or {},
            )
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise ValueError(f"path {str(path)!r}: not a valid eplb-core placement ({exc})") from exc
        return placement
