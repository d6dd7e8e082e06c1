"""keras_dp's training throughput in two checkouts, alternated in one run on one machine.

Runs `benchmarks/bench.py` (the keras_dp system only) in each checkout in
turn, `--rounds` times, alternating which goes first, so that drift of the
machine affects both alike, and prints per batch size and steps per call
the median samples/s of each and their ratio (new / old):

    git worktree add /tmp/old <commit>
    python benchmarks/compare_trees.py --old /tmp/old --new . --devices 2

Each run reads full MNIST from ../shared/data beside the checkout it runs
in, or `--data`.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile


def run(tree, args, out):
    """One bench.py run of the keras_dp system in `tree`; its rows."""
    command = [sys.executable, "benchmarks/bench.py", "--devices", str(args.devices),
               "--systems", "keras_dp", "--batch-sizes", args.batch_sizes, "--ks", args.ks,
               "--reps", str(args.reps), "--samples", str(args.samples), "--out", out]
    if args.data:
        command += ["--data", args.data]
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(pathlib.Path(out).read_text())["rows"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the checkout to compare against")
    parser.add_argument("--new", default=".", help="the checkout measured (default: here)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=3200)
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default=None, help="write the raw rows here (JSON)")
    args = parser.parse_args(argv)
    trees = {"old": pathlib.Path(args.old).resolve(), "new": pathlib.Path(args.new).resolve()}
    rates = {}  # (tree, batch, k) -> samples/s, one per round
    raw = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for name in order:
                rows = run(trees[name], args, os.path.join(scratch, f"{name}.json"))
                raw.append({"round": round_, "tree": name, "rows": rows})
                for row in rows:
                    rates.setdefault((name, row["batch"], row["k"]), []).append(row["median"])
    print(f"| batch | K | old samples/s | new samples/s | new / old |  ({args.rounds} rounds, "
          f"{args.devices} devices)")
    print("|---|---|---|---|---|")
    for (name, batch, k), values in sorted(rates.items()):
        if name != "new":
            continue
        old, new = statistics.median(rates[("old", batch, k)]), statistics.median(values)
        print(f"| {batch} | {k} | {old:,.0f} | {new:,.0f} | {new / old:.3f} |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"argv": sys.argv, "trees": {k: str(v) for k, v in trees.items()}, "runs": raw},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
