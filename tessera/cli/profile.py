"""`tessera profile RUN_DIR [--html OUT.html] [--png OUT.png] [--json OUT.json]`: what the profiled
steps of a run (`tessera train ... --profile A:B`) spent their time on, per rank and for the job,
beside the planner's prediction (tessera.profiling). The summary goes to stdout, the merged
Chrome/Perfetto trace of every rank to RUN_DIR/profile/trace.json. Given the directory of
`tessera serve --profile-dir DIR`, the engine's recorded steps and each request's life instead."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the run directory of a `tessera train ... --profile A:B` run, or the --profile-dir of "
                        "`tessera serve`")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="write the report as one HTML file (timeline per rank, waterfall; nothing fetched)")
    p.add_argument("--png", default=None, metavar="OUT.png", help="write the report's picture as a PNG")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="write the report as JSON: steps, ranks, terms (measured_s, planned_s), straggler")


def run(args: argparse.Namespace) -> int:
    from tessera.profiling.html_report import html_page
    from tessera.profiling.picture import scene
    from tessera.profiling.png import write_png
    from tessera.profiling.serving import analyse_serving, is_serving_profile, serving_scene, serving_summary
    from tessera.profiling.trace import chrome_trace
    from tessera.profiling.training import PROFILE_DIR, analyse, read_profile, summary

    run_dir = Path(args.run_dir)
    if is_serving_profile(run_dir):  # tessera serve --profile-dir DIR
        report = analyse_serving(run_dir)
        text = serving_summary(report)
        draw = lambda: serving_scene(report)  # noqa: E731
    else:
        profile = read_profile(run_dir)
        report = analyse(run_dir)
        text = summary(report)
        (run_dir / PROFILE_DIR / "trace.json").write_text(json.dumps(chrome_trace(profile)))
        draw = lambda: scene(report, profile)  # noqa: E731
    print(text)
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.html is not None or args.png is not None:
        picture = draw()
        if args.html is not None:
            Path(args.html).write_text(html_page(report, text, picture, f"tessera profile: {run_dir.name}"))
        if args.png is not None:
            write_png(picture, args.png)
    return 0
