"""Read `bench.py` JSON files against issue 19's CPU throughput targets.

    python benchmarks/targets.py benchmarks/results-2dev-scan-run*.json

For each batch size, every ratio is taken within one run (the systems of a
run alternate, so load drifts hit them alike), then the median over runs is
reported with its range. A system's "best" is its fastest K in that run.
The targets (issue 19, "Speed beyond the next Keras", CPU):

- keras_dp with resident data at least as fast as keras_dp's host path and
  Keras's `model.fit`, and at least 0.95 of the compute bound;
- keras_dp at least 1.2x the emulated K-step scan of Keras's merged PR at
  batch 64.

Prints the per-(system, batch, K) medians over runs, then the ratios, each
with its verdict, as markdown.
"""

import argparse
import json
import statistics

KERAS_DP = "keras_dp"
SCAN = "keras merged scan (emulated)"
# (what the ratio reads, the peer, the peer's least K, the least keras_dp / peer
# that meets it, the batch sizes the target is for or None for all)
TARGETS = (
    ("keras_dp best / host-fed best", "keras_dp host-fed", 1, 1.0, None),
    ("keras_dp best / Keras fit best", "keras DataParallel", 1, 1.0, None),
    ("keras_dp best / compute bound", "compute bound", 1, 0.95, None),
    # The scan system at K = 1 is Keras's single jitted step (the PR scans
    # only for K > 1): the first line lets Keras pick its best K, the second
    # compares with the scan proper.
    ("keras_dp best / Keras merged scan best", SCAN, 1, 1.2, {64}),
    ("keras_dp best / Keras merged scan best K>1", SCAN, 2, 1.2, {64}),
)


def best(rows, system, batch, min_k=1):
    """The fastest median samples/s of `system` at `batch` over its Ks >= `min_k`, or None."""
    rates = [row["median"] for row in rows
             if row["system"] == system and row["batch"] == batch and row["k"] >= min_k]
    return max(rates, default=None)


def ratios(reports):
    """`{(label, batch): [keras_dp best / peer best, one per run that has both]}`."""
    found = {}
    for report in reports:
        rows = report["rows"]
        for batch in sorted({row["batch"] for row in rows}):
            ours = best(rows, KERAS_DP, batch)
            for label, peer, min_k, _, _ in TARGETS:
                theirs = best(rows, peer, batch, min_k)
                if ours and theirs:
                    found.setdefault((label, batch), []).append(ours / theirs)
    return found


def median_table(reports):
    """Markdown: per (system, batch, K) the median over runs of each run's median."""
    rates = {}
    for report in reports:
        for row in sorted(report["rows"], key=lambda row: row["batch"]):
            rates.setdefault((row["system"], row["batch"], row["k"]), []).append(row["median"])
    lines = ["| system | batch | K | median samples/s over runs | runs' medians |",
             "|---|---:|---:|---:|---|"]
    for (system, batch, k), values in rates.items():
        lines.append(f"| {system} | {batch} | {k} | {statistics.median(values):.0f} | "
                     f"{', '.join(f'{value:.0f}' for value in values)} |")
    return "\n".join(lines)


def verdict_table(reports):
    """Markdown: each target's ratio (median over runs, range) and whether it is met."""
    found = ratios(reports)
    lines = ["| target | batch | median ratio | range | runs | needed | median meets it |",
             "|---|---:|---:|---|---:|---:|---|"]
    for label, _, _, needed, batches in TARGETS:
        for (name, batch), values in sorted(found.items(), key=lambda item: item[0][1]):
            if name != label or (batches and batch not in batches):
                continue
            middle = statistics.median(values)
            lines.append(f"| {label} | {batch} | {middle:.2f} | {min(values):.2f}-"
                         f"{max(values):.2f} | {len(values)} | {needed:.2f} | "
                         f"{'yes' if middle >= needed else 'no'} |")
    return "\n".join(lines)


def main(paths):
    reports = [json.loads(open(path).read()) for path in paths]
    print(median_table(reports))
    print()
    print(verdict_table(reports))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Issue 19's CPU throughput targets over bench.py's JSON files: each "
                    "ratio within a run, then the median over runs.")
    parser.add_argument("results", nargs="+", metavar="RESULTS.json",
                        help="bench.py output files, one per run")
    main(parser.parse_args().results)
