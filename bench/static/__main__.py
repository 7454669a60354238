from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench.common.results import write_json
from bench.static import report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.static", description=__doc__)
    ap.add_argument("--arch", type=int, nargs="+", default=list(report.ARCHES), help="90 (sm_90), 100 (sm_100)")
    ap.add_argument("--json", type=pathlib.Path, help="write this Triton's report here")
    ap.add_argument("--page", nargs="+", help="only these page classes (bench/static/variants.py PAGES)")
    ap.add_argument("--merge", type=pathlib.Path, nargs="+", metavar="PART", help="merge Tritons' reports instead")
    ap.add_argument("--quiet", action="store_true", help="no table")
    ap.add_argument("--fp8", action="store_true", help="the FP8 host format's kernel beside the copy kernel (sm_90)")
    ap.add_argument("--compare", type=pathlib.Path, nargs="+", metavar="RESULTS",
                    help="the model against these transfer-benchmark JSONs (with --static REPORT)")  # fmt: skip
    ap.add_argument("--static", type=pathlib.Path, help="a bench.static report (for --compare, --defaults)")
    ap.add_argument("--defaults", action="store_true",
                    help="the model's fraction of the peak at 4 programs, per workload (with --static)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.fp8:
        from bench.static.fp8 import fp8_report

        rows = fp8_report(args.arch[0])
        if args.json:
            write_json(args.json, {"benchmark": "static-fp8", "rows": rows})
        return 0
    if args.compare:
        return _compare(args)
    if args.defaults:
        return _defaults(args)
    if args.merge:
        doc = report.merge([json.loads(p.read_text()) for p in args.merge])
    else:
        only = (lambda v: v.page in args.page) if args.page else None
        doc = report.report(args.arch, only, progress=lambda r: print(f"  {r['arch']} {r['variant']}", file=sys.stderr))
    if args.json:
        write_json(args.json, doc)
    if not args.quiet:
        report.table(doc)
    return 0


def _defaults(args) -> int:
    from bench.static.compare import at_defaults, static_rows

    if args.static is None:
        raise SystemExit("--defaults needs --static REPORT")
    rows = at_defaults(static_rows(json.loads(args.static.read_text()), "sm_90", "3.6.0"))
    print(f"{'workload':<16} {'layout':<12} {'dir':<6} {'blocks':>6} {'at 4':>5} {'bound':<12} programs for 0.95")
    for r in rows:
        print(f"{r['workload']:<16} {r['layout']:<12} {r['direction']:<6} {r['blocks']:>6} {r['at_4']:>5.2f} "
              f"{r['bound_at_4']:<12} {r['programs_for_0.95']}")  # fmt: skip
    if args.json:
        write_json(args.json, {"static": str(args.static), "rows": rows})
    return 0


def _compare(args) -> int:
    from bench.static.compare import describe, predictions, static_rows

    if args.static is None:
        raise SystemExit("--compare needs --static REPORT")
    doc = json.loads(args.static.read_text())
    results = [json.loads(p.read_text()) for p in args.compare]
    triton = next((r.get("triton") for r in results if r.get("triton")), None)
    static = static_rows(doc, "sm_90", triton)
    preds = [p for r in results for p in predictions(r["rows"], static)]
    out = {"static": str(args.static), "results": [str(p) for p in args.compare], "triton": triton,
           "summary": describe(preds), "cases": preds}  # fmt: skip
    if args.json:
        write_json(args.json, out)
    if not args.quiet:
        print(f"{'case':<58} {'ctas':>4} {'measured':>8} {'predicted':>9} {'error':>6}  bound")
        for p in preds:
            case = f"{p['workload']}/{p['layout']} n={p['blocks']} f={p['f']} {p['direction']}"
            print(f"{case:<58} {p['num_ctas'] or '-':>4} {p['measured']:>8.2f} {p['predicted']:>9.2f} "
                  f"{p['error']:>+6.2f}  {p['bound']}")  # fmt: skip
        print(json.dumps(out["summary"]["all"]), "by workload:", json.dumps(out["summary"]["by_workload"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
