"""A chaos soak: a job with checkpoint_dir, faulted at random and requeued until it finishes.

A supervisor runs a small training job the way a scheduler runs and requeues
one (SLURM's `--requeue`, a Kubernetes Job's restarts): P processes of 2 CPU
devices each, joined through `keras_dp.distributed.initialize`, fitting with a
`checkpoint_dir`. It injects faults at random: SIGTERM or SIGKILL to a random
process at a random moment (inside a compile, a step, validation, a save, a
restore, or the first step after a resume), a second SIGTERM during the save
the first one started, and requeues the job, now and then on 1 or 3 processes
instead of 2, until it finishes. Then it checks:

- the final weights equal an unbroken run's on 2 processes (bitwise where
  every run of the job had its topology, else within float32 summation order);
- every row was trained once in the last epoch, no completed epoch was
  trained twice (each run resumed at or after the newest checkpoint saved
  before it), and no run read a checkpoint that was not complete when it
  started;
- after a SIGTERM every process saved and exited 143; after a SIGKILL every
  other process exited 75 within the heartbeat timeout (and the watcher's
  poll) with keras_dp's one line naming the killed process; no process hung.

It prints each fault, what it cost (seconds from the signal until every
process had exited, seconds until the requeued job trained its first step,
and the steps trained again), and a summary.

    python scripts/soak.py --faults 20 --seed 0          # the soak
    python scripts/soak.py job --out DIR [...]           # one process of the job

`job` is what each process runs (tests/test_preemption.py runs it too).
"""

import argparse
import dataclasses
import os
import random
import signal
import sys
import time

ROWS, BATCH, EPOCHS = 470, 48, 4  # 10 steps an epoch, the last of 38 rows
DEVICES_PER_PROCESS = 2


# -- The job: one process of it ------------------------------------------------


def job_arguments(argv):
    parser = argparse.ArgumentParser(prog="soak.py job")
    parser.add_argument("--out", required=True, help="where process<i>.npz is written")
    parser.add_argument("--source", choices=["arrays", "grain"], default="arrays")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--validation", action="store_true")
    parser.add_argument("--x64", action="store_true", help="train in float64")
    parser.add_argument("--sigterm-after", help="EPOCH:STEP: the last process sends itself "
                                                "SIGTERM after that step (0-based epoch)")
    return parser.parse_args(argv)


def job(argv):
    """One process of the job: fit, print where it stands, write its results."""
    args = job_arguments(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sys.modules["tensorflow"] = None  # keras.utils.set_random_seed would import it: seconds
    import numpy as np

    from keras_dp import distributed

    if int(os.environ.get(distributed.NUM_PROCESSES_ENV, "1")) > 1:
        distributed.initialize()
    import jax
    import keras

    import keras_dp

    if args.x64:
        jax.config.update("jax_enable_x64", True)
        keras.config.set_floatx("float64")
    _instrument()
    dtype = "float64" if args.x64 else "float32"
    x = np.random.default_rng(0).normal(size=(args.rows, 8)).astype(dtype)
    y = np.arange(args.rows, dtype=dtype)[:, None]
    data = dict(x=x, y=y, batch_size=args.batch_size, shuffle=True)
    if args.source == "grain":
        data = dict(x=_elastic(x, y, args.batch_size))
    model = _model(args.rows)
    history = keras_dp.ShardedTrainer(model, steps_per_execution=1).fit(
        **data, epochs=args.epochs, verbose=0, checkpoint_dir=args.checkpoint_dir,
        validation_data=(x[:96], y[:96]) if args.validation else None,
        callbacks=[_markers(args.sigterm_after)])
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"process{jax.process_index()}.npz"),
             *[np.asarray(w) for w in model.get_weights()],
             ids=np.asarray(history.history["ids"][-1]) if history.epoch else np.zeros(0),
             epochs=np.asarray(history.epoch, np.int64))
    _say("done")


def _elastic(x, y, batch_size):
    """The rows as a Grain `ElasticIterator`: each process its share of every global batch."""
    import grain

    dataset = grain.MapDataset.source(range(len(x))).shuffle(seed=3).map(
        lambda i: (x[i], y[i]))
    return grain.experimental.ElasticIterator(dataset, batch_size,
                                              grain.sharding.ShardByJaxProcess())


def _model(rows):
    """A seeded two-layer regression onto row id / rows, with Adam and a histogram of row ids."""
    import keras

    class RowIds(keras.metrics.Metric):
        """How often each row id (the label) was trained on in the epoch."""

        def __init__(self, name="ids"):
            super().__init__(name=name)
            self.counts = self.add_variable((rows,), initializer="zeros", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            ids = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int32")
            self.counts.assign_add(keras.ops.sum(keras.ops.one_hot(ids, rows), axis=0))

        def result(self):
            return keras.ops.convert_to_tensor(self.counts)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=lambda t, p: keras.ops.mean(keras.ops.square(t / rows - p), axis=-1),
                  metrics=[RowIds()])
    return model


def _say(*words):
    print("PHASE", *words, flush=True)


def _instrument():
    """Print where a save and a restore start and end (the supervisor aims its signals at them)."""
    from keras_dp.checkpoint import integrity
    from keras_dp.checkpoint import store

    save, newest = store.Checkpoints.save, integrity.newest_intact

    def saving(self, state, position, seed):
        _say("save", position.epoch, position.steps)
        save(self, state, position, seed)
        _say("saved", self._manager.latest_step(), position.epoch, position.steps)

    def restoring(manager, template, restore_args):
        if manager.all_steps():
            _say("restore")
        tree, index = newest(manager, template, restore_args)
        if tree is not None:
            _say("restored", index, int(tree["position"]["epoch"]),
                 int(tree["position"]["steps"]))
        return tree, index

    store.Checkpoints.save, integrity.newest_intact = saving, restoring


def _markers(sigterm_after=None):
    """A callback that prints each step and validation, and sends SIGTERM at `sigterm_after`.

    `sigterm_after` ("EPOCH:STEP"): the last process sends it to itself
    after that step, then slows its steps so that JAX's notice of it
    arrives before the epoch ends.
    """
    import jax
    import keras

    class Markers(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch, self.calls, self.sent = 0, 0, False
            self.at = tuple(map(int, sigterm_after.split(":"))) if sigterm_after else None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.calls == 0:  # the first call of this run compiles
                _say("resumed-step" if (self.epoch, batch) != (0, 0) else "compile",
                     self.epoch, batch)
            self.calls += 1
            _say("step", self.epoch, batch)

        def on_train_batch_end(self, batch, logs=None):
            if self.sent:
                time.sleep(0.5)
            elif (self.at is not None and (self.epoch, batch + 1) >= self.at
                  and jax.process_index() == jax.process_count() - 1):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

        def on_test_begin(self, logs=None):
            _say("validation")

    return Markers()


# -- The supervisor ----------------------------------------------------------

# Where a fault lands: the victim's marker (`_say`) after which the signal goes.
FRESH_PHASES = ("compile", "step", "validation", "save")
RESUMED_PHASES = ("restore", "resumed-step", "step", "validation", "save")
KINDS = ("SIGTERM", "SIGKILL", "SIGTERM2")  # SIGTERM2: a second SIGTERM during the first's save
LOST_STATUS, SIGTERM_STATUS = 75, 143


class Run:
    """One launch of the job: P processes, their lines as they come (with times), their ends."""

    def __init__(self, processes, directory, checkpoint_dir=None, heartbeat=5,
                 job_args=("--validation",), devices=DEVICES_PER_PROCESS):
        import socket
        import subprocess
        import threading

        self.processes, self.directory = processes, directory
        os.makedirs(directory, exist_ok=True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, os.path.abspath(__file__), "job", "--out", directory,
                   *(["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []), *job_args]
        self.lines = [[] for _ in range(processes)]  # (time, line)
        self.started = time.monotonic()
        self.children = []
        for index in range(processes):
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                       KERAS_DP_HEARTBEAT_TIMEOUT=str(heartbeat),
                       KERAS_DP_RESUME_COMMAND="python scripts/soak.py job ... (the supervisor "
                                               "requeues it)")
            if processes > 1:
                env.update(KERAS_DP_COORDINATOR=f"127.0.0.1:{port}",
                           KERAS_DP_NUM_PROCESSES=str(processes),
                           KERAS_DP_PROCESS_ID=str(index))
            child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
            self.children.append(child)
            threading.Thread(target=self._read, args=(index, child), daemon=True).start()
        self.ended = [None] * processes  # (time, status)

    def _read(self, index, child):
        with open(os.path.join(self.directory, f"process{index}.log"), "w") as log:
            for line in child.stdout:
                self.lines[index].append((time.monotonic(), line.rstrip("\n")))
                log.write(line)

    def poll(self):
        """Whether every process has ended (their times and statuses are in `ended`)."""
        for index, child in enumerate(self.children):
            if self.ended[index] is None and child.poll() is not None:
                self.ended[index] = (time.monotonic(), child.returncode)
        return all(end is not None for end in self.ended)

    def markers(self, index, since=0):
        """Process `index`'s markers from its line `since` on: `(line number, time, words)`."""
        return [(number, at, line.split()[1:]) for number, (at, line)
                in enumerate(self.lines[index][since:], since) if line.startswith("PHASE ")]

    def wait(self, seconds):
        """Wait until every process ended or `seconds` passed; kill what is left. Whether all ended."""
        deadline = time.monotonic() + seconds
        while not self.poll():
            if time.monotonic() > deadline:
                self.kill()
                return False
            time.sleep(0.05)
        return True

    def kill(self):
        """End every process of the run and whatever it started (the coordination service)."""
        for child in self.children:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in self.children:
            child.wait()
        self.poll()

    def text(self, index):
        return "\n".join(line for _, line in self.lines[index])


@dataclasses.dataclass
class Fault:
    """One fault: what, to whom, where; then what it cost and whether the job survived it."""

    kind: str  # one of KINDS
    victim: int
    phase: str
    processes: int  # of the run it hit
    next_processes: int  # of the run that requeues the job
    landed: str = ""  # where it landed: "step 2 5", "save 1 0", ...
    exit_s: float = None  # from the signal until every process had ended
    restart_s: float = None  # from the requeue until its first step
    retrained: int = None  # steps trained again after the requeue
    verdict: str = ""  # "survived", or what went wrong
    sent: float = None  # when the signal went (monotonic)
    before: int = None  # global steps done when it went
    spec: str = ""  # as a fixed plan gave it

    def words(self):
        cost = (f"all ended {self.exit_s:.1f} s after it" if self.exit_s is not None else "")
        requeued = (f"; requeued on {self.next_processes} process"
                    f"{'es' if self.next_processes > 1 else ''}")
        if self.restart_s is not None:
            cost += (f"{requeued}, first step after {self.restart_s:.1f} s, "
                     f"{self.retrained} steps trained again")
        elif self.retrained is not None:
            cost += f"{requeued}, faulted again before its first step"
        return (f"{self.kind} to process {self.victim} of {self.processes} in {self.phase} "
                f"({self.landed}): {self.verdict}; {cost}")


def plan_fault(rng, resumed, processes, fixed=None):
    """A random fault for a run (or the next of `fixed`, "KIND:VICTIM:PHASE:NEXT" each)."""
    if fixed:
        spec = fixed.pop(0)
        kind, victim, phase, following = spec.split(":")
        return Fault(kind, int(victim) % processes, phase, processes, int(following), spec=spec)
    phases = RESUMED_PHASES if resumed else FRESH_PHASES
    following = rng.choice((1, 3)) if rng.random() < 0.3 else 2
    return Fault(rng.choice(KINDS), rng.randrange(processes), rng.choice(phases), processes,
                 following)


def inject(run, fault, rng):
    """Send `fault`'s signal at its phase; False if the run ended before the phase came."""
    trigger = {"step": rng.randint(1, 12), "save": rng.randint(1, 2)}.get(fault.phase, 1)
    # The first call of a run compiles: "compile" in a fresh run, "resumed-step" else.
    wanted = {"resumed-step": ("resumed-step", "compile")}.get(fault.phase, (fault.phase,))
    seen, since = 0, 0
    while True:
        for number, at, words in run.markers(fault.victim, since):
            since = number + 1
            if words and words[0] in wanted:
                seen += 1
                if seen >= trigger:
                    fault.landed = " ".join(words)
                    return _send(run, fault, rng)
        if run.poll():
            return False
        time.sleep(0.005)


def _send(run, fault, rng):
    signum = signal.SIGKILL if fault.kind == "SIGKILL" else signal.SIGTERM
    fault.sent = time.monotonic()
    fault.before = _steps_done(run)
    if fault.before is None:  # no step yet in this run: what it restored, if anything
        got = restored(run)
        fault.before = got[1] * STEPS + got[2] if got else 0
    run.children[fault.victim].send_signal(signum)
    if fault.kind == "SIGTERM2":  # again, to any process, once the save it asked for starts
        while not run.poll():
            saving = [index for index in range(run.processes)
                      if any(at > fault.sent and words[:1] == ["save"]
                             for _, at, words in run.markers(index))]
            if saving:
                second = rng.randrange(run.processes)
                if run.children[second].poll() is None:
                    run.children[second].send_signal(signal.SIGTERM)
                fault.landed += f"; again to process {second} in the save"
                break
            time.sleep(0.005)
    return True


def _steps_done(run):
    """Global steps process 0 had finished: the step it began last, less one."""
    steps = [words for _, _, words in run.markers(0) if words[:1] == ["step"]]
    if not steps:
        return None
    epoch, batch = map(int, steps[-1][1:3])
    return epoch * STEPS + batch


STEPS = -(-ROWS // BATCH)


def judge(run, fault, heartbeat):
    """Whether every process ended as `fault` should make it: the verdict, in words."""
    ends = [end for end in run.ended]
    statuses = [status for _, status in ends]
    fault.exit_s = max(at for at, _ in ends) - fault.sent
    for index in range(run.processes):
        for noise in ("Check failure stack trace", "Traceback (most recent call last)"):
            if noise in run.text(index):
                return f"FAILED: process {index} printed a {noise.split(' (')[0].lower()}"
    if all(status == 0 for status in statuses):
        return "survived (the job finished before the signal took effect)"
    if fault.kind == "SIGKILL":
        others = [index for index in range(run.processes) if index != fault.victim]
        line = f"keras_dp: process {fault.victim} stopped answering"
        for index in others:
            if statuses[index] != LOST_STATUS or line not in run.text(index):
                return f"FAILED: process {index} ended with {statuses[index]}, not 75 and the line"
            late = ends[index][0] - fault.sent
            if late > heartbeat + 2:
                return f"FAILED: process {index} ended {late:.1f} s after the kill"
        return "survived"
    for index, status in enumerate(statuses):
        if status == SIGTERM_STATUS and "SIGTERM received; saved a checkpoint" in run.text(index):
            continue
        if run.processes == 1 and status == -signal.SIGTERM:
            continue  # before fit watched for SIGTERM: its default action, nothing to save
        return f"FAILED: process {index} ended with {status} after SIGTERM"
    return "survived"


def newest_complete(directory):
    """The newest checkpoint orbax committed in `directory` (named by digits), or None."""
    try:
        return max((int(name) for name in os.listdir(directory) if name.isdigit()), default=None)
    except FileNotFoundError:
        return None


def restored(run):
    """`(index, epoch, steps)` process 0 restored, or None."""
    for _, _, words in run.markers(0):
        if words[:1] == ["restored"]:
            return tuple(map(int, words[1:4]))
    return None


def first_step(run):
    """When process 0 began its first step (monotonic), or None."""
    return next((at for _, at, words in run.markers(0) if words[:1] == ["step"]), None)


def weights_of(directory, processes):
    """Process 0's weights, and whether every process ended with the same ones."""
    import numpy as np

    results = [np.load(os.path.join(directory, f"process{index}.npz"))
               for index in range(processes)]
    arrays = [[result[name] for name in result.files if name.startswith("arr_")]
              for result in results]
    same = all(all((a == b).all() for a, b in zip(mine, arrays[0])) for mine in arrays[1:])
    return arrays[0], same, results[0]["ids"]


def check_round(runs, reference, heartbeat):
    """The checks of a finished job (`runs`: `(Run, newest checkpoint at its launch)`): failures."""
    import numpy as np

    failures = []
    last, _ = runs[-1]
    weights, same, ids = weights_of(last.directory, last.processes)
    if not same:
        failures.append("the processes ended with different weights")
    if not (ids == 1).all():
        failures.append(f"the last epoch trained rows {int((ids != 1).sum())} times other than once")
    for run, newest in runs:
        got = restored(run)
        trained = any(words[:1] == ["step"] for _, _, words in run.markers(0))
        if (got[0] if got else None) != newest and (got or trained):
            failures.append(f"a run restored {got} where the newest complete checkpoint was "
                            f"{newest}: a partial or older one, epochs trained twice")
        resumed = [words for _, _, words in run.markers(0) if words[:1] == ["resumed-step"]]
        if got and resumed and tuple(map(int, resumed[0][1:3])) != got[1:]:
            failures.append(f"a run restored {got[1:]} and trained from {resumed[0][1:3]}")
    topologies = {run.processes for run, _ in runs if any(
        words[:1] == ["step"] for _, _, words in run.markers(0))}
    bitwise = topologies == {2}
    for mine, theirs in zip(weights, reference, strict=True):
        if bitwise and not (mine == theirs).all():
            failures.append("the weights differ from the unbroken run's (same topology: bitwise)")
            break
        scale = max(float(np.abs(theirs).max()), 1e-6)
        if float(np.abs(mine - theirs).max()) > 1e-5 * scale:
            failures.append(f"the weights differ from the unbroken run's by "
                            f"{float(np.abs(mine - theirs).max()) / scale:.2e} of their scale")
            break
    kind = "bitwise" if bitwise else f"within 1e-5 of scale (topologies {sorted(topologies)})"
    return failures, kind


def soak(faults, seed, heartbeat, work, fixed=None, say=print):
    """Run the soak (see the module doc); returns `(faults, failures)`."""
    rng = random.Random(seed)
    fixed = list(fixed or [])
    say(f"soak: {faults} faults, seed {seed}, heartbeat {heartbeat} s, in {work}")
    start = time.monotonic()
    unbroken = Run(2, os.path.join(work, "unbroken"), os.path.join(work, "unbroken", "ckpt"),
                   heartbeat)
    if not unbroken.wait(600) or any(status for _, status in unbroken.ended):
        return [], [f"the unbroken run failed: {unbroken.ended}"]
    reference, _, _ = weights_of(unbroken.directory, 2)
    say(f"unbroken run: {unbroken.ended[0][0] - unbroken.started:.1f} s")
    done, failures, rounds = [], [], 0
    while len(done) < faults and not failures:
        rounds += 1
        failures += job_round(rng, fixed, faults, done, heartbeat, reference,
                              os.path.join(work, f"job{rounds}"), say)
    survived = sum(fault.verdict.startswith("survived") for fault in done)
    say(f"soak: {len(done)} faults injected, {survived} survived, {rounds} job(s) finished, "
        f"{time.monotonic() - start:.0f} s in all")
    for line in summary(done):
        say(line)
    return done, failures


def summary(done):
    """What the faults cost, by kind: lines of text."""
    lines = []
    for kind in KINDS:
        faults = [fault for fault in done if fault.kind == kind]
        if not faults:
            continue
        ends = [fault.exit_s for fault in faults if fault.exit_s is not None]
        starts = [fault.restart_s for fault in faults if fault.restart_s is not None]
        again = [fault.retrained for fault in faults if fault.retrained is not None]
        phases = sorted({fault.phase for fault in faults})
        lines.append(
            f"  {kind}: {len(faults)} ({', '.join(phases)}); every process ended "
            f"{min(ends):.1f} to {max(ends):.1f} s after the signal; the requeue's first "
            f"step after {min(starts, default=0):.1f} to {max(starts, default=0):.1f} s; "
            f"{sum(again)} steps trained again in all ({max(again, default=0)} at most)")
    moved = sum(fault.next_processes != fault.processes for fault in done)
    lines.append(f"  requeued on another number of processes: {moved} times")
    return lines


def job_round(rng, fixed, faults, done, heartbeat, reference, work, say):
    """Run one job from scratch to its end, faulting it while faults remain: its failures."""
    checkpoints = os.path.join(work, "ckpt")
    runs, processes, previous = [], 2, None
    while True:
        newest = newest_complete(checkpoints)
        run = Run(processes, os.path.join(work, f"run{len(runs)}"), checkpoints, heartbeat)
        runs.append((run, newest))
        fault = None
        if len(done) < faults:
            fault = plan_fault(rng, newest is not None, processes, fixed)
            if not inject(run, fault, rng):  # the run ended before the phase came
                if fixed is not None and fault.spec:
                    fixed.insert(0, fault.spec)  # for the next run
                fault = None
        ended = run.wait(600 if fault is None else heartbeat + 120)
        if previous is not None:  # the fault that ended the run before: its requeue's cost
            _requeue_cost(previous, run)
            say(f"fault {len(done)}: {previous.words()}")
            previous = None
        if not ended:
            return [f"a run hung: {[end for end in run.ended]}"]
        statuses = [status for _, status in run.ended]
        if fault is None:
            if all(status == 0 for status in statuses):
                failures, kind = check_round(runs, reference, heartbeat)
                say(f"job finished after {len(runs)} runs: weights equal the unbroken "
                    f"run's {kind}" if not failures else f"job checks FAILED: {failures}")
                return failures
            return [f"a run without a fault ended with {statuses}: "
                    f"{run.text(0)[-2000:]}"]
        fault.verdict = judge(run, fault, heartbeat)
        done.append(fault)
        if not fault.verdict.startswith("survived"):
            say(f"fault {len(done)}: {fault.words()}")
            return [fault.verdict]
        if all(status == 0 for status in statuses):  # finished regardless
            say(f"fault {len(done)}: {fault.words()}")
            failures, kind = check_round(runs, reference, heartbeat)
            return failures
        previous, processes = fault, fault.next_processes


def _requeue_cost(fault, run):
    """What the run that requeued the job after `fault` took: to its first step, steps again."""
    began = first_step(run)
    fault.restart_s = None if began is None else began - run.started
    got = restored(run)
    if fault.before is not None:
        fault.retrained = max(0, fault.before - (got[1] * STEPS + got[2] if got else 0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat", type=int, default=5,
                        help="KERAS_DP_HEARTBEAT_TIMEOUT of the job's processes (s)")
    parser.add_argument("--plan", help="fixed faults, KIND:VICTIM:PHASE:NEXT_PROCESSES,...")
    parser.add_argument("--workdir", help="default: a new temporary directory")
    args = parser.parse_args(argv)
    import tempfile

    work = args.workdir or tempfile.mkdtemp(prefix="keras_dp_soak_")
    fixed = args.plan.split(",") if args.plan else None
    faults = len(fixed) if fixed else args.faults
    done, failures = soak(faults, args.seed, args.heartbeat, work, fixed)
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures or len(done) < faults else 0


if __name__ == "__main__" and sys.argv[1:2] == ["job"]:
    job(sys.argv[2:])
elif __name__ == "__main__":
    sys.exit(main())
