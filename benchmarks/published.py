"""The planner against published large runs (issue 56): for each row of
benchmarks/published/runs.csv, the cost model's prediction of the published layout's throughput
per GPU beside the published figure, then the mean absolute percentage error over the rows the
planner can model, and how often the planner's own best layout is the published one or predicted
within 5% of it.

    python benchmarks/published.py            # the table and the two figures
    python benchmarks/published.py --json     # the same as JSON

Rows the cost model cannot price (context parallelism, FP8, torch.compile, asynchronous tensor
parallelism) are listed with why and left out of both figures; their ``note`` column says so.
Each row names its source and whether its figures were checked against it (``checked``: most
are transcriptions so far, see the file).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from zerostack.estimate import EstimateError, Transformer
from zerostack.plan.cost import Candidate, model_flops, predict
from zerostack.plan.hardware import PlanError, profile
from zerostack.plan.search import search

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published", "runs.csv")
NOT_MODELLED = "not modelled"


def model_of(row: dict) -> Transformer:
    return Transformer(
        layers=int(row["layers"]),
        hidden=int(row["hidden"]),
        heads=int(row["heads"]),
        vocab=int(row["vocab"]),
        seq=int(row["seq"]),
        ffn=int(row["ffn"]),
        kv_heads=int(row["kv_heads"]),
        gated=row["gated"] == "1",
        tied=row["tied"] == "1",
        positions=row["gated"] != "1",  # the Llama rows are rotary; the GPT rows learned
        dropout=False,
        bias=row["gated"] != "1",
    )


def candidate_of(row: dict) -> Candidate:
    dp, batch = int(row["dp"]), int(row["batch"])
    micro = int(row["micro"]) if row["micro"] else 1
    if batch % (dp * micro):
        raise PlanError(f"{row['id']}: batch {batch} is not a multiple of dp {dp} x micro {micro}")
    return Candidate(
        dp=dp,
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        stage=int(row["stage"]),
        micro_batch=micro,
        gas=batch // (dp * micro),
        recompute=row["recompute"],
        precision=row["precision"],
        chunks=int(row["chunks"]),
    )


def metric(row: dict, m: Transformer, step_s: float, mfu: float) -> float:
    """The row's metric as the planner predicts it for a step of ``step_s`` seconds."""
    gpus, batch = int(row["gpus"]), int(row["batch"])
    if row["metric"] == "tflops_per_gpu":  # as the papers count: recomputed forwards included
        return model_flops(m, batch, recompute=row["recompute"]) / step_s / gpus / 1e12
    if row["metric"] == "tokens_per_s_per_gpu":
        return batch * m.seq / step_s / gpus
    return mfu


def why_not(row: dict) -> str:
    """Why the planner cannot price ``row`` ("" when it can)."""
    if int(row["cp"]) > 1:
        return "context parallelism"
    if row["precision"] not in ("fp32", "fp16", "bf16"):
        return f"{row['precision']} compute"
    for clause in row["note"].split(";"):  # "what: not modelled"
        if clause.strip().endswith(NOT_MODELLED):
            return clause.split(":")[0].strip()
    return ""


def evaluate(rows: list[dict], with_search: bool = True) -> dict:
    out = []
    for row in rows:
        entry = {"id": row["id"], "metric": row["metric"], "published": float(row["value"])}
        entry["skipped"] = why_not(row)
        if entry["skipped"]:
            out.append(entry)
            continue
        m, c = model_of(row), candidate_of(row)
        hw = profile(row["gpu"], gpus=int(row["gpus"]))
        try:
            p = predict(m, int(row["batch"]), c, hw)
        except EstimateError as exc:  # a layout the estimator refuses (uneven pipeline stages)
            entry["skipped"] = str(exc)
            out.append(entry)
            continue
        entry["predicted"] = metric(row, m, p.step_s, p.mfu)
        entry["error"] = entry["predicted"] / entry["published"] - 1
        if with_search:
            try:
                best = search(m, hw, int(row["batch"]), precision=c.precision).best
                entry["best"] = best.candidate.__dict__
                entry["match"] = p.step_s <= best.step_s * 1.05
            except PlanError as exc:  # the published layout does not fit the planner's memory
                entry["best"], entry["match"] = str(exc), False
        out.append(entry)
    priced = [e for e in out if not e["skipped"]]
    matched = [e for e in priced if e.get("match")]
    return {
        "rows": out,
        "priced": len(priced),
        "mape": sum(abs(e["error"]) for e in priced) / max(1, len(priced)),
        "layout_match": len(matched) / max(1, len(priced)) if with_search else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-search", action="store_true", help="skip the layout search per row")
    args = p.parse_args()
    with open(RUNS) as f:
        rows = list(csv.DictReader(f))
    result = evaluate(rows, with_search=not args.no_search)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'run':24} {'metric':22} {'published':>10} {'predicted':>10} {'error':>7}  match")
    for e in result["rows"]:
        if e["skipped"]:
            print(f"{e['id']:24} {e['metric']:22} {e['published']:10.4g} {'':>10} {'':>7}  "
                  f"not priced: {e['skipped']}")  # fmt: skip
            continue
        match = {True: "yes", False: "no", None: ""}[e.get("match")]
        print(f"{e['id']:24} {e['metric']:22} {e['published']:10.4g} {e['predicted']:10.4g} "
              f"{e['error']:+7.1%}  {match}")  # fmt: skip
    print(f"{result['priced']} of {len(rows)} rows priced: mean absolute error "
          f"{result['mape']:.1%} (goal <= 15%)", end="")  # fmt: skip
    if result["layout_match"] is not None:
        print(f"; the planner's best is the published layout or within 5% of it in "
              f"{result['layout_match']:.0%} (goal >= 80%)")  # fmt: skip
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
