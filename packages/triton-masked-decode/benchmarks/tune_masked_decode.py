"""Tuning sweep that chooses the launch defaults of ``masked_decode`` for the GPU it runs on.

    python packages/triton-masked-decode/benchmarks/tune_masked_decode.py [--out sweep.json] \
        [--write-defaults] [--rep 50]

At Hq=32, Hkv=8, D=128, fp16, L=64K (masks as in ``run.py``) it times ``masked_decode`` as CUDA-graph
replays (``bench_masked_decode.time_us``: median, L2 flushed before each)
under variants of the launch knobs (fields of ``MaskedDecodeConfig``), checking every variant's output against the float32 reference (eager
and after a graph replay); a variant with a wrong result is never chosen. Three steps, each choosing by the
geometric mean of its time over the step's cases relative to the current defaults' variant:

1. one-wave launches (batch 1: 10/25/50% random, 10/25% clusters of 64, no mask): sparse gather tile
   (rows, pipelining depth) and programs per SM;
2. multi-wave launches (batch 8, same masks): sparse gather tile and the most positions per split with a
   mask;
3. with those, the default ``sparse_threshold`` per launch class (0 = dense loop everywhere, 0.45, 0.6,
   0.75, 1.0) over 25 to 100% visible random masks and 25% clusters at batch 1, 4 and 8. A threshold is
   chosen over 1.0 only if it is at least 1% faster and slows no 25%-visible case by more than 3%.

``--write-defaults`` stores the choices in ``src/triton_masked_decode/_tuned.py`` under this device's name
(``torch.cuda.get_device_name()``), beside the entries of other devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import Case, capture_graph, copy_bandwidth, make_mask, run_header, time_us

from triton_masked_decode import MaskedDecodeConfig, masked_decode, masked_decode_ref, tuned_defaults

md = sys.modules["triton_masked_decode.masked_decode"]  # the package re-exports a function of that name
tuned_table = sys.modules["triton_masked_decode._tuned"]

HQ, HKV, D, L = 32, 8, 128, 65536
# Dense-loop tile fixed to the autotuner's usual pick for "auto" at these shapes (no autotuning in the sweep).
BASE = {"block_n": 32, "num_warps": 4, "num_stages": 3}
# Masks: name -> (visible fraction, pattern); "rand100" is a mask with every position visible.
MASKS = {
    "rand10": (0.1, "random"),
    "rand25": (0.25, "random"),
    "rand50": (0.5, "random"),
    "rand75": (0.75, "random"),
    "rand100": (1.0, "random"),
    "clus10": (0.1, "cluster64"),
    "clus25": (0.25, "cluster64"),
    "nomask": (1.0, "none"),
}
ONE_WAVE_CASES = [(1, m) for m in ("rand10", "rand25", "rand50", "clus10", "clus25", "nomask")]
MULTI_WAVE_CASES = [(8, m) for m in ("rand10", "rand25", "rand50", "clus10", "clus25")]
THRESHOLD_CASES = [(b, m) for b in (1, 4, 8) for m in ("rand25", "clus25", "rand50", "rand75", "rand100")]
THRESHOLDS = (0.0, 0.45, 0.6, 0.75, 1.0)
# Variants: tag -> MaskedDecodeConfig fields; each step also measures the starting defaults' own variant.
ONE_WAVE_VARIANTS = {
    "ns64-s2-psm4": {"block_ns": 64, "sparse_stages": 2, "programs_per_sm": 4},
    "ns64-s3-psm3": {"block_ns": 64, "sparse_stages": 3, "programs_per_sm": 3},
    "ns32-s3-psm3": {"block_ns": 32, "sparse_stages": 3, "programs_per_sm": 3},
    "ns32-s4-psm3": {"block_ns": 32, "sparse_stages": 4, "programs_per_sm": 3},
    "ns32-s4-psm4": {"block_ns": 32, "sparse_stages": 4, "programs_per_sm": 4},
    "ns16-s4-psm4": {"block_ns": 16, "sparse_stages": 4, "programs_per_sm": 4},
    "ns16-s4-psm5": {"block_ns": 16, "sparse_stages": 4, "programs_per_sm": 5},
}
MULTI_WAVE_VARIANTS = {
    f"ns{ns}-s{st}-mc{mc}": {"block_ns": ns, "sparse_stages": st, "max_chunk": mc}
    for ns, st in ((64, 2), (64, 3), (32, 3), (32, 4), (16, 4))
    for mc in (4096, 2048)
    if not (mc == 2048 and (ns, st) in ((64, 2), (16, 4)))
}


class Sweep:
    def __init__(self, rep: int) -> None:
        self.rep = rep
        self.rows: list[dict] = []
        self.times: dict[tuple[str, int, str], float] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.masks: dict[tuple[int, str], torch.Tensor | None] = {}
        self.refs: dict[tuple[int, str], torch.Tensor] = {}

    def data(self, batch: int, mask_name: str):
        if batch not in self.inputs:
            g = torch.Generator(device="cuda").manual_seed(batch)
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16, generator=g)
            k = torch.randn(batch, HKV, L, D, device="cuda", dtype=torch.float16, generator=g)
            v = torch.randn_like(k)
            self.inputs[batch] = (q, k, v)
        q, k, v = self.inputs[batch]
        key = (batch, mask_name)
        if key not in self.masks:
            dens, pattern = MASKS[mask_name]
            case = Case("tune", batch, [L] * batch, L, dens, pattern)
            self.masks[key] = make_mask(case, torch.Generator(device="cuda").manual_seed(100 + batch))
            self.refs[key] = masked_decode_ref(q, k, v, self.masks[key])[0].float()
        return q, k, v, self.masks[key], self.refs[key]

    def measure(
        self, tag: str, knobs: dict, batch: int, mask_name: str, threshold: float | None
    ) -> float | None:
        q, k, v, mask, ref = self.data(batch, mask_name)
        config = MaskedDecodeConfig(**{**BASE, **knobs}, sparse_threshold=threshold)

        def fn():
            return masked_decode(q, k, v, mask, check_values=False, config=config)

        row: dict = {"variant": tag, "batch": batch, "mask": mask_name, "threshold": threshold, **knobs}
        try:
            err_eager = float((fn()[0].float() - ref).abs().max())
            graph, res = capture_graph(fn)
            res[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            err_graph = float((res[0].float() - ref).abs().max())
            t, _method, _host = time_us(fn, warmup=10, rep=self.rep)
        except Exception as e:  # a variant failing must not stop the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{tag:18s} B{batch} {mask_name:8s} FAILED {row['error'][:160]}", flush=True)
            self.rows.append(row)
            return None
        ok = err_eager < 1e-2 and err_graph < 1e-2
        row.update({"us": t, "err_eager": err_eager, "err_graph": err_graph, "ok": ok})
        self.rows.append(row)
        flag = "" if ok else f"  WRONG (eager {err_eager:.3g}, graph {err_graph:.3g})"
        print(f"{tag:18s} B{batch} {mask_name:8s} thr={threshold}  {t:8.1f} us{flag}", flush=True)
        if not ok:
            return None
        self.times[(tag, batch, mask_name)] = t
        return t

    def choose(
        self, variants: dict[str, dict], cases, ref_tag: str, threshold: float | None
    ) -> tuple[str, dict]:
        """Measure every variant on every case; the lowest geometric mean of time / reference time wins."""
        for tag, knobs in variants.items():
            for batch, m in cases:
                self.measure(tag, knobs, batch, m, threshold)
        scores = {}
        for tag in variants:
            rel = []
            for batch, m in cases:
                t, t0 = self.times.get((tag, batch, m)), self.times.get((ref_tag, batch, m))
                if t is None or t0 is None:
                    break
                rel.append(math.log(t / t0))
            else:
                scores[tag] = math.exp(sum(rel) / len(rel))
        for tag, sc in sorted(scores.items(), key=lambda kv: kv[1]):
            print(f"  score {tag:18s} {sc:.4f}", flush=True)
        best = min(scores, key=lambda t: scores[t]) if scores else ref_tag
        return best, scores


def one_wave_class(batch: int, knobs: dict) -> bool:
    """The launch class masked_decode gives this batch under the chosen knobs."""
    config = MaskedDecodeConfig(**{**BASE, **knobs})
    dev = md._device_facts(torch.device("cuda"))
    return bool(md._plan_launch(batch, HQ, HKV, D, L, True, config, dev)[0].one_wave)


def write_defaults(path: Path, device: str, chosen: dict) -> None:
    """Store ``chosen`` as ``device``'s entry of the ``TUNED`` table in ``_tuned.py`` (others kept)."""
    table = dict(tuned_table.TUNED)
    table[device] = {
        "measured_on": device,
        "programs_per_sm": chosen["programs_per_sm"],
        "max_chunk_masked": chosen["max_chunk_masked"],
        **{
            cls: {
                "block_ns": chosen[f"tile_{cls}"][0],
                "sparse_stages": chosen[f"tile_{cls}"][1],
                "sparse_threshold": chosen[f"threshold_{cls}"],
            }
            for cls in ("one_wave", "multi_wave")
        },
    }
    text = path.read_text()
    head = text[: text.index("TUNED = ")]
    path.write_text(head + "TUNED = " + json.dumps(table, indent=4) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rep", type=int, default=40, help="do_bench time budget per measurement, ms")
    ap.add_argument("--write-defaults", action="store_true", help="rewrite _tuned.py with the choices")
    args = ap.parse_args()
    bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}  copy bw {bw / 1e12:.3f} TB/s", flush=True)
    tuned = tuned_defaults(device)
    start = {
        "programs_per_sm": tuned.programs_per_sm,
        "tile_one_wave": [tuned.one_wave.block_ns, tuned.one_wave.sparse_stages],
        "tile_multi_wave": [tuned.multi_wave.block_ns, tuned.multi_wave.sparse_stages],
        "max_chunk_masked": tuned.max_chunk_masked,
        "threshold_one_wave": tuned.one_wave.sparse_threshold,
        "threshold_multi_wave": tuned.multi_wave.sparse_threshold,
    }
    sw = Sweep(args.rep)

    def with_start(variants: dict[str, dict], cls: str, knob: str, key: str, fmt: str) -> tuple[dict, str]:
        """The variants plus the starting defaults' own one (the reference of the step)."""
        ns, st = start[f"tile_{cls}"]
        ref = fmt.format(ns, st, start[key])
        return {**variants, ref: {"block_ns": ns, "sparse_stages": st, knob: start[key]}}, ref

    # 1. one-wave launches; 2. multi-wave launches (threshold 1.0: every masked split on the sparse loop).
    ow, ref1 = with_start(
        ONE_WAVE_VARIANTS, "one_wave", "programs_per_sm", "programs_per_sm", "ns{}-s{}-psm{}"
    )
    best1, scores1 = sw.choose(ow, ONE_WAVE_CASES, ref1, threshold=1.0)
    print(f"one-wave choice: {best1} {ow[best1]}", flush=True)
    mw, ref2 = with_start(MULTI_WAVE_VARIANTS, "multi_wave", "max_chunk", "max_chunk_masked", "ns{}-s{}-mc{}")
    best2, scores2 = sw.choose(mw, MULTI_WAVE_CASES, ref2, threshold=1.0)
    print(f"multi-wave choice: {best2} {mw[best2]}", flush=True)

    chosen = {
        "programs_per_sm": ow[best1]["programs_per_sm"],
        "tile_one_wave": [ow[best1]["block_ns"], ow[best1]["sparse_stages"]],
        "tile_multi_wave": [mw[best2]["block_ns"], mw[best2]["sparse_stages"]],
        "max_chunk_masked": mw[best2]["max_chunk"],
    }

    # 3. thresholds, with each case's launch class under the chosen knobs.
    def knobs_for(batch: int) -> tuple[str, dict]:
        base = {"programs_per_sm": chosen["programs_per_sm"], "max_chunk": chosen["max_chunk_masked"]}
        cls = "one_wave" if one_wave_class(batch, base) else "multi_wave"
        ns, st = chosen["tile_" + cls]
        return cls, {**base, "block_ns": ns, "sparse_stages": st}

    thr_rel: dict[str, dict[float, list[float]]] = {"one_wave": {}, "multi_wave": {}}
    # A threshold that slows a sparse (25% visible) case by more than 3% (beyond noise) is not eligible.
    slows_sparse: dict[str, set[float]] = {"one_wave": set(), "multi_wave": set()}
    classes = {}
    for batch, m in THRESHOLD_CASES:
        cls, knobs = knobs_for(batch)
        classes[batch] = cls
        t_by_thr = {}
        for thr in THRESHOLDS:
            t = sw.measure(f"thr{thr}", knobs, batch, m, thr)
            if t is not None:
                t_by_thr[thr] = t
        if 1.0 in t_by_thr:
            for thr, t in t_by_thr.items():
                thr_rel[cls].setdefault(thr, []).append(math.log(t / t_by_thr[1.0]))
                if m in ("rand25", "clus25") and t > 1.03 * t_by_thr[1.0]:
                    slows_sparse[cls].add(thr)
    n_cases = {cls: sum(1 for b, _ in THRESHOLD_CASES if classes[b] == cls) for cls in thr_rel}
    thr_scores = {
        cls: {thr: math.exp(sum(v) / len(v)) for thr, v in d.items() if len(v) == n_cases[cls]}
        for cls, d in thr_rel.items()
    }
    for cls, sc in thr_scores.items():
        for thr, s in sorted(sc.items()):
            note = "  (slows a 25% case: not eligible)" if thr in slows_sparse[cls] else ""
            print(f"  {cls} threshold {thr}: {s:.4f}{note}", flush=True)
        eligible = {t: s for t, s in sc.items() if t not in slows_sparse[cls]}
        best_thr = min(eligible, key=lambda t: eligible[t]) if eligible else 1.0
        chosen[f"threshold_{cls}"] = best_thr if eligible.get(best_thr, 1.0) < 0.99 else 1.0
    print(f"chosen defaults: {chosen}  (start: {start}); classes {classes}", flush=True)

    if args.write_defaults:
        write_defaults(Path(tuned_table.__file__), device, chosen)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header(
                        "launch-default sweep (CUDA-graph replay, median, L2 flushed); see the module docstring"
                    ),
                    "bw": bw,
                    "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "L": L, "dtype": "float16"},
                    "base_dense_tile": BASE,
                    "start_defaults": start,
                    "one_wave_scores": scores1,
                    "multi_wave_scores": scores2,
                    "threshold_scores": {c: {str(t): s for t, s in d.items()} for c, d in thr_scores.items()},
                    "thresholds_slowing_sparse_cases": {c: sorted(v) for c, v in slows_sparse.items()},
                    "classes": {str(b): c for b, c in classes.items()},
                    "chosen": chosen,
                    "rows": sw.rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
