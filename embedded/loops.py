"""The training loops: the main stage (``Trainer``) and the polish stage after it (``Polisher``), each over the
curriculum's deterministic batches, with checkpoints and a clean stop on SIGTERM/SIGINT (finish the step,
checkpoint, exit; the same command resumes).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import checkpoints
from .curriculum import CURRICULUM_ID, batch_plan, cooled_lr, cosine_lr, make_batch
from .losses import optimizer_step
from .recipe import POLISH_FIELDS, Recipe
from .sink import HeldSink, sink_logit_at


@dataclass(frozen=True)
class RunOptions:
    """How a run executes, as opposed to what it computes (the recipe)."""

    run_dir: Path
    out: Path
    device: str = "cpu"
    minutes: float | None = None  # stop (and save) after this many minutes of this process: smoke runs
    stop_after: int | None = None  # checkpoint and stop after this many steps of this process (all stages)
    ckpt_minutes: float = 4.0
    fresh: bool = False  # ignore existing checkpoints in run_dir
    init_from: str | None = None  # start from a saved model directory's weights
    same_as: str | None = None  # a model directory whose weights the run should reproduce
    export: str | None = None  # save run_dir's checkpoint as a model directory here, and stop


class Meter:
    """Running loss, token accuracy and scenes/s between two log lines."""

    def __init__(self):
        self.loss, self.correct, self.count, self.scenes, self.n = 0.0, 0, 0, 0, 0
        self.masses: list[float] = []
        self.shares: list[tuple[float, float]] = []  # (target, share) per sample the share loss saw
        self.t0 = time.time()

    def add(self, loss, logits, tgt, n_scenes: int, mass=None, shares=None, targets=None) -> None:
        mask = tgt != -100
        self.correct += int(((logits.argmax(-1) == tgt) & mask).sum())
        self.count += int(mask.sum())
        self.loss += float(loss)
        self.n += 1
        self.scenes += n_scenes
        if mass is not None:
            self.masses.append(float(mass))
        if shares is not None:
            self.shares += list(zip(targets.tolist(), shares.tolist()))

    def line(self) -> str:
        rate = self.scenes / max(time.time() - self.t0, 1e-9)
        cell = f" cell {sum(self.masses) / len(self.masses):.3f}" if self.masses else ""  # the grounding target
        return (f"loss {self.loss / max(1, self.n):.4f} tok_acc {self.correct / max(1, self.count):.4f}{cell}"
                f"{self.share_line()} scenes/s {rate:.1f}")

    def share_line(self) -> str:
        """' share low / high third a / b (target c / d)': the image share the share loss saw in the samples with
        the lowest and the highest third of targets, and their mean targets."""
        if len(self.shares) < 3:
            return ""
        pairs = sorted(self.shares)
        k = len(pairs) // 3
        lo, hi = pairs[:k], pairs[-k:]
        mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
        return (f" share low / high third {mean(lo, 1):.3f} / {mean(hi, 1):.3f} "
                f"(target {mean(lo, 0):.3f} / {mean(hi, 0):.3f})")


class Trainer:
    """The main stage: ``recipe.steps`` steps of the curriculum at a warm-up + cosine rate, with the grounding
    loss on ``recipe.ground_tasks``."""

    name = ""  # the log lines' prefix

    def __init__(self, recipe: Recipe, opts: RunOptions, model, opt, builder, ckpt_path: Path, step: int,
                 elapsed_before: float, sink: HeldSink | None = None):
        self.r, self.opts, self.model, self.opt, self.builder, self.sink = recipe, opts, model, opt, builder, sink
        self.ckpt_path, self.step, self.elapsed_before = ckpt_path, step, elapsed_before
        self.start_step, self.t_start = step, time.time()
        self.total = recipe.steps
        self.device = next(model.parameters()).device
        self.auto_threads = recipe.threads == "auto" and opts.device == "cpu"
        self.stop_signal = None
        self.last_lr = float("nan")  # the rate of the last step taken (train_step), for log()

    # --- what differs between the stages
    def lr(self) -> float:
        return cosine_lr(self.r.lr, self.r.warmup, self.r.steps, self.step)

    def sink_logit(self) -> float:
        return sink_logit_at(self.r.sink_logit, self.r.sink_ramp, self.step / max(1, self.r.steps))

    def ground_spread(self) -> bool:
        """Whether the grounding loss asks for the cell's mass spread evenly over it at this step."""
        return False

    def batch(self) -> dict:
        r = self.r
        return make_batch(self.builder, r.seed, self.step, r.steps, r.batch_scale, r.layout,
                          ground=r.ground_tasks if r.ground_loss else ())[1]

    def share(self):
        """The share loss this stage adds (``losses.Share``), or None."""
        return None

    # --- mechanics
    def checkpoint(self) -> None:
        checkpoints.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                          "elapsed": self.elapsed_before + time.time() - self.t_start, "recipe": self.r.to_dict(),
                          "curriculum": CURRICULUM_ID}, self.ckpt_path)

    def adapt_threads(self) -> None:
        """threads 'auto' on CPU: all cores while the machine is otherwise idle, 1 thread while other processes load
        it (a 2-thread step waits on its slowest thread)."""
        import torch

        if self.auto_threads and hasattr(os, "getloadavg"):
            busy = os.getloadavg()[0] - torch.get_num_threads()  # load from other processes
            torch.set_num_threads((os.cpu_count() or 1) if busy < 0.5 else 1)

    def train_step(self, meter: Meter) -> None:
        import torch

        r = self.r
        batch = {k: v.to(self.device) for k, v in self.batch().items()}
        n = batch["input_ids"].shape[0]
        if self.sink is not None:
            self.sink.set_logit(self.sink_logit())
        self.last_lr = self.lr()  # the rate this step trains at, which log() reports
        targets = batch.get("share_target")
        loss, logits, tgt, mass, shares = optimizer_step(self.model, self.opt, batch, self.last_lr, r.ground_loss,
                                                         r.ground_layer, ground_spread=self.ground_spread(),
                                                         share=self.share())
        if self.sink is not None:
            self.sink.restore()  # undo weight decay on the held entries (their gradients are already zero)
        self.step += 1
        with torch.no_grad():
            meter.add(loss, logits, tgt, n, mass, shares, targets)

    def log(self, meter: Meter) -> None:
        import torch

        done = time.time() - self.t_start
        per_step = done / max(1, self.step - self.start_step)
        print(f"{self.name}step {self.step}/{self.total} {meter.line()} lr {self.last_lr:.2e} "
              f"thr {torch.get_num_threads()} elapsed {(self.elapsed_before + done) / 60:.1f} min "
              f"ETA {per_step * (self.total - self.step) / 60:.1f} min", flush=True)

    def should_stop(self, stop_after: int | None) -> str | None:
        """Why the loop stops before this step, or None. A signal or ``stop_after`` checkpoints first."""
        if self.stop_signal is not None:
            self.checkpoint()
            return f"signal {self.stop_signal}: checkpointed at step {self.step}; run the same command to resume"
        if stop_after is not None and self.step - self.start_step >= stop_after:
            self.checkpoint()
            return f"--stop-after: checkpointed at step {self.step}"
        if self.opts.minutes is not None and time.time() - self.t_start > self.opts.minutes * 60:
            return f"--minutes {self.opts.minutes} reached at step {self.step}"
        return None

    def run(self, stop_after: int | None = None) -> bool:
        """Train to ``total`` steps (True) or stop early: False for a signal or ``stop_after`` (no final save),
        True for --minutes (the model is saved as it is)."""
        import signal

        def on_signal(signum, frame):
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.model.train()
        meter, last_ckpt = Meter(), time.time()
        while self.step < self.total:
            why = self.should_stop(stop_after)
            if why:
                print(why, flush=True)
                if why.startswith("--minutes"):
                    break
                return False
            self.train_step(meter)
            if self.step % 25 == 0:
                self.adapt_threads()
            if self.step % 25 == 0 or self.step == self.total:
                self.log(meter)
                meter = Meter()
            if time.time() - last_ckpt > self.opts.ckpt_minutes * 60:
                self.checkpoint()
                last_ckpt = time.time()
        self.checkpoint()
        return True

    @property
    def steps_taken(self) -> int:
        return self.step - self.start_step

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start


class Polisher(Trainer):
    """The polish stage: after the main stage, ``polish_steps`` more steps of the curriculum's last phase, at
    ``polish_lr`` (cooled down to 0 over its last ``polish_cooldown``), with the grounding loss on the
    ``polish_ground_tasks``, spread evenly over the cell on the ``polish_ground_spread`` tasks. Its batches are those
    of the main stage's last ``polish_steps`` plan steps drawn with ``polish_seed`` (fresh scenes), with the last
    phase's task mix or ``polish_mix``'s. It starts from the finished main stage (model and optimizer) and
    checkpoints to ``ckpt_path`` (polish.pt), from which it resumes."""

    name = "polish "
    fields = POLISH_FIELDS  # the recipe fields a checkpoint of this stage must agree on to resume it

    def __init__(self, recipe: Recipe, opts: RunOptions, model, opt, builder, ckpt_path: Path, elapsed_before: float,
                 sink: HeldSink | None = None):
        step = 0
        if ckpt_path.exists() and not opts.fresh:
            step, elapsed_before = load_into(ckpt_path, model, opt, recipe, self.fields)
        super().__init__(recipe, opts, model, opt, builder, ckpt_path, step, elapsed_before, sink)
        self.total = self.stage_steps()

    def stage_steps(self) -> int:
        return self.r.polish_steps

    def lr(self) -> float:
        return cooled_lr(self.r.polish_lr, self.r.polish_cooldown, self.total, self.step)

    def sink_logit(self) -> float:
        return sink_logit_at(self.r.sink_logit, self.r.sink_ramp, 1.0)  # where the main stage left it

    def plan_step(self) -> int:
        """The curriculum step this step draws its batch from: the main stage's last ``total`` (this stage's
        steps)."""
        return self.r.steps - self.total + self.step

    def layout(self) -> str:
        """The scene layout of this stage's descriptions and captions."""
        return self.r.layout

    def plan(self):
        """(task, layout, [(seed, index, n_objects)], canvas strength) of this step's batch."""
        r = self.r
        return batch_plan(r.polish_seed, self.plan_step(), r.steps, r.batch_scale, self.layout(), r.polish_mix)

    def ground_spread(self) -> bool:
        return self.plan()[0] in self.r.polish_ground_spread

    def batch(self) -> dict:
        r = self.r
        return make_batch(self.builder, r.polish_seed, self.plan_step(), r.steps, r.batch_scale, self.layout(),
                          ground=r.polish_ground_tasks if r.ground_loss else (), mix=r.polish_mix)[1]


def load_into(path: Path, model, opt, recipe: Recipe, fields: tuple[str, ...], resume: bool = True,
              device=None) -> tuple[int, float]:
    """Restore ``model`` and ``opt`` from the checkpoint at ``path`` (see ``checkpoints.read``); (step, seconds
    trained)."""
    ck = checkpoints.read(path, recipe, fields, device or next(model.parameters()).device, resume)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    print(f"resumed from {path} at step {ck['step']} ({ck['elapsed'] / 60:.1f} min trained)", flush=True)
    return ck["step"], ck["elapsed"]
